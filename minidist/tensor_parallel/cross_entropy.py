"""Cross-entropy over vocabulary-sharded logits (Megatron-LM ``vocab_parallel_cross_entropy``).

Two all-reduces forward (max, then the sums), none backward; every rank ends with the same loss.
Design notes: docs/design/tensor_parallel.md
"""

from __future__ import annotations

import torch

from ..comm.p2p import group_rank_world
from .. import collectives as C

__all__ = ["vocab_parallel_cross_entropy"]


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_size, label_smoothing, ignore_index, group):
        rank, world = group_rank_world(group)
        valid = target != ignore_index                              # ignored tokens: loss 0, grad 0
        local = logits.shape[-1]
        start = rank * local
        cols = torch.arange(start, start + local, device=logits.device)
        real = cols < vocab_size                                   # padding columns are False
        z = logits.float().masked_fill(~real, float("-inf"))
        m = z.max(dim=-1).values
        if world > 1:
            C.all_reduce(m, "max", group=group)
        shifted = (z - m.unsqueeze(-1)).masked_fill(~real, 0.0)
        exp = shifted.exp().masked_fill(~real, 0.0)
        mine = (target >= start) & (target < start + local) & valid
        idx = (target - start).masked_fill(~mine, 0).unsqueeze(-1)
        picked = shifted.gather(-1, idx).squeeze(-1).masked_fill(~mine, 0.0)
        sums = torch.stack([exp.sum(-1), picked, shifted.sum(-1)])
        if world > 1:
            C.all_reduce(sums, "sum", group=group)
        sum_exp, target_logit, sum_shifted = sums
        log_z = sum_exp.log()
        loss = log_z - target_logit
        eps = label_smoothing
        if eps > 0:
            loss = (1 - eps) * loss + eps * (log_z - sum_shifted / vocab_size)
        loss = loss.masked_fill(~valid, 0.0)
        softmax = exp / sum_exp.unsqueeze(-1)
        ctx.save_for_backward(softmax, idx, mine, real, valid)
        ctx.eps, ctx.vocab_size, ctx.dtype = eps, vocab_size, logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, idx, mine, real, valid = ctx.saved_tensors
        grad = softmax.clone()
        onehot = torch.zeros_like(grad).scatter_(-1, idx, 1.0) * mine.unsqueeze(-1)
        grad -= (1 - ctx.eps) * onehot
        if ctx.eps > 0:
            grad -= ctx.eps / ctx.vocab_size
        grad = grad.masked_fill(~real, 0.0).masked_fill(~valid.unsqueeze(-1), 0.0)
        grad = grad * grad_loss.unsqueeze(-1)
        return grad.to(ctx.dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, vocab_size: int,
                                 label_smoothing: float = 0.0, reduction: str = "mean",
                                 group=None, ignore_index: int = -100) -> torch.Tensor:
    """Cross-entropy of vocabulary-sharded logits; equals ``F.cross_entropy`` on the full logits.

    ``logits`` ``[..., Vp/W]`` (this rank's columns of the padded vocabulary), ``target`` ``[...]``
    int64 in ``[0, vocab_size)`` or ``ignore_index``; ``reduction`` "mean" (over non-ignored
    tokens), "sum" or "none". Raises ``ValueError`` (naming the rank) for a target out of range, a
    shape mismatch, or a vocabulary that does not fit W x the local columns."""
    rank, world = group_rank_world(group)
    where = f"vocab_parallel_cross_entropy (rank {rank})"
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"{where}: logits {tuple(logits.shape)} and target {tuple(target.shape)} "
                         "must agree on every dimension but the last")
    if not 1 <= vocab_size <= world * logits.shape[-1]:
        raise ValueError(f"{where}: {world} shards of {logits.shape[-1]} columns cannot hold a "
                         f"vocabulary of {vocab_size}")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"{where}: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    valid = target != ignore_index
    bad = valid & ((target < 0) | (target >= vocab_size))
    if bool(bad.any()):
        out = target[bad]
        raise ValueError(f"{where}: targets must be in [0, {vocab_size}) or ignore_index="
                         f"{ignore_index}, got {int(bad.sum())} outside (min {int(out.min())}, "
                         f"max {int(out.max())})")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"{where}: label_smoothing must be in [0, 1), got {label_smoothing}")
    loss = _VocabParallelCE.apply(logits, target, vocab_size, float(label_smoothing),
                                  int(ignore_index), group)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    count = int(valid.sum())
    # no token: NaN loss, zero gradient (what F.cross_entropy returns), not 0/0 in backward
    return loss.sum() / count if count else loss.sum() + float("nan")
