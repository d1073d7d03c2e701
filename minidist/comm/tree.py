"""Binomial-tree broadcast and reduce: ceil(log2 W) rounds, each sending the whole message.

Latency alpha·log2(W) against a chain's alpha·(W-1): for small messages (Thakur, Rabenseifner &
Gropp 2005, §4). The log2(W) all-reduce is :mod:`.recursive_doubling`."""

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
