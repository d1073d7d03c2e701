"""Expert parallelism's token dispatch and combine, on minidist's hand-built all-to-all.

Experts are sharded over an EP group of W ranks in contiguous blocks: with ``c = ceil(E / W)``
rank j owns experts ``[j·c, min((j+1)·c, E))`` — possibly none (E < W, or the last ranks when W
does not divide E). On every rank, after routing and dropping (:mod:`.router`):

1. **count** the kept rows per expert: ``counts [E]``;
2. **exchange the counts**: an all-to-all of E integers (rank j is sent ``counts`` of j's experts),
   so every rank knows how many rows it receives from whom, per local expert: ``recv_counts [W, L]``;
3. **permute** the rows expert-major (:func:`.permute.permutation`), so the rows for rank j are a
   contiguous slice;
4. **all-to-all with uneven splits**: send splits ``counts`` summed per owner, receive splits
   ``recv_counts`` summed per source;
5. **local experts**: regroup ``[source][expert]`` → ``[expert][source]``, run each local expert
   on its slice, regroup back;
6. the **reverse all-to-all** (splits swapped), then **un-permute**, weighting each row by its
   router probability and summing a token's k rows.

:class:`AllToAll` is differentiable: the backward of an all-to-all is the all-to-all with the send
and receive splits swapped (Megatron-LM ``_AllToAll``; torch ``_functional_collectives``), so
the backward of step 4 sends gradients to where the tokens came from. Every rank runs every
collective, whatever it holds: a rank with no experts or no rows sends and receives empty pieces.

Sources: Lepikhin et al. 2020 (GShard) §2.2; Megatron-LM ``MoEAlltoAllTokenDispatcher``;
torchtitan ``expert_parallel`` / ``generate_permute_indices``.
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
    """Rows ``x [sum(send), ...]``: piece j (``send[j]`` rows) goes to rank j; the result holds
    ``recv[j]`` rows from each rank j, in rank order. Backward: the same with splits swapped."""

    @staticmethod
    def forward(ctx, x, send, recv, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _a2a(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad):
        return _a2a(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def all_to_all_rows(x, send: list[int], recv: list[int], group=None) -> torch.Tensor:
    """Differentiable uneven all-to-all of rows (see :class:`AllToAll`).

    With gradients enabled, the result requires grad on **every** rank, even where ``x`` does not
    (a rank that owns no experts passes its received rows straight back; a rank whose input is
    not a function of parameters): whether this rank's backward runs the reverse all-to-all must
    not depend on what it holds, or the ranks that do would wait for it forever.
    """
    if torch.is_grad_enabled() and not x.requires_grad:
        x = x.detach().requires_grad_()
    return AllToAll.apply(x, list(send), list(recv), group)


def exchange_counts(counts: torch.Tensor, world: int, rank: int, group=None) -> torch.Tensor:
    """Step 2. ``counts [E]`` (rows this rank sends per expert) → ``recv_counts [W, L]``: rows
    rank j sends to each of this rank's L local experts. One all-to-all of E int64 in total."""
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
    """What one dispatch moved, for statistics: ``counts [E]`` rows sent per expert,
    ``recv_counts [W, L]``, ``send_splits``/``recv_splits`` (rows per peer), ``a2a_bytes_sent``
    (this rank's all-to-all bytes in the forward: count exchange, dispatch and combine, from the
    comm layer's traffic counters)."""

    def __init__(self, counts, recv_counts, send_splits, recv_splits, a2a_bytes_sent):
        self.counts, self.recv_counts = counts, recv_counts
        self.send_splits, self.recv_splits = send_splits, recv_splits
        self.a2a_bytes_sent = a2a_bytes_sent


def dispatch_combine(x, experts, weights, kept, num_experts: int, expert_modules, group=None,
                     rank: int = 0, world: int = 1):
    """The six steps on this rank. ``x [T, h]``; ``experts, weights, kept [T, k]``;
    ``num_experts``: E over the whole group; ``expert_modules``: this rank's local experts in order (``len == len(local_experts(...))``).

    Returns ``(out [T, h], Dispatch)``: ``out[t] = Σ_j kept·weight_j · expert_{e_j}(x[t])``.
    Every rank of ``group`` must call it, in the same order (it runs two all-to-alls forward, two
    backward, and the count exchange).
    """
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

