"""Ring algorithms: reduce-scatter, all-gather, all-reduce (= reduce-scatter + all-gather), broadcast.

Each step every rank sends one chunk right and receives one from the left, both posted first.
The base ring (``*_simple``, exercise 03) and the pre-posted ring (``*_preposted``, every receive
posted up front; the library's ``reduce_scatter_chunks``, ``all_gather_chunks``, ``all_reduce``)
give bit-identical results; all-reduce sends 2(W-1)/W · N elements per rank (Patarasuk & Yuan
2009). ``rank``/``world``: the place in ``group`` and its size, checked by :mod:`.checks`.

Design notes: docs/design/ground.md"""

from __future__ import annotations

import torch

from . import checks, p2p
from .ops import combine_, scratch_buffer as _scratch_buffer


# --- the base ring: one exchange per step ------------------------------------------------------

def reduce_scatter_simple(chunks: list[torch.Tensor], op: str, rank: int, world: int,
                          group=None) -> None:
    """In place: afterwards ``chunks[rank]`` holds the reduction of every rank's ``chunks[rank]``.

    ``chunks`` are W contiguous 1-D tensors (sizes may differ; every rank must pass the same
    sizes); the other chunks hold partial results afterwards. At step s rank r sends chunk
    (r-s-1) mod W to the right and adds the chunk (r-s-2) mod W that arrives from the left."""
    right, left = (rank + 1) % world, (rank - 1) % world
    for step in range(world - 1):
        send_idx, recv_idx = (rank - step - 1) % world, (rank - step - 2) % world
        incoming = torch.empty_like(chunks[recv_idx])
        p2p.exchange(chunks[send_idx], right, incoming, left, group)
        combine_(chunks[recv_idx], incoming, op)


def all_gather_simple(chunks: list[torch.Tensor], rank: int, world: int, group=None) -> None:
    """In place: ``chunks[rank]`` is this rank's data; afterwards every chunk is filled on every rank.

    At step s rank r sends chunk (r-s) mod W and receives chunk (r-s-1) mod W straight into place."""
    right, left = (rank + 1) % world, (rank - 1) % world
    for step in range(world - 1):
        send_idx, recv_idx = (rank - step) % world, (rank - step - 1) % world
        p2p.exchange(chunks[send_idx], right, chunks[recv_idx], left, group)


def all_reduce_simple(flat: torch.Tensor, op: str, rank: int, world: int, group=None) -> None:
    """In place: afterwards ``flat`` (contiguous, 1-D) holds the reduction over the group
    (``avg`` adds; the division is left to the caller)."""
    chunks = list(flat.tensor_split(world))
    reduce_scatter_simple(chunks, op, rank, world, group)
    all_gather_simple(chunks, rank, world, group)


# --- refinement: every receive posted up front ------------------------------------------------

def reduce_scatter_preposted(chunks: list[torch.Tensor], op: str, rank: int, world: int,
                             group=None, posted=None) -> None:
    """In place: afterwards ``chunks[rank]`` holds the reduction of every rank's ``chunks[rank]``.

    ``reduce_scatter_simple`` with all W-1 receives posted first, each into its own slot of a
    scratch buffer, so data lands while this rank is still reducing the previous step (gloo sends
    a message once its receive is posted: a send that comes first waits a round trip more).
    ``posted``: what :func:`post_reduce_scatter` returned, when the caller posted them earlier."""
    if world == 1:
        return
    right = (rank + 1) % world
    recv_idx = [(rank - step - 2) % world for step in range(world - 1)]
    slots, recvs = posted or post_reduce_scatter(chunks, rank, world, group)
    sends = []
    for step in range(world - 1):
        # the chunk reduced in the previous step (at step 0: this rank's own) goes right
        sends.append(p2p.isend(chunks[(rank - step - 1) % world], right, group))
        p2p.wait_all([recvs[step]])
        combine_(chunks[recv_idx[step]], slots[step], op)
    p2p.wait_all(sends)


def post_reduce_scatter(chunks, rank, world, group=None):
    """Post the ring reduce-scatter's W-1 receives from the left, into scratch: (slots, works)."""
    sizes = [chunks[(rank - step - 2) % world].numel() for step in range(world - 1)]
    slots = list(_scratch_buffer(sum(sizes), chunks[0]).split(sizes))
    return slots, [p2p.irecv(slot, (rank - 1) % world, group) for slot in slots]


def all_gather_preposted(chunks: list[torch.Tensor], rank: int, world: int, group=None,
                         posted=None) -> None:
    """In place: ``chunks[rank]`` is this rank's data; afterwards every chunk is filled on every rank.

    ``all_gather_simple`` with every receive posted up front, straight into its chunk
    (``posted``: :func:`post_all_gather`'s works, when the caller posted them earlier)."""
    right = (rank + 1) % world
    recvs = posted or post_all_gather(chunks, rank, world, group)
    sends = []
    for step in range(world - 1):
        if step > 0:
            p2p.wait_all([recvs[step - 1]])
        sends.append(p2p.isend(chunks[(rank - step) % world], right, group))
    p2p.wait_all(recvs[-1:] + sends)


def post_all_gather(chunks, rank, world, group=None):
    """Post the ring all-gather's W-1 receives from the left, straight into their chunks."""
    return [p2p.irecv(chunks[(rank - step - 1) % world], (rank - 1) % world, group)
            for step in range(world - 1)]


def all_reduce_preposted(flat: torch.Tensor, op: str, rank: int, world: int, group=None) -> None:
    """In place: afterwards ``flat`` (contiguous, 1-D) holds the reduction over the group,
    bit-identical on every rank (``avg`` adds; the division is left to the caller).

    The all-gather's receives are posted with the reduce-scatter's, before any send: a chunk's
    reduced value reaches this rank only after the chain that reduces it has taken this rank's
    last send of that chunk, so nothing lands on a chunk still being sent or reduced."""
    if world == 1:
        return
    chunks = list(flat.tensor_split(world))
    rs = post_reduce_scatter(chunks, rank, world, group)
    ag = post_all_gather(chunks, rank, world, group)
    reduce_scatter_preposted(chunks, op, rank, world, group, posted=rs)
    all_gather_preposted(chunks, rank, world, group, posted=ag)


# --- the public names: each ring with the place check in front (checks.py) ------------------
# The functions above stay plain (chapter 03 prints them); the rings call each other by these names.

reduce_scatter_simple = checks.placed(reduce_scatter_simple, "ring.reduce_scatter_simple")
all_gather_simple = checks.placed(all_gather_simple, "ring.all_gather_simple")
all_reduce_simple = checks.placed(all_reduce_simple, "ring.all_reduce_simple")
reduce_scatter_preposted = checks.placed(reduce_scatter_preposted, "ring.reduce_scatter_chunks")
all_gather_preposted = checks.placed(all_gather_preposted, "ring.all_gather_chunks")
all_reduce_preposted = checks.placed(all_reduce_preposted, "ring.all_reduce")

# the library's ring (what ``collectives`` calls with algorithm="ring") is the pre-posted one
reduce_scatter_chunks = reduce_scatter_preposted
all_gather_chunks = all_gather_preposted
all_reduce = all_reduce_preposted

VARIANTS = {"simple": all_reduce_simple, "preposted": all_reduce_preposted}


def broadcast(flat: torch.Tensor, src: int, rank: int, world: int, group=None,
              segment_elems: int = 1 << 18) -> None:
    """Pipelined chain broadcast from ``src``: segments flow src -> src+1 -> ... around the ring."""
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
