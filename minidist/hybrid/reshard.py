"""Change the 3-D layout of a checkpoint: save at one (dp, pp, tp), resume at another.

:mod:`.checkpoint` writes one file per rank and reloads only on the grid that wrote it (bit for
bit). This file writes a **layout-free** checkpoint instead — what one process training
``GPT(cfg)`` would hold:

* ``model``: the full, unpadded parameters and buffers under the one-process GPT's names (each
  stage's TP shards all-gathered over the TP group, the stages collected from every pipeline
  rank);
* ``optimizer``: per parameter name, its optimizer state (AdamW's ``exp_avg``/``exp_avg_sq`` and
  ``step``; SGD's ``momentum_buffer``) in the parameter's full shape — TP shards gathered along the
  parameter's ``partition_dim``; a :class:`~.dp.ZeRO1Optimizer`'s 1/dp slices consolidated first
  (:meth:`~minidist.sharding.zero.ShardedOptimizer.state_dict`, a collective over DP), a
  ``fully_shard`` stage's (zero3, hsdp) dim-0 pieces made whole over its shard group first; and the
  hyperparameters of the first param group (every group of :func:`~.dp.make_optimizer` has the same);
* experts (``moe=``, sharded over EP) under their one-process index, every expert once;
* ``step``, ``cfg``, the layout that wrote it, and ``not_carried``.

Loading cuts every tensor again for the new rank (:func:`~minidist.tensor_parallel.sharding.
shard_state_dict`, zero padding of the vocabulary included) and gives each optimizer its slices,
so training continues as the unbroken run would (same numbers up to the order of sums, which a
different layout changes). Like Megatron-LM's checkpoint conversion, what is per-rank by nature is
**not carried**, and the file says so: the random states (torch's generators and the dropout
tracker's: a new layout has other ranks, so dropout masks restart from the seeds) and any data
sampler position (pass ``step`` and rebuild the sampler). A different model config is a
``ValueError`` naming the fields.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist

from ..checkpoint_io import agree, open_generation, read_part, save_generation
from ..sharding import fsdp_state
from .dp import sharded_parts
from .moe import global_names, local_names
from ..sharding.zero import ShardedOptimizer
from ..tensor_parallel.sharding import gather_tensor, gather_tensors, shard_state_dict, shard_tensor

__all__ = ["save_layout_free", "load_layout_free", "NOT_CARRIED", "FORMAT"]

FORMAT = "minidist-layout-free-checkpoint/1"
FILE = "layout_free.pt"   # rank 0's one file in each generation
NOT_CARRIED = ("random states (torch generators, dropout tracker): dropout restarts from the seeds",
               "data sampler position: rebuild it for the returned step",
               "gradients (save between steps)")


def _cfg(model) -> dict:
    c = model.cfg
    if dataclasses.is_dataclass(c) and not isinstance(c, type):
        return dataclasses.asdict(c)
    return dict(vars(c))


def _named(model):
    """(name, parameter, stage) of this rank's stages, every name of a tied parameter."""
    for s in sorted(model.stages):
        for name, p in model.stages[s].named_parameters(remove_duplicate=False):
            yield name, p, model.stages[s]


def _sharded(stage) -> bool:
    """A ``fully_shard`` stage (zero3, hsdp): its parameters are dim-0 pieces of the TP shards."""
    return getattr(stage, "_fsdp", None) is not None


def _local(stage) -> dict:
    """This rank's TP-shard state dict of ``stage``, whole over data parallelism (collective over
    the shard group for a ``fully_shard`` stage)."""
    return fsdp_state.full_state_dict(stage) if _sharded(stage) else dict(stage.state_dict())


def _full_state(opt_state: dict, p, group, shape=None) -> dict:
    out = {}
    shape = tuple(p.shape) if shape is None else tuple(shape)
    for key in sorted(opt_state):
        v = opt_state[key]
        if torch.is_tensor(v) and v.dim() > 0 and tuple(v.shape) == shape:
            v = gather_tensor(v, getattr(p, "partition_dim", None), getattr(p, "full_size", None),
                              group)
        out[key] = v.detach().cpu().clone() if torch.is_tensor(v) else v
    return out


