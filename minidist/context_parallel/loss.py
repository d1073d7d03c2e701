"""The loss of a sequence split over a context-parallel group, equal to one process.

One process computes the token mean ``Σ_i ℓ_i / N`` over every counted token (targets ``!=
ignore_index``). Split over ``W`` ranks, rank ``r`` holds ``N_r`` counted tokens — different
counts per rank when ignored tokens are unevenly spread or the split is uneven — so the mean of
the ranks' means is wrong. :func:`sharded_cross_entropy` sums ``[Σ ℓ, N_r]`` over the group and
returns ``Σ_local ℓ / N`` (whose gradient is this rank's share) plus, detached, the other ranks'
part: its *value* is the global mean on every rank, and the gradients of parameters replicated
over the group, summed over it (:func:`allreduce_grads`), equal one process's. Megatron-Core's
``calculate_per_token_loss`` does the same over DP and CP.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import collectives as C
from ..comm.p2p import group_rank_world

__all__ = ["sharded_cross_entropy", "allreduce_grads"]


def sharded_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group=None,
                          ignore_index: int = -100) -> torch.Tensor:
    """Token-mean cross-entropy over the whole sharded sequence.

    ``logits`` ``[..., V]``, ``targets`` ``[...]`` (this rank's positions). Returns a scalar whose
    value is the global mean (``nan`` when no token is counted anywhere, as ``F.cross_entropy``)
    and whose gradient is this rank's share of it. A collective over ``group``."""
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
