"""Memory per rank: :func:`zero_formula` (ZeRO §5, Figure 1), :func:`account` (live storages of
parameters, gradients, optimizer state) and :class:`ActivationMeter` (bytes saved for backward).
Design notes: docs/design/sharding.md
"""

from __future__ import annotations

import torch
from torch import nn

from . import recompute
from .fsdp import units

__all__ = ["zero_formula", "account", "ActivationMeter", "K_FP32"]

K_FP32 = {"adamw": 8, "adam": 8, "sgd": 4}  # bytes of optimizer state per parameter, fp32 on CPU


def zero_formula(psi: int, n_d: int, stage: int, k: int, param_bytes: int = 2,
                 grad_bytes: int = 2) -> dict[str, float]:
    """ZeRO §5 per-rank bytes of model states: {"params", "grads", "optimizer", "total"}.
    ``ValueError`` for a stage outside 0..3 or ``n_d < 1``."""
    if stage not in (0, 1, 2, 3) or n_d < 1:
        raise ValueError(f"zero_formula: stage must be 0..3 and n_d >= 1, got {stage}, {n_d}")
    p = param_bytes * psi / (n_d if stage >= 3 else 1)
    g = grad_bytes * psi / (n_d if stage >= 2 else 1)
    o = k * psi / (n_d if stage >= 1 else 1)
    return {"params": p, "grads": g, "optimizer": o, "total": p + g + o}


def _storage(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def _sum(tensors) -> int:
    seen: dict = {}
    for t in tensors:
        if t is not None:
            ptr, n = _storage(t)
            seen[ptr] = max(n, seen.get(ptr, 0))
    return sum(seen.values())


def account(model: nn.Module, optimizer) -> dict[str, int]:
    """Bytes this rank holds: params, grads, optimizer, optimizer_scalars (and cuda_peak on CUDA).
    ``optimizer``: a ``torch.optim`` optimizer or a :class:`~.zero.ShardedOptimizer`."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    params, grads = list(trainable), [p.grad for p in trainable]
    inner = getattr(optimizer, "optim", optimizer)
    for b in getattr(optimizer, "buckets", []):        # ZeRO-1/2: flat buffers and grad slices
        params.append(b.flat)
        grads.append(b.shard.grad)
    for u in units(model):                               # ZeRO-3: gathered buffers, no_sync sums
        if u.full is not None:
            params.append(u.full)
        grads.append(u.unsharded_grad)
    states = [v for s in inner.state.values() for v in s.values() if torch.is_tensor(v)]
    out = {"params": _sum(params), "grads": _sum(grads),
           "optimizer": _sum(v for v in states if v.dim() > 0),
           "optimizer_scalars": _sum(v for v in states if v.dim() == 0)}
    device = trainable[0].device if trainable else torch.device("cpu")
    if device.type == "cuda":
        out["cuda_peak"] = torch.cuda.max_memory_allocated(device)
    return out


class ActivationMeter:
    """``with ActivationMeter(model) as m: ...`` → ``m.bytes`` saved for backward (parameters excluded)."""

    def __init__(self, model: nn.Module):
        self.exclude = {_storage(p)[0] for p in model.parameters()}
        self.units = [u for u in units(model) if u.full is not None]
        self.seen: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t):
        self.add(t)
        return t

    def add(self, t: torch.Tensor) -> None:
        ptr, n = _storage(t)
        gathered = {_storage(u.full)[0] for u in self.units}   # ZeRO-3 weights live there now
        if ptr not in self.exclude and ptr not in gathered and n:
            self.seen[ptr] = max(n, self.seen.get(ptr, 0))

    @property
    def bytes(self) -> int:
        return sum(self.seen.values())

    def __enter__(self):
        recompute.METERS.append(self)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        recompute.METERS.remove(self)