def _optimizer_states(model, optimizer, shapes: dict) -> tuple[dict, dict]:
    """{param name: full state}, hyperparameters. Collective over TP (and DP for ZeRO-1/3);
    ``shapes``: each name's TP-shard shape."""
    if optimizer is None:
        return {}, {}
    tp = model.grid.tp_group
    if any(_sharded(model.stages[s]) for s in model.stages):   # zero3, hsdp: DP-whole first
        per = {}
        for s in sorted(model.stages):
            per.update(fsdp_state.full_optim_state_dict(model.stages[s], optimizer)["state"])
        per = {name: per.get(name, {}) for name, _, _ in _named(model)}
        groups = optimizer.state_dict()["param_groups"]
    elif isinstance(optimizer, ShardedOptimizer):
        per, groups = {}, None
        for part in sharded_parts(optimizer):   # ZeRO-1's dense slices over DP×CP; experts' over expert-DP
            full = part.state_dict()                        # consolidated over its group, by index
            index = {id(p): i for i, p in enumerate(part.all_params)}
            per.update({name: full["state"].get(index[id(p)], {}) for name, p, _ in _named(model)
                        if id(p) in index})
            groups = groups or full["param_groups"]
    else:
        per = {name: optimizer.state.get(p, {}) for name, p, _ in _named(model)}
        groups = optimizer.state_dict()["param_groups"]
    params = {name: p for name, p, _ in _named(model)}
    states = {name: _full_state(per[name], params[name], tp, shapes.get(name))
              for name in sorted(per)}
    hyper = {k: v for k, v in groups[0].items() if k != "params"} if groups else {}
    return states, hyper


def save_layout_free(path: str | os.PathLike, model, optimizer=None, step: int = 0,
                     keep: int = 1) -> str:
    """Write the layout-free checkpoint of ``model`` (a :class:`~.stages.HybridGPT`) and
    ``optimizer`` (plain ``torch.optim`` or :class:`~.dp.ZeRO1Optimizer`) as a new generation of
    the checkpoint folder ``path`` (:mod:`minidist.checkpoint_io`: rank 0 writes, checked,
    checksummed, the ``keep`` newest kept); returns the generation's folder. Collective over the
    world: call on every rank, between steps."""
    grid = model.grid
    weights, shapes = {}, {}
    for s in sorted(model.stages):
        local = _local(model.stages[s])
        shapes.update({k: v.shape for k, v in local.items()})
        weights.update({k: v.cpu() for k, v in
                        gather_tensors(model.stages[s], local, grid.tp_group).items()})
    states, hyper = _optimizer_states(model, optimizer, shapes)
    if getattr(model, "moe", None) is not None:   # local expert j is expert expert_ids[j]
        weights, states = (global_names(weights, model.expert_ids),
                           global_names(states, model.expert_ids))
    # one copy per pipeline stage; with experts over EP, one per expert-parallel rank too
    mine = ((weights, states) if grid.tp_rank == 0 and (grid.dp_rank == 0 or (
        getattr(model, "moe", None) is not None and grid.ep_size > 1)) else None)
    every: list = [None] * grid.world_size
    if dist.is_initialized() and grid.world_size > 1:
        dist.all_gather_object(every, mine)
    else:
        every = [mine]
    parts = {}
    if grid.rank == 0:
        full_w: dict = {}
        full_s: dict = {}
        for part in every:
            if part is not None:
                full_w.update(part[0])
                full_s.update(part[1])
        parts[FILE] = {"format": FORMAT, "step": int(step), "cfg": _cfg(model),
                       "layout": {"dp": grid.dp_size, "pp": grid.pp_size, "tp": grid.tp_size},
                       "model": full_w, "optimizer": full_s, "hyper": hyper,
                       "optimizer_kind": None if optimizer is None else type(optimizer).__name__,
                       "not_carried": list(NOT_CARRIED)}
    return save_generation(path, parts, where=f"save_layout_free (rank {grid.rank})",
                           kind="layout-free", meta={"step": int(step)}, keep=keep)


