"""Ring algorithms: reduce-scatter, all-gather, all-reduce (= reduce-scatter + all-gather), broadcast.

W ranks sit on a ring; each step every rank sends one chunk to its right neighbour and receives
one from its left, both posted before either is waited on (a ring of blocking sends deadlocks once
messages are too large for the transport to buffer).

Cost, with N elements of b bytes (Patarasuk & Yuan 2009, "Bandwidth optimal all-reduce algorithms
for clusters of workstations"; Thakur et al. 2005):

* reduce-scatter and all-gather: W-1 steps, each rank sends (W-1)/W · N elements;
* all-reduce: 2(W-1) steps, each rank sends 2(W-1)/W · N elements — independent of W for large W,
  which is why the ring is bandwidth-optimal (the latency term grows with W: see tree.py).

Chunks come from ``torch.tensor_split``, which always returns exactly W pieces (10 elements on 4
ranks: [3, 3, 2, 2]; 3 elements on 4 ranks: [1, 1, 1, 0]); ``torch.chunk`` may return fewer.
Empty chunks are skipped on both sides.
"""

from __future__ import annotations

import threading

import torch

from . import p2p
from .ops import combine_


SEGMENT_ELEMS = 1 << 18  # 1 MiB of fp32: reduce one segment while the next is still arriving
_scratch = threading.local()


def _scratch_buffer(numel: int, like: torch.Tensor) -> torch.Tensor:
    """A reusable receive buffer (fresh 32 MiB allocations cost page faults on every call)."""
    key = (like.dtype, like.device)
    buf = getattr(_scratch, "bufs", {}).get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=like.dtype, device=like.device)
        _scratch.bufs = {**getattr(_scratch, "bufs", {}), key: buf}
    return buf[:numel]


def reduce_scatter_chunks(chunks: list[torch.Tensor], op: str, rank: int, world: int,
                          group=None) -> None:
    """In place: afterwards ``chunks[rank]`` holds the reduction of every rank's ``chunks[rank]``.

    ``chunks`` are W contiguous 1-D tensors (sizes may differ; every rank must pass the same
    sizes). The other chunks hold partial results afterwards. Each step's chunk travels in
    segments of ``SEGMENT_ELEMS``, all posted at once, and each segment is reduced as soon as it
    has arrived, so reduction overlaps the rest of the transfer (as gloo's chunked ring does).
    """
    if world == 1:
        return
    right, left = (rank + 1) % world, (rank - 1) % world
    tmp = _scratch_buffer(max(c.numel() for c in chunks), chunks[0])
    for step in range(world - 1):
        send_idx = (rank - step - 1) % world
        recv_idx = (rank - step - 2) % world
        target = chunks[recv_idx]
        incoming = tmp[: target.numel()]
        pending = [(dst, buf, p2p.irecv(buf, left, group))
                   for dst, buf in zip(target.split(SEGMENT_ELEMS), incoming.split(SEGMENT_ELEMS))]
        sends = [p2p.isend(seg, right, group) for seg in chunks[send_idx].split(SEGMENT_ELEMS)]
        for dst, buf, work in pending:
            p2p.wait_all([work])
            combine_(dst, buf, op)
        p2p.wait_all(sends)


def all_gather_chunks(chunks: list[torch.Tensor], rank: int, world: int, group=None) -> None:
    """In place: ``chunks[rank]`` is this rank's data; afterwards every chunk is filled on every rank."""
    right, left = (rank + 1) % world, (rank - 1) % world
    for step in range(world - 1):
        send_idx = (rank - step) % world
        recv_idx = (rank - step - 1) % world
        p2p.exchange(chunks[send_idx], right, chunks[recv_idx], left, group)


def all_reduce(flat: torch.Tensor, op: str, rank: int, world: int, group=None) -> None:
    """Ring all-reduce of a contiguous 1-D tensor, in place (``avg`` left to the caller).

    After the reduce-scatter phase, rank r holds the finished chunk r; the all-gather phase then
    circulates the finished chunks. Every rank ends with bit-identical values.
    """
    chunks = list(flat.tensor_split(world))
    reduce_scatter_chunks(chunks, op, rank, world, group)
    all_gather_chunks(chunks, rank, world, group)


def broadcast(flat: torch.Tensor, src: int, rank: int, world: int, group=None,
              segment_elems: int = 1 << 18) -> None:
    """Pipelined chain broadcast from ``src``: segments flow src -> src+1 -> ... around the ring.

    Each rank forwards segment i while it receives segment i+1, so for large messages the time
    approaches N/bandwidth instead of (W-1)·N/bandwidth.
    """
    if world == 1 or flat.numel() == 0:
        return
    pos = (rank - src) % world  # position along the chain
    left, right = (rank - 1) % world, (rank + 1) % world
    sends = []
    for seg in flat.split(segment_elems):
        if pos > 0:
            p2p.recv(seg, left, group)
        if pos < world - 1:
            sends.append(p2p.isend(seg, right, group))
    p2p.wait_all(sends)
