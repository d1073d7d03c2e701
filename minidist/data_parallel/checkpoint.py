"""Checkpoints that survive a crash and load anywhere (failure case D7).

* **What is saved:** the *unwrapped* module's state dict (no ``module.`` prefix), so a checkpoint
  written during DDP training loads into the bare model and vice versa, with ``strict=True``;
  plus the optimizer state and a small ``extra`` dict (epoch, step, sampler seed, RNG state...).
* **Who writes:** global rank 0 only (replicas are identical; W writers would race on one file).
* **Atomically:** into a temporary file in the same folder, flushed and fsync'ed, then
  ``os.replace`` — a crash mid-write leaves the previous checkpoint intact, never half a file.
* **Then a barrier**, so no rank reads the file (or exits, or deletes it) before it is complete.
* **Loading:** every rank reads the same file; a ``module.``-prefixed state dict (saved from a
  wrapper by other code) is accepted too.
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist

from .replicas import unwrap

__all__ = ["save_checkpoint", "load_checkpoint", "strip_prefix"]


def strip_prefix(state: dict, prefix: str = "module.") -> dict:
    """``{"module.w": t}`` → ``{"w": t}`` when every key carries the prefix (else unchanged)."""
    if state and all(k.startswith(prefix) for k in state):
        return {k[len(prefix):]: v for k, v in state.items()}
    return state


def save_checkpoint(path: str | os.PathLike, model, optimizer=None, extra: dict | None = None,
                    group=None) -> None:
    """Rank 0 writes ``{"model", "optimizer", "extra"}`` to ``path`` atomically; all ranks wait."""
    path = os.fspath(path)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        state = {"model": unwrap(model).state_dict(),
                 "optimizer": optimizer.state_dict() if optimizer is not None else None,
                 "extra": extra or {}}
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=folder)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise
    if dist.is_initialized():
        dist.barrier(group=group)


def load_checkpoint(path: str | os.PathLike, model, optimizer=None, map_location="cpu",
                    strict: bool = True) -> dict:
    """Load ``path`` into ``model`` (bare or wrapped) and ``optimizer`` on this rank; returns
    ``extra``. Raises FileNotFoundError naming the path and rank when it does not exist."""
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
    return state.get("extra", {})
