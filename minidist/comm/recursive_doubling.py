"""Recursive-doubling all-reduce: log2(W) rounds, each a pairwise exchange of all N elements.

Round k, rank r exchanges with r XOR 2^k: latency alpha·log2(W), bandwidth N·log2(W) per rank, so
it wins for small messages (Thakur, Rabenseifner & Gropp 2005, §4). Off a power of two, the first
2·rem ranks fold in first (even hands to odd). Every rank ends bit-identical."""

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
