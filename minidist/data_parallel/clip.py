"""The one tail of every global-norm clip over ranks: each rank's sum of squares summed, then
scaled by ``min(1, max_norm / (norm + 1e-6))`` as ``torch.nn.utils.clip_grad_norm_``.
Design notes: docs/design/data_parallel.md
"""

from __future__ import annotations

import torch

__all__ = ["clip_by_global_norm_"]


@torch.no_grad()
def clip_by_global_norm_(sum_sq: torch.Tensor, grads, max_norm: float, reduce) -> torch.Tensor:
    """``sum_sq``: this rank's one-element sum of squares, summed in place by ``reduce``; ``grads``
    scaled in place. Returns the global norm before clipping (0-dim). Collective."""
    reduce(sum_sq)
    norm = sum_sq.sqrt().reshape(())
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return norm
