"""Checkpoints that survive a crash and load anywhere: the unwrapped state dict, optimizer and
``extra`` written by rank 0 as a new generation (:mod:`minidist.checkpoint_io`), plus each rank's
RNG and per-rank ``states``, so a resume is bit-identical. Differing replicas are refused.
Design notes: docs/design/data_parallel.md
"""

from __future__ import annotations

import os
import random
import sys
import warnings

import torch
import torch.distributed as dist

from ..checkpoint_io import (agree, check_tensors, open_generation, rank_name, read_part,
                             save_generation)
from ..state import (collect, load_numpy_rng_state, numpy_rng_state, require, restore,
                     scope_of)
from .replicas import unwrap

__all__ = ["save_checkpoint", "load_checkpoint", "strip_prefix", "rank_state",
           "restore_rank_state", "FILE"]

FILE = "checkpoint.pt"   # rank 0's file in each generation folder


def strip_prefix(state: dict, prefix: str = "module.") -> dict:
    """``{"module.w": t}`` → ``{"w": t}`` when every key carries the prefix (else unchanged)."""
    if state and all(k.startswith(prefix) for k in state):
        return {k[len(prefix):]: v for k, v in state.items()}
    return state


def rank_state() -> dict:
    """This rank's random state: torch CPU, CUDA (if initialised), Python ``random``, NumPy."""
    state = {"cpu": torch.get_rng_state(), "python": random.getstate(), "numpy": _numpy_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rank_state(state: dict) -> None:
    """Undo :func:`rank_state`: this rank's generators continue where they were."""
    torch.set_rng_state(state["cpu"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    _restore_numpy(state.get("numpy"))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _numpy_state():
    np = sys.modules.get("numpy")               # only when something loaded NumPy
    return None if np is None else numpy_rng_state(np.random)


def _restore_numpy(state) -> None:
    if state is not None:
        import numpy as np
        load_numpy_rng_state(np.random, state)


def _sharded_model(model) -> bool:
    """A ``fully_shard`` model (units marked ``_fsdp``; read without importing sharding)."""
    return any(getattr(m, "_fsdp", None) is not None for m in unwrap(model).modules())


def save_checkpoint(path: str | os.PathLike, model, optimizer=None, extra: dict | None = None,
                    group=None, keep: int = 1, states: dict | None = None) -> str:
    """Save ``model``, ``optimizer`` (plain or ZeRO-1/2), ``extra`` and ``states`` as a new generation
    of ``path``, keeping ``keep``; returns its folder. Collective. Raises on every rank before
    writing: ``TypeError`` (a ``fully_shard`` model, non-plain data), ``ValueError`` (replicas
    differ); ``OSError`` for a failed write (others: ``RuntimeError``)."""
    path = os.fspath(path)
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    where = f"save_checkpoint (rank {rank})"
    if _sharded_model(model):                     # every rank sees the same model: no hang
        raise TypeError(f"{where}: the model is sharded by fully_shard (ZeRO-3), so rank 0 does "
                        "not hold it; use minidist.sharding.checkpoints.save_full_checkpoint "
                        "(gathers it) or save_sharded_checkpoint (one file per rank)")
    # every rank: a ZeRO optimizer's state_dict all-gathers its shards (rank 0 alone would hang)
    optim_state = optimizer.state_dict() if optimizer is not None else None
    model_state = unwrap(model).state_dict()
    replicas: dict = {"the model": dict(unwrap(model).named_parameters())}   # buffers may differ
    if optim_state is not None:
        replicas["the optimizer"] = optim_state
    replicated, per_rank = collect(states, where, group, replicas=replicas, extra=extra)
    parts: dict = {rank_name(rank): {"rng": rank_state(), "states": per_rank}}
    if rank == 0:
        parts[FILE] = {"model": model_state, "optimizer": optim_state,
                       "extra": extra or {}, "states": replicated}
    return save_generation(path, parts, where=where, kind="replicated",
                           meta={"optimizer": type(optimizer).__name__ if optimizer else None,
                                 "states": {n: scope_of(o, n, where)
                                            for n, o in (states or {}).items()},
                                 **({"step": extra["step"]} if isinstance(extra, dict) and
                                    isinstance(extra.get("step"), int) else {})},
                           group=group, keep=keep)


def load_checkpoint(path: str | os.PathLike, model, optimizer=None, map_location="cpu",
                    strict: bool = True, group=None, states: dict | None = None,
                    restore_rng: bool = True, generation: int | None = None,
                    fallback: bool = False) -> dict:
    """Load the newest complete generation of ``path`` (or ``generation``, or with ``fallback`` the
    newest that verifies; or a ``torch.save`` file) into ``model``, ``optimizer``, ``states`` and this
    rank's RNG; returns ``extra``. Collective: ``FileNotFoundError``, ``ValueError``, ``KeyError``."""
    path = os.fspath(path)
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    where = f"load_checkpoint (rank {rank})"
    multi = dist.is_initialized() and world > 1
    error: Exception | None = None
    state: dict = {}
    mine: dict | None = None
    saved_world = None
    file = path
    try:
        if os.path.isfile(path):                  # a plain torch.save file (other code wrote it)
            state = _load_plain(path, where, map_location)
        else:
            if not os.path.exists(path):
                raise FileNotFoundError(f"{where}: no checkpoint at {path!r}")
            folder, manifest = open_generation(path, where, "replicated", generation=generation,
                                               fallback=fallback)
            file = os.path.join(folder, FILE)
            state = read_part(folder, manifest, FILE, where, map_location)
            saved_world = manifest["world_size"]
            if saved_world == world and rank_name(rank) in manifest["files"]:
                mine = read_part(folder, manifest, rank_name(rank), where, map_location)
        model_state = (state["model"] if "model" in state and isinstance(state["model"], dict)
                       else state)
        model_state = strip_prefix(model_state)
        check_tensors(where, file, model_state, unwrap(model).state_dict(), strict=strict)
        if optimizer is not None and state.get("optimizer") is None:
            raise KeyError(f"{where}: {file!r} holds no optimizer state")
        saved = {**state.get("states", {}), **(mine or {}).get("states", {})}
        require(states, saved, where, file, saved_world, world)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        error = e
    if multi:
        agree(where, error, group)                # every rank loads, or none does
    elif error is not None:
        raise error
    unwrap(model).load_state_dict(model_state, strict=strict)
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    try:                                          # after the model: DiLoCo's replica wins
        restore(states, saved)
        error = None
    except (ValueError, KeyError, RuntimeError) as e:
        error = e
    if multi:
        agree(where, error, group)
    elif error is not None:
        raise error
    if restore_rng and mine is not None:
        restore_rank_state(mine["rng"])
    elif restore_rng and saved_world is not None and dist.is_initialized():
        warnings.warn(f"{where}: {path!r} holds the random state of {saved_world} ranks, this "
                      f"job has {world}: random state not restored, so the run will not repeat "
                      "the original one", stacklevel=2)
    return state.get("extra", {})


def _load_plain(path: str, where: str, map_location):
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:                        # noqa: BLE001 (torch says "Errno 22", no name)
        raise ValueError(f"{where}: {path} is not a readable checkpoint (truncated or corrupted? "
                         f"{size_of(path)} bytes): {type(e).__name__}: {e}") from e


def size_of(path: str) -> int | str:
    try:
        return os.path.getsize(path)
    except OSError:
        return "?"
