"""The one tail of every clip by the global gradient norm when the gradient is spread over ranks.

Whatever holds the pieces — DP replicas (copies), ZeRO/FSDP shards (flat slices), TP shards and
pipeline stages — each rank first sums the squares of *its part, each element counted once*; then
:func:`clip_by_global_norm_` sums that over the ranks holding parts, takes the square root and
scales this rank's gradients by ``min(1, max_norm / (norm + 1e-6))``, as
``torch.nn.utils.clip_grad_norm_`` does (the same 1e-6). Callers: :func:`minidist.hybrid.clip.clip_grad_norm_`,
the ZeRO-1 optimizer of :mod:`minidist.hybrid.dp`. (:func:`minidist.sharding.fsdp_state.clip_grad_norm_`
takes any ``norm_type``, ``inf`` included, and checks ``error_if_nonfinite`` before scaling, so it
computes its norm itself; its scaling is this same ``min(1, max_norm / (norm + 1e-6))``.)
"""

from __future__ import annotations

import torch

__all__ = ["clip_by_global_norm_"]


@torch.no_grad()
def clip_by_global_norm_(sum_sq: torch.Tensor, grads, max_norm: float, reduce) -> torch.Tensor:
    """``sum_sq``: this rank's sum of squares (a one-element tensor; its dtype is the arithmetic's);
    ``reduce(sum_sq)`` sums it in place over every rank holding a part; ``grads``: this rank's
    gradient tensors, scaled in place. Returns the global norm before clipping (a 0-dim tensor).
    A collective: every rank holding a part must call it."""
    reduce(sum_sq)
    norm = sum_sq.sqrt().reshape(())
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return norm
