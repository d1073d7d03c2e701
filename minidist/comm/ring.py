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


_scratch = threading.local()


def _scratch_buffer(numel: int, like: torch.Tensor) -> torch.Tensor:
    """A reusable receive buffer (fresh 48 MiB allocations cost page faults on every call)."""
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
    sizes). The other chunks hold partial results afterwards.

    All W-1 receives are posted before the first send, each into its own slot of a scratch
    buffer, so data can land while this rank is still reducing the previous step: only "reduce,
    then send the result on" is left on the critical path of each step.
    """
    if world == 1:
        return
    right, left = (rank + 1) % world, (rank - 1) % world
    recv_idx = [(rank - step - 2) % world for step in range(world - 1)]
    tmp = _scratch_buffer(sum(chunks[i].numel() for i in recv_idx), chunks[0])
    slots = list(tmp.split([chunks[i].numel() for i in recv_idx]))
    recvs = [p2p.irecv(slot, left, group) for slot in slots]
    sends = []
    for step in range(world - 1):
        # the chunk reduced in the previous step (at step 0: this rank's own) goes right
        sends.append(p2p.isend(chunks[(rank - step - 1) % world], right, group))
        p2p.wait_all([recvs[step]])
        combine_(chunks[recv_idx[step]], slots[step], op)
    p2p.wait_all(sends)


def all_gather_chunks(chunks: list[torch.Tensor], rank: int, world: int, group=None) -> None:
    """In place: ``chunks[rank]`` is this rank's data; afterwards every chunk is filled on every rank.

    Receives go straight into their chunks, all posted up front; each step forwards the chunk
    that arrived in the step before.
    """
    right, left = (rank + 1) % world, (rank - 1) % world
    recvs = [p2p.irecv(chunks[(rank - step - 1) % world], left, group) for step in range(world - 1)]
    sends = []
    for step in range(world - 1):
        if step > 0:
            p2p.wait_all([recvs[step - 1]])
        sends.append(p2p.isend(chunks[(rank - step) % world], right, group))
    p2p.wait_all(recvs[-1:] + sends)


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