def load_layout_free(path: str | os.PathLike, model, optimizer=None,
                     generation: int | None = None, fallback: bool = False) -> dict:
    """Load a generation of :func:`save_layout_free` (``generation``/``fallback``: see
    :func:`minidist.checkpoint_io.open_generation`; sizes and checksums verified) into ``model``
    and ``optimizer`` on *any* grid. Returns ``{"step", "saved_layout", "not_carried"}``.
    Raises ``ValueError`` (naming the rank) for another model config, a corrupted file, or an
    optimizer given but none saved — on every rank (one all-gather of the outcome)."""
    grid = model.grid
    where = f"load_layout_free (rank {grid.rank}, {os.fspath(path)!r})"
    blob: dict = {}
    error: Exception | None = None
    try:
        folder, manifest = open_generation(path, where, "layout-free", generation=generation,
                                           fallback=fallback)
        blob = read_part(folder, manifest, FILE, where)
        diff = sorted(k for k in set(blob["cfg"]) | set(_cfg(model))
                      if blob["cfg"].get(k) != _cfg(model).get(k))
        if diff:
            raise ValueError(f"{where}: saved for another model config (differs in {diff})")
        if optimizer is not None and not blob["optimizer"] and blob["optimizer_kind"] is None:
            raise ValueError(f"{where}: the checkpoint holds no optimizer state")
    except (OSError, ValueError, KeyError) as e:
        error = e
    agree(where, error)
    if getattr(model, "moe", None) is not None:   # the file's expert g is local j here
        blob = {**blob, "model": local_names(blob["model"], model.expert_ids),
                "optimizer": local_names(blob["optimizer"], model.expert_ids)}
    tp = grid.tp_group
    sharded = [s for s in sorted(model.stages) if _sharded(model.stages[s])]
    with torch.no_grad():
        for s in sorted(model.stages):
            stage = model.stages[s]
            dev = next(stage.parameters()).device
            if s in sharded:
                _load_sharded_stage(stage, optimizer, blob, tp)
            else:
                stage.load_state_dict({k: v.to(dev) for k, v in
                                       shard_state_dict(blob["model"], stage, tp).items()})
    if optimizer is not None and not sharded:
        _load_optimizer(optimizer, model, blob, tp)
    return {"step": blob["step"], "saved_layout": blob["layout"],
            "not_carried": blob["not_carried"]}


def _load_sharded_stage(stage, optimizer, blob, tp) -> None:
    """A ``fully_shard`` stage: cut each tensor to this rank's TP shard, then let the units take
    their dim-0 pieces (:func:`~minidist.sharding.fsdp_state.load_full_state_dict`)."""
    shapes = {k: v.shape for k, v in _local(stage).items()}
    params = dict(stage.named_parameters(remove_duplicate=False))
    dim = {k: getattr(params.get(k), "partition_dim", None) for k in shapes}
    fsdp_state.load_full_state_dict(stage, {k: shard_tensor(blob["model"][k], dim[k], shapes[k], tp)
                                            for k in shapes})
    if optimizer is None:
        return
    state = {name: {key: (shard_tensor(v, dim[name], shapes[name], tp)
                          if torch.is_tensor(v) and v.dim() > 0 else
                          v.clone() if torch.is_tensor(v) else v) for key, v in st.items()}
             for name, st in blob["optimizer"].items() if name in params and st}
    fsdp_state.load_full_optim_state_dict(
        stage, optimizer, {"state": state,
                           "param_groups": [dict(blob["hyper"]) for _ in optimizer.param_groups]})


def _shard_state(full: dict, p, group) -> dict:
    out = {}
    for key, v in full.items():
        if torch.is_tensor(v) and v.dim() > 0:
            v = shard_tensor(v, getattr(p, "partition_dim", None), p.shape, group)
            v = v.to(p.device)
        elif torch.is_tensor(v):
            v = v.clone()
        out[key] = v
    return out


def _load_optimizer(optimizer, model, blob, tp) -> None:
    saved = blob["optimizer"]
    names: dict = {}
    for name, p, _ in _named(model):
        names.setdefault(id(p), name)
    if isinstance(optimizer, ShardedOptimizer):
        for part in sharded_parts(optimizer):
            state = {i: _shard_state(saved.get(names[id(p)], {}), p, tp)
                     for i, p in enumerate(part.all_params)}
            groups = [{**blob["hyper"], "params": []} for _ in part.param_groups]
            part.load_state_dict({"state": state, "param_groups": groups})
        return
    for g in optimizer.param_groups:
        g.update(blob["hyper"])
        for p in g["params"]:
            full = saved.get(names[id(p)], {})
            if full:
                optimizer.state[p] = _shard_state(full, p, tp)
