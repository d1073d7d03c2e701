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
* **Each rank's own random state:** ranks draw different dropout masks (and data augmentation), so
  one rank's generator restored on every rank does not continue the run. Every rank's CPU
  generator, CUDA generators (when CUDA is initialised), Python ``random`` state and, if given, its
  sampler's ``state_dict()`` (epoch and position) are gathered into the file (``"ranks"``, one
  entry per rank); ``load_checkpoint`` gives each rank back its own. Resuming is then bit-identical
  to the run that never stopped (tested at W = 2 and 4 with dropout). Resuming on a different
  number of ranks warns and leaves the random state as it is (it cannot be identical then); a
  single process without a process group loading a W-rank checkpoint (to evaluate) is quiet.
"""

from __future__ import annotations

import os
import random
import tempfile
import warnings

import torch
import torch.distributed as dist

from ..checkpoint_io import agree, check_tensors, open_newest, read_part, save_generation
from .replicas import unwrap

__all__ = ["save_checkpoint", "load_checkpoint", "strip_prefix", "rank_state",
           "restore_rank_state", "atomic_save", "FILE"]

FILE = "checkpoint.pt"   # rank 0's file in each generation folder


def strip_prefix(state: dict, prefix: str = "module.") -> dict:
    """``{"module.w": t}`` → ``{"w": t}`` when every key carries the prefix (else unchanged)."""
    if state and all(k.startswith(prefix) for k in state):
        return {k[len(prefix):]: v for k, v in state.items()}
    return state


def rank_state(sampler=None) -> dict:
    """This rank's random state (CPU, CUDA if initialised, Python ``random``) and sampler state."""
    state = {"cpu": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if sampler is not None:
        state["sampler"] = sampler.state_dict()
    return state


def restore_rank_state(state: dict, sampler=None, rng: bool = True) -> None:
    """Undo :func:`rank_state`: this rank's generators (and ``sampler``) continue where they were."""
    if rng:
        torch.set_rng_state(state["cpu"])
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])
    if sampler is not None:
        if "sampler" not in state:
            raise KeyError("load_checkpoint: the checkpoint holds no sampler state (save it with "
                           "save_checkpoint(..., sampler=sampler))")
        sampler.load_state_dict(state["sampler"])


def _sharded_model(model) -> bool:
    """A :func:`~minidist.sharding.fsdp.fully_shard` model: rank 0 does not hold all of it.
    (``fully_shard`` marks each unit's module with ``_fsdp``; read without importing sharding,
    which imports this package.)"""
    return any(getattr(m, "_fsdp", None) is not None for m in unwrap(model).modules())


