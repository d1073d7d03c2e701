"""Checkpoint and resume of a 3-D (dp x pp x tp) run: one file per rank, bit-identical resume.

No rank holds the whole model, so every rank writes its own file (Megatron-LM writes one per
model-parallel rank, ``mp_rank_XX_YYY/model_optim_rng.pt``, with the RNG states inside):

* **model**: the ``state_dict`` of each of this rank's stages (its TP shards of its layers; under
  ZeRO-3 / HSDP its ``fully_shard`` shards: every DP replica of an HSDP shard writes its own copy);
* **optimizer**: a plain ``torch.optim`` optimizer's ``state_dict`` (over this rank's parameters:
  no communication), or for ZeRO-1 (:class:`~minidist.sharding.zero.ShardedOptimizer`) only the
  inner optimizer over this rank's 1/dp slices — each replica saves its own shard of the Adam
  moments, as Megatron-LM's distributed optimizer does, instead of gathering them all;
* **random state**: torch's CPU generator, the CUDA generators when CUDA is initialised, Python's
  ``random``, NumPy's global generator when NumPy is loaded, and the dropout tracker's generators
  (:meth:`~minidist.tensor_parallel.random.RNGTracker.state_dict`) — every rank its own, since
  ranks draw different dropout masks;
* **data position and other state**: ``step`` and the objects of ``states`` (the library's
  state protocol, :mod:`minidist.state`: a sampler's epoch and position, a data generator, a
  loss scaler...), each rank its own;
* **who wrote it**: the grid ``(dp, pp, tp)`` and ``cp``, model chunks, sequence parallelism and
  the model config, checked on load.

Files: ``folder`` is a folder of generations (:mod:`minidist.checkpoint_io`): each save writes
``folder/gen-NNNNNN/rank{r:05d}.pt`` on every rank (each write checked, flushed and fsync'ed),
agrees every rank's outcome, and only then rank 0 writes ``manifest.json`` (grid, step, world size,
each file's size, SHA-256 and shapes) atomically and retires the previous generation. A rank killed
or a disk full mid-save leaves the previous generation as the newest complete one: loading takes
it (and warns that it skipped the unfinished one). A rank file that differs from the manifest
(size, checksum: truncated, corrupted, or copied from another save) is refused naming the file:
never a resume from a mix of two steps.

Resuming on the grid that wrote the checkpoint continues the run bit for bit: the same losses
and, in fp32, the same parameters (``==``) as a run that never stopped. Another grid (or chunks,
sequence parallelism, model config) is a ``ValueError`` naming the rank and both grids: the shards
would not fit: to change the layout, save a layout-free checkpoint
(:func:`~.reshard.save_layout_free`: full weights and optimizer state, loadable on any grid).
"""

from __future__ import annotations

import dataclasses
import json
import os

from ..checkpoint_io import (agree, check_tensors, flatten, newest, open_generation,
                             rank_name, read_part, save_generation)
from ..data_parallel.checkpoint import rank_state, restore_rank_state
from ..sharding.zero import ShardedOptimizer
from ..state import collect, require, restore
from ..tensor_parallel.random import RNGTracker, get_rng_tracker
from .dp import sharded_parts

__all__ = ["save_hybrid_checkpoint", "load_hybrid_checkpoint", "rank_file", "rank_name", "FORMAT"]

FORMAT = "minidist-hybrid-checkpoint/2"


def rank_file(folder: str | os.PathLike, rank: int) -> str:
    """The path of global rank ``rank``'s file in the newest complete generation of ``folder``."""
    gen = newest(folder)
    if gen is None:
        raise FileNotFoundError(f"rank_file: no complete checkpoint under {os.fspath(folder)!r}")
    return os.path.join(gen, rank_name(rank))


def _layout(model) -> dict:
    g = model.grid
    cfg = model.cfg
    return {"dp": g.dp_size, "pp": g.pp_size, "tp": g.tp_size, "cp": g.cp_size, "ep": g.ep_size,
            "world": g.world_size, "chunks": model.chunks,
            "sequence_parallel": bool(model.sequence_parallel), "moe": model.moe,
            "zero3": any(hasattr(m, "_fsdp") for m in model.stages.values()),
            **({"hsdp": True} if _hsdp(model) else {}),   # absent otherwise: older files load
            "cfg": dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else dict(vars(cfg))}


