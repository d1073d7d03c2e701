"""Ring algorithms: reduce-scatter, all-gather, all-reduce (= reduce-scatter + all-gather), broadcast.

W ranks sit on a ring; each step every rank sends one chunk to its right neighbour and receives
one from its left. The send and the receive must both be posted before either is waited on: a ring
of blocking sends deadlocks at every message size on gloo, whose send waits for the matching
receive (chapter 01).

Two versions of the same ring, with the same chunks, the same messages and the same order of
additions (so bit-identical results):

* **the base ring** (``reduce_scatter_simple``, ``all_gather_simple``, ``all_reduce_simple``):
  one ``p2p.exchange`` per step, then the addition — the ring exercise 03 asks you to write;
* **the pre-posted ring** (``reduce_scatter_preposted``, ``all_gather_preposted``,
  ``all_reduce_preposted``), a refinement: every receive of a phase is posted before the first
  send, so data can land while this rank is still adding the previous step's chunk. It is the
  library's default (``reduce_scatter_chunks``, ``all_gather_chunks`` and ``all_reduce`` name it);
  chapter 03 measures what it gains on your machine.

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

import torch

from . import p2p
from .ops import combine_, scratch_buffer as _scratch_buffer


# --- the base ring: one exchange per step ------------------------------------------------------

def reduce_scatter_simple(chunks: list[torch.Tensor], op: str, rank: int, world: int,
                          group=None) -> None:
    """In place: afterwards ``chunks[rank]`` holds the reduction of every rank's ``chunks[rank]``.

    ``chunks`` are W contiguous 1-D tensors (sizes may differ; every rank must pass the same
    sizes); the other chunks hold partial results afterwards. At step s rank r sends chunk
    (r-s-1) mod W to the right and adds the chunk (r-s-2) mod W that arrives from the left.
    """
    right, left = (rank + 1) % world, (rank - 1) % world
    for step in range(world - 1):
        send_idx, recv_idx = (rank - step - 1) % world, (rank - step - 2) % world
        incoming = torch.empty_like(chunks[recv_idx])
        p2p.exchange(chunks[send_idx], right, incoming, left, group)
        combine_(chunks[recv_idx], incoming, op)


def all_gather_simple(chunks: list[torch.Tensor], rank: int, world: int, group=None) -> None:
    """In place: ``chunks[rank]`` is this rank's data; afterwards every chunk is filled on every rank.

    At step s rank r sends chunk (r-s) mod W and receives chunk (r-s-1) mod W straight into place.
    """
    right, left = (rank + 1) % world, (rank - 1) % world
    for step in range(world - 1):
        send_idx, recv_idx = (rank - step) % world, (rank - step - 1) % world
        p2p.exchange(chunks[send_idx], right, chunks[recv_idx], left, group)


def all_reduce_simple(flat: torch.Tensor, op: str, rank: int, world: int, group=None) -> None:
    """Base ring all-reduce of a contiguous 1-D tensor, in place (``avg`` left to the caller)."""
    chunks = list(flat.tensor_split(world))
    reduce_scatter_simple(chunks, op, rank, world, group)
    all_gather_simple(chunks, rank, world, group)


# --- refinement: every receive posted up front ------------------------------------------------

def reduce_scatter_preposted(chunks: list[torch.Tensor], op: str, rank: int, world: int,
                             group=None) -> None:
    """``reduce_scatter_simple`` with all W-1 receives posted before the first send.

    Each receive has its own slot of a reusable scratch buffer, so data can land while this rank
    is still reducing the previous step: only "reduce, then send the result on" is left on the
    critical path of each step. Same messages, same additions, same result as the base ring.
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


def all_gather_preposted(chunks: list[torch.Tensor], rank: int, world: int, group=None) -> None:
    """``all_gather_simple`` with every receive posted up front, straight into its chunk.

    Each step forwards the chunk that arrived in the step before.
    """
    right, left = (rank + 1) % world, (rank - 1) % world
    recvs = [p2p.irecv(chunks[(rank - step - 1) % world], left, group) for step in range(world - 1)]
    sends = []
    for step in range(world - 1):
        if step > 0:
            p2p.wait_all([recvs[step - 1]])
        sends.append(p2p.isend(chunks[(rank - step) % world], right, group))
    p2p.wait_all(recvs[-1:] + sends)


def all_reduce_preposted(flat: torch.Tensor, op: str, rank: int, world: int, group=None) -> None:
    """Ring all-reduce of a contiguous 1-D tensor, in place (``avg`` left to the caller).

    After the reduce-scatter phase, rank r holds the finished chunk r; the all-gather phase then
    circulates the finished chunks. Every rank ends with bit-identical values.
    """
    chunks = list(flat.tensor_split(world))
    reduce_scatter_preposted(chunks, op, rank, world, group)
    all_gather_preposted(chunks, rank, world, group)


# the library's ring (what ``collectives`` calls with algorithm="ring") is the pre-posted one
reduce_scatter_chunks = reduce_scatter_preposted
all_gather_chunks = all_gather_preposted
all_reduce = all_reduce_preposted

VARIANTS = {"simple": all_reduce_simple, "preposted": all_reduce_preposted}


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
