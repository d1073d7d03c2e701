"""Checkpoints that survive a crash and load anywhere (a half-written file, a ``module.`` prefix
or a device-bound tensor must not stop a resume).

* **What is saved:** the *unwrapped* module's state dict (no ``module.`` prefix), so a checkpoint
  written during DDP training loads into the bare model and vice versa, with ``strict=True``;
  plus the optimizer state and a small ``extra`` dict (epoch, step...). Not the RNG state:
  ``extra`` comes from rank 0 alone, and every rank's own generators are saved anyway (below).
* **Who writes:** global rank 0 only (replicas are identical; W writers would race on one file),
  but every rank takes part: a ZeRO-1/2 optimizer's consolidated state dict is collective.
* **Never over the last good one:** ``path`` is a folder of generations
  (:mod:`minidist.checkpoint_io`): each save is a new ``gen-NNNNNN/checkpoint.pt``, every write
  checked (flush, fsync; a full disk says so and names the file), every rank's outcome agreed, then
  a ``manifest.json`` (size, SHA-256, shapes) written atomically; only then the old generation is
  removed. A crash or a full disk mid-save leaves the previous generation loadable.
* **Loading:** every rank reads the newest complete generation (size and checksum checked, then
  names and shapes against the model: a mismatch names the parameter, expected vs found); one
  rank's error is every rank's. A single ``torch.save`` file, even ``module.``-prefixed (saved
  from a wrapper by other code), is accepted too.
* **Each rank's own state:** ranks draw different dropout masks (and data augmentation), so
  one rank's generator restored on every rank does not continue the run. Every rank writes its
  own ``rank{r:05d}.pt``: its CPU generator, CUDA generators (when CUDA is initialised), Python
  ``random`` and NumPy state, and the per-rank objects of ``states`` (sampler position, PowerSGD
  or top-k error feedback, DiLoCo; :mod:`minidist.state`); ``load_checkpoint`` gives each rank
  back its own. Resuming is then bit-identical to the run that never stopped (tested at W = 2 and
  4 with dropout). Resuming on a different number of ranks warns and leaves the random state as
  it is (it cannot be identical then), and refuses per-rank ``states``; a single process without
  a process group loading a W-rank checkpoint (to evaluate) is quiet.
* **Replicas that differ are refused, not half-saved:** rank 0 writes the model and optimizer,
  so before anything is written every rank's digest of them is compared; a difference (DiLoCo
  mid-round, an inner optimizer local to each rank, a replica never synchronised) is a
  ``ValueError`` on every rank naming what differs — unless an object in ``states`` saves each
  rank's replica (``DiLoCo`` does).
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
    """This rank's random state: torch's CPU generator, the CUDA ones if initialised, Python's
    ``random`` and NumPy's global generator when NumPy is loaded."""
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
    """A :func:`~minidist.sharding.fsdp.fully_shard` model: rank 0 does not hold all of it.
    (``fully_shard`` marks each unit's module with ``_fsdp``; read without importing sharding,
    which imports this package.)"""
    return any(getattr(m, "_fsdp", None) is not None for m in unwrap(model).modules())


def save_checkpoint(path: str | os.PathLike, model, optimizer=None, extra: dict | None = None,
                    group=None, keep: int = 1, states: dict | None = None) -> str:
    """Save ``model``, ``optimizer``, ``extra`` and the stateful ``states`` as a new generation of
    the checkpoint folder ``path`` (see :mod:`minidist.checkpoint_io`); collective over
    ``group``: call it on every rank, with the same ``states`` names. Returns the new
    generation's folder; the ``keep`` newest generations stay.

    Rank 0 writes ``checkpoint.pt`` (model, optimizer, ``extra``, the replicated ``states``);
    every rank writes ``rank{r:05d}.pt`` (its random generators and its per-rank ``states``:
    sampler position, PowerSGD or top-k error feedback, DiLoCo; see :mod:`minidist.state`).

    ``optimizer`` may be a plain ``torch.optim`` optimizer or a ZeRO-1/2
    :class:`~minidist.sharding.zero.ShardedOptimizer` (whose consolidated ``state_dict`` is
    collective: every rank calls it here).

    Raises (on every rank, before anything is written; the previous generation kept):
        TypeError: a ``fully_shard`` (ZeRO-3) model (use :mod:`minidist.sharding.checkpoints`),
            a ``states`` object that is not stateful or not plain data, or an ``extra`` entry
            that is not plain data (named, pointing at ``states=``).
        ValueError: the model or optimizer (or a replicated state) differs between ranks, so
            rank 0's copy would not resume the others: names it and the ranks (DiLoCo
            mid-round: pass the ``DiLoCo`` object, which saves each rank's replica; a local
            inner optimizer: pass it in ``states``, which saves it per rank).
        OSError: a write failed on some rank (``ENOSPC``: the message names the file and says the
            disk is full); the other ranks raise ``RuntimeError`` quoting it.
    """
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
    """Load a generation of ``path`` into ``model`` (bare or wrapped), ``optimizer`` and every
    object of ``states`` on this rank; returns ``extra``. Restores this rank's own random state
    (``restore_rng``). ``path`` may also be one generation's folder (``path/gen-000003``) or a
    single file written by ``torch.save`` (a state dict, possibly ``module.``-prefixed).

    Which generation: the newest complete one; ``generation=n`` that one; ``fallback=True`` the
    newest whose every file verifies (a corrupt newer one is logged and warned about, never
    skipped silently). :func:`minidist.checkpoint_io.list_generations` lists them.

    Collective when a process group is initialised: an error on one rank is an error on every
    rank. Raises ``FileNotFoundError`` naming the path and rank when nothing complete is there;
    ``ValueError`` naming the file and the parameter when a file is truncated, corrupted, or does
    not fit the model (expected vs found shape), or when per-rank ``states`` were saved by
    another number of ranks; ``KeyError`` naming a ``states`` object the checkpoint lacks.
    Loading on another number of ranks warns that the random state is not restored."""
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
