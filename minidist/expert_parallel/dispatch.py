"""Expert parallelism's token dispatch and combine, on minidist's hand-built all-to-all.

Count, exchange the counts, permute expert-major, uneven all-to-all, run the local experts, the
reverse all-to-all, un-permute (GShard §2.2; Megatron-LM ``MoEAlltoAllTokenDispatcher``).
Design notes: docs/design/expert_parallel.md
"""

from __future__ import annotations

import math

import torch

from ..collectives import all_to_all
from ..comm import p2p
from .permute import permutation, permute, regroup_index, split_sizes, unpermute

__all__ = [
    "AllToAll",
    "Dispatch",
    "all_to_all_rows",
    "dispatch_combine",
    "exchange_counts",
    "experts_per_rank",
    "local_experts",
]


def experts_per_rank(num_experts: int, world: int) -> int:
    return math.ceil(num_experts / world)


def local_experts(num_experts: int, world: int, rank: int) -> list[int]:
    """The experts EP rank ``rank`` owns (contiguous block; may be empty)."""
    c = experts_per_rank(num_experts, world)
    return list(range(min(rank * c, num_experts), min((rank + 1) * c, num_experts)))


def _a2a(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    if len(send) == 1:  # one rank: nothing moves (and no group is needed)
        return x.clone()
    x = x.contiguous()
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    all_to_all(list(out.split(recv)), list(x.split(send)), group=group)
    return out


class AllToAll(torch.autograd.Function):
    """Rows ``x [sum(send), ...]``: piece j goes to rank j; ``recv[j]`` rows come from each rank j.
    Backward: the same with splits swapped."""

    @staticmethod
    def forward(ctx, x, send, recv, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _a2a(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad):
        return _a2a(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def all_to_all_rows(x, send: list[int], recv: list[int], group=None) -> torch.Tensor:
    """Differentiable uneven all-to-all of rows; the result requires grad on every rank, so
    every rank runs the backward's all-to-all."""
    if torch.is_grad_enabled() and not x.requires_grad:
        x = x.detach().requires_grad_()
    return AllToAll.apply(x, list(send), list(recv), group)


def exchange_counts(counts: torch.Tensor, world: int, rank: int, group=None) -> torch.Tensor:
    """``counts [E]`` -> ``recv_counts [W, L]``: rows rank j sends to each local expert."""
    E = counts.numel()
    c = experts_per_rank(E, world)
    mine = local_experts(E, world, rank)
    counts = counts.to(torch.int64).contiguous()
    if world == 1:
        return counts.view(1, E).clone()
    send = [counts[min(j * c, E): min((j + 1) * c, E)] for j in range(world)]
    recv = [torch.empty(len(mine), dtype=torch.int64, device=counts.device) for _ in range(world)]
    all_to_all(recv, send, group=group)
    return torch.stack(recv) if recv else counts.new_zeros(world, len(mine))


class Dispatch:
    """What one dispatch moved: ``counts [E]``, ``recv_counts [W, L]``, ``send_splits``/``recv_splits``,
    ``a2a_bytes_sent`` (this rank's forward all-to-all bytes)."""

    def __init__(self, counts, recv_counts, send_splits, recv_splits, a2a_bytes_sent):
        self.counts, self.recv_counts = counts, recv_counts
        self.send_splits, self.recv_splits = send_splits, recv_splits
        self.a2a_bytes_sent = a2a_bytes_sent


def dispatch_combine(x, experts, weights, kept, num_experts: int, expert_modules, group=None,
                     rank: int = 0, world: int = 1):
    """``x [T, h]``, ``experts, weights, kept [T, k]`` -> ``(out [T, h], Dispatch)`` with
    ``out[t] = Σ_j kept·weight_j · expert_{e_j}(x[t])``. A collective: every rank of ``group`` calls it."""
    E = num_experts
    if len(expert_modules) != len(local_experts(E, world, rank)):
        raise ValueError(f"dispatch_combine (rank {rank}): {len(expert_modules)} expert modules, "
                         f"but EP rank {rank} of {world} owns experts "
                         f"{local_experts(E, world, rank)} of {E}")
    before = p2p.traffic("all_to_all/naive").bytes_sent
    token_index, row_weights, counts = permutation(experts, weights, kept, E)        # 1 (and 3)
    recv_counts = exchange_counts(counts, world, rank, group)                          # 2
    c = experts_per_rank(E, world)
    send_splits = split_sizes(counts, c, world)
    recv_splits = recv_counts.sum(1).tolist() if recv_counts.numel() else [0] * world
    rows = permute(x, token_index)                                                     # 3
    received = all_to_all_rows(rows, send_splits, recv_splits, group)                  # 4
    if len(expert_modules):                                                            # 5
        idx = regroup_index(recv_counts.cpu()).to(x.device)   # Python-sized loop on the host
        grouped = received.index_select(0, idx)
        per_expert = recv_counts.sum(0).tolist()
        outs = [m(piece) for m, piece in zip(expert_modules, grouped.split(per_expert))]
        inverse = torch.empty_like(idx)
        inverse[idx] = torch.arange(idx.numel(), device=idx.device)
        processed = torch.cat(outs).index_select(0, inverse)
    else:
        processed = received
    returned = all_to_all_rows(processed, recv_splits, send_splits, group)             # 6
    out = unpermute(returned, token_index, row_weights, x.shape[0])
    sent = p2p.traffic("all_to_all/naive").bytes_sent - before
    return out, Dispatch(counts, recv_counts, send_splits, recv_splits, sent)

