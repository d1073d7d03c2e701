"""Checkpoints that survive a crash and load anywhere (a half-written file, a ``module.`` prefix
or a device-bound tensor must not stop a resume).

* **What is saved:** the *unwrapped* module's state dict (no ``module.`` prefix), so a checkpoint
  written during DDP training loads into the bare model and vice versa, with ``strict=True``;
  plus the optimizer state and a small ``extra`` dict (epoch, step...). Not the RNG state:
  ``extra`` comes from rank 0 alone, and every rank's own generators are saved anyway (below).
* **Who writes:** global rank 0 only (replicas are identical; W writers would race on one file).
* **Atomically:** into a temporary file in the same folder, flushed and fsync'ed, then
  ``os.replace`` — a crash mid-write leaves the previous checkpoint intact, never half a file.
* **Then a barrier**, so no rank reads the file (or exits, or deletes it) before it is complete.
* **Loading:** every rank reads the same file; a ``module.``-prefixed state dict (saved from a
  wrapper by other code) is accepted too.
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

from .replicas import unwrap

__all__ = ["save_checkpoint", "load_checkpoint", "strip_prefix", "rank_state",
           "restore_rank_state", "atomic_save"]


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


def atomic_save(obj, path: str | os.PathLike) -> None:
    """``torch.save(obj)`` into a temporary file next to ``path``, fsync'ed, then ``os.replace``:
    ``path`` holds the old file or the whole new one, never half of one (creates the folder)."""
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
                    group=None, sampler=None) -> None:
    """Rank 0 of ``group`` writes ``{"model", "optimizer", "extra", "ranks"}`` to ``path``
    atomically; all ranks of ``group`` wait. ``"ranks"`` holds every rank's own random state and,
    when ``sampler`` is given (anything with ``state_dict()``), its state (see the module notes)."""
    path = os.fspath(path)
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    mine = rank_state(sampler)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        ranks: list | None = [None] * dist.get_world_size(group) if rank == 0 else None
        dist.gather_object(mine, ranks, dst=dist.get_global_rank(group, 0) if group else 0,
                           group=group)
    else:
        ranks = [mine]
    if rank == 0:
        state = {"model": unwrap(model).state_dict(),
                 "optimizer": optimizer.state_dict() if optimizer is not None else None,
                 "extra": extra or {}, "ranks": ranks}
        atomic_save(state, path)
    if dist.is_initialized():
        dist.barrier(group=group)


def load_checkpoint(path: str | os.PathLike, model, optimizer=None, map_location="cpu",
                    strict: bool = True, group=None, sampler=None, restore_rng: bool = True) -> dict:
    """Load ``path`` into ``model`` (bare or wrapped) and ``optimizer`` on this rank; returns
    ``extra``. Restores this rank's own random state (``restore_rng``) and ``sampler``'s state.
    Raises FileNotFoundError naming the path and rank when it does not exist."""
    path = os.fspath(path)
    if not os.path.exists(path):
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise FileNotFoundError(f"load_checkpoint (rank {rank}): no checkpoint at {path!r}")
    state = torch.load(path, map_location=map_location, weights_only=True)
    model_state = state["model"] if "model" in state and isinstance(state["model"], dict) else state
    unwrap(model).load_state_dict(strip_prefix(model_state), strict=strict)
    if optimizer is not None:
        if state.get("optimizer") is None:
            raise KeyError(f"load_checkpoint: {path!r} holds no optimizer state")
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
