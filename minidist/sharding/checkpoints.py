"""Checkpoints of ZeRO-1/2/3 runs that never destroy the last good one (:mod:`minidist.checkpoint_io`
generations): :func:`save_full_checkpoint` (one file, any world size) or
:func:`save_sharded_checkpoint` (per rank, same world size), for a replicated model with a
:class:`~.zero.ShardedOptimizer` or a ``fully_shard`` model. Collective over ``group``.
Design notes: docs/design/sharding.md
"""

from __future__ import annotations

import os

from ..checkpoint_io import (agree, check_tensors, open_generation, rank_name, read_part,
                             save_generation)
from ..comm.p2p import group_rank_world
from ..data_parallel.checkpoint import (FILE, _sharded_model, load_checkpoint, rank_state,
                                        restore_rank_state, save_checkpoint)
from ..state import collect, require, restore
from ..data_parallel.replicas import unwrap
from . import fsdp_state
from .zero import ShardedOptimizer

__all__ = ["save_full_checkpoint", "load_full_checkpoint", "save_sharded_checkpoint",
           "load_sharded_checkpoint", "shard_name"]


def shard_name(rank: int) -> str:
    """Rank ``rank``'s file in a sharded generation."""
    return f"shard{rank:05d}.pt"


def save_full_checkpoint(path, model, optimizer=None, extra: dict | None = None, group=None,
                         keep: int = 1, states: dict | None = None) -> str:
    """One file with the unsharded model and optimizer state (rank 0 writes) and every rank's
    own file (its random state and per-rank ``states``, :mod:`minidist.state`); collective."""
    if not _sharded_model(model):                 # ZeRO-1/2 or plain: data parallel's save
        return save_checkpoint(path, model, optimizer, extra=extra, group=group, keep=keep,
                               states=states)
    rank, _ = group_rank_world(group)
    where = f"save_full_checkpoint (rank {rank})"
    replicated, per_rank = collect(states, where, group, extra=extra)
    state = {"model": fsdp_state.full_state_dict(model),
             "optimizer": (fsdp_state.full_optim_state_dict(model, optimizer)
                           if optimizer is not None else None), "extra": extra or {},
             "states": replicated}
    parts: dict = {rank_name(rank): {"rng": rank_state(), "states": per_rank}}
    if rank == 0:
        parts[FILE] = state
    return save_generation(path, parts, where=where, kind="full-zero3", group=group, keep=keep)


def load_full_checkpoint(path, model, optimizer=None, group=None, states: dict | None = None,
                         generation: int | None = None, fallback: bool = False) -> dict:
    """Load a generation of :func:`save_full_checkpoint` at any world size; returns ``extra``.
    Random state and ``states`` come back only at the saving world size. Collective: one rank's error
    (missing, corrupted, shape, missing state) is every rank's."""
    if not _sharded_model(model):
        return load_checkpoint(path, model, optimizer, group=group, restore_rng=False,
                               states=states, generation=generation, fallback=fallback)
    rank, world = group_rank_world(group)
    where = f"load_full_checkpoint (rank {rank})"
    expected = fsdp_state.full_state_dict(model)  # collective, before any rank can fail
    error: Exception | None = None
    state: dict = {}
    saved: dict = {}
    try:
        folder, manifest = open_generation(path, where, "full-zero3", generation=generation,
                                           fallback=fallback)
        state = read_part(folder, manifest, FILE, where)
        check_tensors(where, os.path.join(folder, FILE), state["model"], expected)
        if optimizer is not None and state["optimizer"] is None:
            raise KeyError(f"{where}: {folder} holds no optimizer state")
        saved = dict(state["states"])
        if manifest["world_size"] == world:
            saved.update(read_part(folder, manifest, rank_name(rank), where)["states"])
        require(states, saved, where, folder, manifest["world_size"], world)
    except (OSError, ValueError, KeyError) as e:
        error = e
    agree(where, error, group)
    fsdp_state.load_full_state_dict(model, state["model"])
    if optimizer is not None:
        fsdp_state.load_full_optim_state_dict(model, optimizer, state["optimizer"])
    restore(states, saved)
    return state["extra"]