def atomic_save(obj, path: str | os.PathLike) -> None:
    """``torch.save(obj)`` into a temporary file next to ``path``, fsync'ed, then ``os.replace``:
    ``path`` holds the old file or the whole new one, never half of one (creates the folder).
    One file, not a generation: :mod:`minidist.hybrid.reshard` writes its layout-free file so."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def save_checkpoint(path: str | os.PathLike, model, optimizer=None, extra: dict | None = None,
                    group=None, sampler=None, keep: int = 1) -> str:
    """Save ``{"model", "optimizer", "extra", "ranks"}`` as a new generation of the checkpoint
    folder ``path`` (see :mod:`minidist.checkpoint_io`); collective over ``group``: call it on
    every rank. Rank 0 writes the file; ``"ranks"`` holds every rank's own random state and, when
    ``sampler`` is given (anything with ``state_dict()``), its state (see the module notes).
    Returns the new generation's folder; ``keep`` generations stay.

    ``optimizer`` may be a plain ``torch.optim`` optimizer or a ZeRO-1/2
    :class:`~minidist.sharding.zero.ShardedOptimizer` (whose consolidated ``state_dict`` is
    collective: every rank calls it here).

    Raises (on every rank, the previous generation kept):
        TypeError: a ``fully_shard`` (ZeRO-3) model: use
            :func:`minidist.sharding.checkpoints.save_full_checkpoint` or ``save_sharded``.
        OSError: a write failed on some rank (``ENOSPC``: the message names the file and says the
            disk is full); the other ranks raise ``RuntimeError`` quoting it.
    """
    path = os.fspath(path)
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    if _sharded_model(model):                     # every rank sees the same model: no hang
        raise TypeError(f"save_checkpoint (rank {rank}): the model is sharded by fully_shard "
                        "(ZeRO-3), so rank 0 does not hold it; use minidist.sharding.checkpoints."
                        "save_full_checkpoint (gathers it) or save_sharded (one file per rank)")
    mine = rank_state(sampler)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        ranks: list | None = [None] * dist.get_world_size(group) if rank == 0 else None
        dist.gather_object(mine, ranks, dst=dist.get_global_rank(group, 0) if group else 0,
                           group=group)
    else:
        ranks = [mine]
    # every rank: a ZeRO optimizer's state_dict all-gathers its shards (rank 0 alone would hang)
    optim_state = optimizer.state_dict() if optimizer is not None else None
    parts = {}
    if rank == 0:
        parts[FILE] = {"model": unwrap(model).state_dict(), "optimizer": optim_state,
                       "extra": extra or {}, "ranks": ranks}
    return save_generation(path, parts, where=f"save_checkpoint (rank {rank})", kind="replicated",
                           meta={"optimizer": type(optimizer).__name__ if optimizer else None},
                           group=group, keep=keep)


def load_checkpoint(path: str | os.PathLike, model, optimizer=None, map_location="cpu",
                    strict: bool = True, group=None, sampler=None, restore_rng: bool = True) -> dict:
    """Load the newest complete generation of ``path`` into ``model`` (bare or wrapped) and
    ``optimizer`` on this rank; returns ``extra``. Restores this rank's own random state
    (``restore_rng``) and ``sampler``'s state. ``path`` may also be a single file written by
    ``torch.save`` (a state dict, possibly ``module.``-prefixed, or this module's dict).

    Collective when a process group is initialised (one all-gather of a status flag): an error on
    one rank is an error on every rank. Raises ``FileNotFoundError`` naming the path and rank when
    nothing complete is there; ``ValueError`` naming the file and the parameter when a file is
    truncated, corrupted, or does not fit the model (expected vs found shape)."""
    path = os.fspath(path)
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    where = f"load_checkpoint (rank {rank})"
    multi = dist.is_initialized() and dist.get_world_size(group) > 1
    error: Exception | None = None
    state: dict = {}
    file = path
    try:
        if os.path.isfile(path):                  # a plain torch.save file (other code wrote it)
            state = _load_plain(path, where, map_location)
        else:
            if not os.path.exists(path):
                raise FileNotFoundError(f"{where}: no checkpoint at {path!r}")
            folder, manifest = open_newest(path, where, kind="replicated")
            file = os.path.join(folder, FILE)
            state = read_part(folder, manifest, FILE, where, map_location)
        model_state = (state["model"] if "model" in state and isinstance(state["model"], dict)
                       else state)
        model_state = strip_prefix(model_state)
        check_tensors(where, file, model_state, unwrap(model).state_dict(), strict=strict)
        if optimizer is not None and state.get("optimizer") is None:
            raise KeyError(f"{where}: {file!r} holds no optimizer state")
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        error = e
    if multi:
        agree(where, error, group)                # every rank loads, or none does
    elif error is not None:
        raise error
    unwrap(model).load_state_dict(model_state, strict=strict)
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    ranks = state.get("ranks")
    if (restore_rng or sampler is not None) and ranks:
        rank = dist.get_rank(group) if dist.is_initialized() else 0
        world = dist.get_world_size(group) if dist.is_initialized() else 1
        if len(ranks) == world:
            restore_rank_state(ranks[rank], sampler, rng=restore_rng)
        elif dist.is_initialized():  # (a single process loading for evaluation: nothing to say)
            warnings.warn(f"load_checkpoint (rank {rank}): {path!r} holds the random state of "
                          f"{len(ranks)} ranks, this job has {world}: random state and sampler "
                          "position not restored, so the run will not repeat the original one",
                          stacklevel=2)
    elif sampler is not None:
        raise KeyError(f"load_checkpoint: {path!r} holds no sampler state (save it with "
                       "save_checkpoint(..., sampler=sampler))")
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