def _hsdp(model) -> bool:
    """The stages are HSDP units with a replicate group (``dp_mode="hsdp"`` with dp > 1): their
    shards are 1/cp, not ZeRO-3's 1/(dp·cp); with dp == 1 the two layouts are the same."""
    return any(getattr(getattr(m, "_fsdp", None), "rep", None) is not None
               for m in model.stages.values())


def _describe(layout: dict) -> str:
    cp, ep, moe = layout.get("cp", 1), layout.get("ep", 1), layout.get("moe")
    return (f"dp={layout['dp']} pp={layout['pp']} tp={layout['tp']}"
            + (f" cp={cp}" if cp != 1 else "") + (f" ep={ep}" if ep != 1 else "")
            + f" chunks={layout['chunks']} sequence_parallel={layout['sequence_parallel']}"
            + (f" moe={moe}" if moe else "")
            + (" hsdp" if layout.get("hsdp") else " zero3" if layout.get("zero3") else ""))


def save_hybrid_checkpoint(folder: str | os.PathLike, model, optimizer=None, step: int = 0,
                           extra: dict | None = None, tracker: RNGTracker | None = None,
                           keep: int = 1, states: dict | None = None) -> str:
    """Every rank writes its own file of ``model`` (a :class:`~.stages.HybridGPT`: ``stages``,
    ``grid``, ``cfg``), ``optimizer``, random state, ``step``, ``extra`` (a small dict, e.g. the
    losses so far) and the stateful ``states`` (``{name: object}``, e.g. the sampler or data
    position: :mod:`minidist.state`) into ``folder``; then all ranks wait; then rank 0 writes the
    manifest (see the module notes); returns the new generation's folder. Collective over the
    world: call it on every rank, between steps (gradients are not saved). A ``states`` object
    that is not stateful or not plain data is refused on every rank before anything is written;
    a failed write on any rank (``OSError``; ``ENOSPC`` says the disk is full) raises on every
    rank and keeps the previous generation."""
    if not all(hasattr(model, a) for a in ("stages", "grid", "cfg")):
        raise TypeError("save_hybrid_checkpoint: model must be a HybridGPT (stages, grid, cfg), "
                        f"got {type(model).__name__}; use minidist.data_parallel.save_checkpoint "
                        "or minidist.sharding.checkpoints for other models")
    grid = model.grid
    where = f"save_hybrid_checkpoint (rank {grid.rank})"
    replicated, per_rank = collect(states, where, check_replicated=False, extra=extra)
    state = {
        "format": FORMAT, "rank": grid.rank, "step": int(step), "layout": _layout(model),
        "coords": (grid.dp_rank, grid.pp_rank, grid.tp_rank, grid.cp_rank),
        "model": {int(s): m.state_dict() for s, m in sorted(model.stages.items())},
        "optimizer": _optimizer_state(optimizer),
        "rng": {**rank_state(), "tracker": (tracker or get_rng_tracker()).state_dict()},
        "states": {**replicated, **per_rank},
        "extra": extra or {},
    }
    return save_generation(folder, {rank_name(grid.rank): state}, where=where, kind="hybrid",
                           meta={"format": FORMAT, "step": int(step), "layout": state["layout"]},
                           keep=keep)


def _optimizer_state(optimizer):
    if optimizer is None:
        return None
    if isinstance(optimizer, ShardedOptimizer):   # this replica's slices only (ZeRO-1/2)
        parts = sharded_parts(optimizer)                   # with experts apart: theirs too
        return {"kind": "zero", "shard_numels": [n for p in parts for n in p.shard_numels()],
                "state": optimizer.optim.state_dict(),
                "experts": [p.optim.state_dict() for p in parts[1:]]}
    return {"kind": "plain", "state": optimizer.state_dict()}


