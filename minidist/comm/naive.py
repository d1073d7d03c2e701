"""Naive (linear) algorithms: one root talks to everyone. Simple, correct, and slow at scale.

All-reduce = reduce to rank 0, then broadcast (rank 0 moves (W-1)·N elements each way); reduce in
rank order; all-gather / reduce-scatter: every rank sends to every other. The baselines of
``minidist bench``."""

from __future__ import annotations

import torch

from . import p2p
from .ops import combine_, scratch_buffer


def reduce(flat: torch.Tensor, op: str, dst: int, rank: int, world: int, group=None) -> None:
    """Linear reduce to ``dst`` (in place on ``dst``), adding in rank order with two receive slots."""
    if rank != dst:
        p2p.send(flat, dst, group)
        return
    srcs = [src for src in range(world) if src != dst]
    if not srcs:
        return
    n = flat.numel()
    buf = scratch_buffer(2 * n, flat)
    slots = (buf[:n].view_as(flat), buf[n:].view_as(flat))
    pending = p2p.irecv(slots[0], srcs[0], group)
    for i in range(len(srcs)):
        # slot (i+1) % 2 held the tensor added in the step before: free to receive into again
        ahead = p2p.irecv(slots[(i + 1) % 2], srcs[i + 1], group) if i + 1 < len(srcs) else None
        p2p.wait_all([pending])
        combine_(flat, slots[i % 2], op)
        pending = ahead


def broadcast(flat: torch.Tensor, src: int, rank: int, world: int, group=None) -> None:
    """Linear broadcast: ``src`` sends the whole tensor to every other rank."""
    if rank == src:
        p2p.wait_all([p2p.isend(flat, dst, group) for dst in range(world) if dst != src])
    else:
        p2p.recv(flat, src, group)


def all_reduce(flat: torch.Tensor, op: str, rank: int, world: int, group=None) -> None:
    """Reduce to rank 0, then broadcast from rank 0 (in place, ``avg`` left to the caller)."""
    reduce(flat, op, 0, rank, world, group)
    broadcast(flat, 0, rank, world, group)


def all_gather_chunks(chunks: list[torch.Tensor], rank: int, world: int, group=None) -> None:
    """Every rank sends ``chunks[rank]`` to every other rank and receives theirs directly."""
    works = [p2p.irecv(chunks[src], src, group) for src in range(world) if src != rank]
    works += [p2p.isend(chunks[rank], dst, group) for dst in range(world) if dst != rank]
    p2p.wait_all(works)


def reduce_scatter_chunks(chunks: list[torch.Tensor], op: str, rank: int, world: int,
                          group=None) -> None:
    """Every rank sends chunk j to rank j; rank r combines the W pieces in rank order."""
    incoming = {src: torch.empty_like(chunks[rank]) for src in range(world) if src != rank}
    works = [p2p.irecv(buf, src, group) for src, buf in incoming.items()]
    works += [p2p.isend(chunks[dst], dst, group) for dst in range(world) if dst != rank]
    p2p.wait_all(works)
    mine = chunks[rank].clone()
    first = True
    for src in range(world):
        piece = mine if src == rank else incoming[src]
        if first:
            chunks[rank].copy_(piece)
            first = False
        else:
            combine_(chunks[rank], piece, op)


def all_to_all(outputs: list[torch.Tensor], inputs: list[torch.Tensor], rank: int, world: int,
               group=None) -> None:
    """Rank r sends ``inputs[j]`` to rank j and receives rank j's ``inputs[r]`` into ``outputs[j]``."""
    outputs[rank].copy_(inputs[rank])
    works = [p2p.irecv(outputs[src], src, group) for src in range(world) if src != rank]
    works += [p2p.isend(inputs[dst], dst, group) for dst in range(world) if dst != rank]
    p2p.wait_all(works)
