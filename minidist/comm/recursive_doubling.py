"""Recursive-doubling all-reduce: log2(W) rounds, each a pairwise exchange of all N elements.

Round k, rank r exchanges its partial result with rank r XOR 2^k and combines. The latency term is
alpha·log2(W) against the ring's alpha·2(W-1): better for small messages. The bandwidth term is
worse (N·log2(W) elements sent per rank against the ring's 2(W-1)/W·N), so the ring wins for large
ones (Thakur, Rabenseifner & Gropp 2005, "Optimization of Collective Communication Operations in
MPICH", §4). This is not NCCL's "Tree" (a pipelined double binary tree).

With W not a power of two the extra ranks fold in first: of the first 2·rem ranks
(rem = W - 2^floor(log2 W)), each even rank hands its data to the odd rank above it and waits for
the final result. Partners combine in the same order on both sides, so every rank ends with
bit-identical values.
"""

from __future__ import annotations

import torch

from . import p2p
from .ops import combine_, scratch_buffer


def all_reduce(flat: torch.Tensor, op: str, rank: int, world: int, group=None) -> None:
    """Recursive-doubling all-reduce of ``flat`` over ``world`` ranks, in place (``avg`` left to the caller)."""
    if world == 1:
        return
    pof2 = 1 << (world.bit_length() - 1)
    rem = world - pof2
    tmp = scratch_buffer(flat.numel(), flat).view_as(flat)
    # fold: ranks below 2*rem pair up; the even one sits out
    if rank < 2 * rem:
        if rank % 2 == 0:
            p2p.send(flat, rank + 1, group)
            p2p.recv(flat, rank + 1, group)
            return
        p2p.recv(tmp, rank - 1, group)
        _ordered_combine(flat, tmp, op, mine_first=False)
        new_rank = rank // 2
    else:
        new_rank = rank - rem
    mask = 1
    while mask < pof2:
        partner_new = new_rank ^ mask
        partner = partner_new * 2 + 1 if partner_new < rem else partner_new + rem
        p2p.exchange(flat, partner, tmp, partner, group)
        _ordered_combine(flat, tmp, op, mine_first=new_rank < partner_new)
        mask <<= 1
    if rank < 2 * rem:  # odd rank: hand the result back to the even rank that sat out
        p2p.send(flat, rank - 1, group)


def _ordered_combine(mine: torch.Tensor, theirs: torch.Tensor, op: str, mine_first: bool) -> None:
    """``mine = lower (op) higher`` so both partners compute bit-identical values."""
    if mine_first:
        combine_(mine, theirs, op)
    else:
        combine_(theirs, mine, op)
        mine.copy_(theirs)