def load_hybrid_checkpoint(folder: str | os.PathLike, model, optimizer=None,
                           restore_rng: bool = True, tracker: RNGTracker | None = None,
                           states: dict | None = None, generation: int | None = None,
                           fallback: bool = False) -> dict:
    """Load this rank's file into ``model``'s stages, ``optimizer``, every object of ``states``
    and (with ``restore_rng``) every generator and the dropout tracker. Returns ``{"step": int,
    "extra": dict, "generation": folder}``; continue with step ``step`` (the number of steps
    done). ``folder``, ``generation`` and ``fallback`` pick the generation as
    :func:`minidist.checkpoint_io.open_generation` says (newest complete; a number; the newest
    that verifies). Collective (one all-gather over the world, so that if any rank cannot load,
    every rank raises instead of the others hanging later).

    Raises:
        FileNotFoundError: no complete generation (nothing saved there, or only saves that did
            not finish) or no file for this rank.
        ValueError: the checkpoint was written on another grid / chunks / sequence parallelism /
            model config (message: this rank, the saved and the current layout), a rank file
            truncated, corrupted or from another save (its size or SHA-256 differ from the
            manifest's), a parameter of another shape (named, expected vs found), or an
            optimizer of another kind or shard size.
        KeyError: a ``states`` object the checkpoint does not hold (named).
        RuntimeError: on the other ranks, when some rank raised one of the above.
    """
    folder = os.fspath(folder)
    grid = model.grid
    where = f"load_hybrid_checkpoint (rank {grid.rank}, {folder!r})"
    gen, state = "", {}
    failed: Exception | None = None
    try:
        gen, state = _read_and_check(folder, model, optimizer, where, generation, fallback)
        require(states, state["states"], where, gen)
    except (OSError, ValueError, KeyError) as e:
        failed = e
    agree(where, failed)                          # every rank loads, or none does
    for s, stage in model.stages.items():
        stage.load_state_dict(state["model"][s])   # copies in place: ZeRO's flat views stay
    _load_optimizer(optimizer, state["optimizer"])
    try:
        restore(states, state["states"])
        failed = None
    except (ValueError, KeyError, RuntimeError) as e:
        failed = e
    agree(where, failed)
    if restore_rng:
        restore_rank_state(state["rng"])
        (tracker or get_rng_tracker()).load_state_dict(state["rng"]["tracker"])
    return {"step": state["step"], "extra": state["extra"], "generation": gen}


def _read_and_check(folder: str, model, optimizer, where: str, generation,
                    fallback: bool) -> tuple[str, dict]:
    grid = model.grid
    gen, manifest = open_generation(folder, where, "hybrid", world_size=grid.world_size,
                                    generation=generation, fallback=fallback)
    mine = json.loads(json.dumps(_layout(model)))     # as the manifest stores it (lists, str keys)
    saved = manifest["meta"]["layout"]
    if saved != mine:
        raise ValueError(f"{where}: the checkpoint was saved on grid {_describe(saved)}"
                         f"{_cfg_note(saved, mine)}, this run is {_describe(mine)}; a "
                         "3-D checkpoint loads only on the layout that wrote it")
    name = rank_name(grid.rank)
    state = read_part(gen, manifest, name, where)
    file = os.path.join(gen, name)
    if state["step"] != manifest["meta"]["step"] or state["rank"] != grid.rank:
        raise ValueError(f"{where}: {name} is from step {state['step']} (rank {state['rank']}), "
                         f"the manifest from step {manifest['meta']['step']}: a save was "
                         "interrupted; use an older checkpoint")
    if set(state["model"]) != set(model.stages):
        raise ValueError(f"{where}: {file} holds stages {sorted(state['model'])}, this rank "
                         f"has {sorted(model.stages)}")
    check_tensors(where, file, flatten(state["model"]),
                  flatten({s: m.state_dict() for s, m in model.stages.items()}))
    _check_optimizer(where, optimizer, state["optimizer"])
    return gen, state


def _cfg_note(saved: dict, mine: dict) -> str:
    diff = sorted(k for k in set(saved["cfg"]) | set(mine["cfg"])
                  if saved["cfg"].get(k) != mine["cfg"].get(k))
    return f" (model config differs in {diff})" if diff else ""


def _check_optimizer(where: str, optimizer, saved) -> None:
    if optimizer is None:
        return
    if saved is None:
        raise ValueError(f"{where}: the checkpoint holds no optimizer state")
    zero = isinstance(optimizer, ShardedOptimizer)
    if saved["kind"] != ("zero" if zero else "plain"):
        raise ValueError(f"{where}: the checkpoint holds a {saved['kind']!r} optimizer state, this "
                         f"run uses {type(optimizer).__name__}")
    mine = [n for p in sharded_parts(optimizer) for n in p.shard_numels()] if zero else None
    if zero and list(saved["shard_numels"]) != mine:
        raise ValueError(f"{where}: saved ZeRO shards of {saved['shard_numels']} elements, this "
                         f"optimizer's are {mine}")


def _load_optimizer(optimizer, saved) -> None:
    if optimizer is None:
        return
    if isinstance(optimizer, ShardedOptimizer):
        optimizer.optim.load_state_dict(saved["state"])
        for part, state in zip(sharded_parts(optimizer)[1:], saved.get("experts", [])):
            part.optim.load_state_dict(state)
    else:
        optimizer.load_state_dict(saved["state"])
