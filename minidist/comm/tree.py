"""Tree algorithms: binomial-tree broadcast and reduce, recursive-doubling all-reduce.

They need only ceil(log2 W) rounds, so their latency term is alpha·log2(W) against the ring's
alpha·2(W-1): better for small messages. Their bandwidth term is worse (recursive doubling sends
N·log2(W) elements per rank against the ring's 2(W-1)/W·N), so the ring wins for large ones.
(Thakur, Rabenseifner & Gropp 2005, "Optimization of Collective Communication Operations in
MPICH", §4.)

Recursive doubling with W not a power of two folds the extra ranks in first: of the first 2·rem
ranks (rem = W - 2^floor(log2 W)), each even rank hands its data to the odd rank above it and waits
for the final result. Partners combine in the same order on both sides, so every rank ends with
bit-identical values.
"""

from __future__ import annotations

import torch

from . import p2p
from .ops import combine_


def broadcast(flat: torch.Tensor, src: int, rank: int, world: int, group=None) -> None:
    """Binomial-tree broadcast from ``src`` in ceil(log2 W) rounds."""
    vr = (rank - src) % world  # rank relative to the root
    mask = 1
    while mask < world:
        if vr & mask:
            p2p.recv(flat, (vr - mask + src) % world, group)
            break
        mask <<= 1
    mask >>= 1
    sends = []
    while mask > 0:
        if vr + mask < world:
            sends.append(p2p.isend(flat, (vr + mask + src) % world, group))
        mask >>= 1
    p2p.wait_all(sends)


def reduce(flat: torch.Tensor, op: str, dst: int, rank: int, world: int, group=None) -> None:
    """Binomial-tree reduce to ``dst``. Non-root tensors hold partial results afterwards."""
    vr = (rank - dst) % world
    tmp = None
    mask = 1
    while mask < world:
        if vr & mask:
            p2p.send(flat, (vr - mask + dst) % world, group)
            break
        if vr + mask < world:
            tmp = torch.empty_like(flat) if tmp is None else tmp
            p2p.recv(tmp, (vr + mask + dst) % world, group)
            combine_(flat, tmp, op)
        mask <<= 1


def all_reduce(flat: torch.Tensor, op: str, rank: int, world: int, group=None) -> None:
    """Recursive-doubling all-reduce, in place (``avg`` left to the caller)."""
    if world == 1:
        return
    pof2 = 1 << (world.bit_length() - 1)
    rem = world - pof2
    tmp = torch.empty_like(flat)
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