def _sharded_parts(model, optimizer, where: str, rank: int) -> dict:
    if _sharded_model(model):                     # ZeRO-3: every rank its shards
        return {"model": model.state_dict(),
                "optimizer": optimizer.state_dict() if optimizer is not None else None}
    if isinstance(optimizer, ShardedOptimizer):   # ZeRO-1/2: every rank its optimizer slices
        return {"model": unwrap(model).state_dict() if rank == 0 else None,
                "optimizer": {"shard_numels": optimizer.shard_numels(),
                              "state": optimizer.optim.state_dict()}}
    raise TypeError(f"{where}: nothing here is sharded (a replicated {type(unwrap(model)).__name__}"
                    f" with {type(optimizer).__name__}): use "
                    "minidist.data_parallel.save_checkpoint")


def save_sharded_checkpoint(path, model, optimizer=None, extra: dict | None = None, group=None,
                            keep: int = 1, states: dict | None = None) -> str:
    """Every rank writes only what it owns (see the table), its random state and the objects of
    ``states`` (:mod:`minidist.state`); collective. Returns the generation's folder."""
    rank, world = group_rank_world(group)
    where = f"save_sharded_checkpoint (rank {rank})"
    replicated, per_rank = collect(states, where, group, check_replicated=False, extra=extra)
    part = {**_sharded_parts(model, optimizer, where, rank), "extra": extra or {},
            "rng": rank_state(), "states": {**replicated, **per_rank}}
    kind = "sharded-zero3" if _sharded_model(model) else "sharded-zero12"
    return save_generation(path, {shard_name(rank): part}, where=where, kind=kind, group=group,
                           keep=keep)


def load_sharded_checkpoint(path, model, optimizer=None, group=None, states: dict | None = None,
                            restore_rng: bool = True, generation: int | None = None,
                            fallback: bool = False) -> dict:
    """Load a generation of :func:`save_sharded_checkpoint` (same world size); returns ``extra``.
    Collective: one rank's error is every rank's."""
    rank, world = group_rank_world(group)
    where = f"load_sharded_checkpoint (rank {rank})"
    zero3 = _sharded_model(model)
    error: Exception | None = None
    state: dict = {}
    model_state: dict = {}
    try:
        if not zero3 and not isinstance(optimizer, ShardedOptimizer):
            _sharded_parts(model, optimizer, where, rank)   # the same TypeError as the save
        folder, manifest = open_generation(path, where, "sharded-zero3" if zero3 else
                                           "sharded-zero12", world_size=world,
                                           generation=generation, fallback=fallback)
        state = read_part(folder, manifest, shard_name(rank), where)
        require(states, state["states"], where, folder)
        model_state = state["model"] if zero3 else (
            state["model"] if rank == 0 else read_part(folder, manifest, shard_name(0),
                                                       where)["model"])
        target = model if zero3 else unwrap(model)
        try:
            check_tensors(where, os.path.join(folder, shard_name(rank if zero3 else 0)),
                          model_state, target.state_dict())
        except ValueError as e:
            if not zero3:
                raise
            # per-parameter units keep the original names; the shapes are this rank's rows
            raise ValueError(f"{e} (shapes of this rank's dim-0 shards: the checkpoint was "
                             "written for parameters of other shapes)") from None
        if isinstance(optimizer, ShardedOptimizer):
            saved = state["optimizer"]["shard_numels"]
            if list(saved) != optimizer.shard_numels():
                raise ValueError(f"{where}: {shard_name(rank)} holds ZeRO shards of {saved} "
                                 f"elements, this optimizer's are {optimizer.shard_numels()}")
        elif optimizer is not None and state["optimizer"] is None:
            raise KeyError(f"{where}: {folder} holds no optimizer state")
    except (OSError, ValueError, KeyError, TypeError) as e:
        error = e
    agree(where, error, group)
    (model if zero3 else unwrap(model)).load_state_dict(model_state)
    if isinstance(optimizer, ShardedOptimizer):
        optimizer.optim.load_state_dict(state["optimizer"]["state"])
    elif optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    restore(states, state["states"])
    if restore_rng:
        restore_rank_state(state["rng"])
    return state["extra"]
