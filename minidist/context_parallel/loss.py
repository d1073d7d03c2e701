"""The loss of a sequence split over a context-parallel group, equal to one process.

The token mean over every rank's counted tokens (Megatron-Core's ``calculate_per_token_loss``).
Design notes: docs/design/context_parallel.md
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import collectives as C
from ..comm.p2p import group_rank_world

__all__ = ["sharded_cross_entropy", "allreduce_grads"]


def sharded_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group=None,
                          ignore_index: int = -100) -> torch.Tensor:
    """Token-mean cross-entropy of the whole sharded sequence (a collective over ``group``).
    ``logits`` ``[..., V]``, ``targets`` ``[...]``: value the global mean (nan without tokens),
    gradient this rank's share."""
    local = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                            ignore_index=ignore_index, reduction="sum")
    count = (targets != ignore_index).sum()
    stats = torch.stack([local.detach().to(torch.float64), count.to(torch.float64)])
    _, world = group_rank_world(group)
    if world > 1:
        C.all_reduce(stats, "sum", group=group)
    total, n = stats[0], stats[1]
    if n == 0:
        return local * float("nan")
    return local / n + ((total - local.detach()) / n).to(local.dtype)


def allreduce_grads(params, group=None) -> None:
    """Sum the gradients of parameters replicated over ``group`` (every rank saw other tokens)."""
    _, world = group_rank_world(group)
    if world == 1:
        return
    for p in params:
        if p.grad is not None:
            C.all_reduce(p.grad, "sum", group=group)
