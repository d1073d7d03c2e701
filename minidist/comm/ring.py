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

``rank`` and ``world`` are this process's place in ``group`` and the group's size, not its global
rank and the world's: every public name checks them first (one cached look-up) and raises
``ValueError`` on the ranks that pass a wrong one, naming the place they hold.
"""

from __future__ import annotations

import functools
import inspect
import textwrap

import torch
import torch.distributed as dist

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


# --- the public entry points: rank and world checked against the group -----------------------

def _check_place(name: str, rank, world, group) -> None:
    """Raise ``ValueError`` unless ``rank`` is this process's place in ``group`` and ``world`` its
    size. A global rank passed for a sub-group's place would otherwise reach p2p as a peer that is
    this rank itself, or outside the group, with advice meant for a whole world. One cached
    lookup (:func:`p2p.rank_and_size`) per call."""
    me, size = p2p.group_rank_world(group)
    if rank == me and world == size:
        return
    where = f"ring.{name} (rank {dist.get_rank() if dist.is_initialized() else 0})"
    if me < 0:
        raise ValueError(f"{where}: this process is not a member of the group it passed; only the "
                         "group's members may call a ring on it")
    if rank != me:
        places = (f"the ranks of a group are numbered 0 … {size - 1} in the order of their global "
                  "ranks" if size > 1 else "a group of one rank has only place 0")
        hint = (f" (rank={rank} is this process's global rank; {places})"
                if group is not None and dist.is_initialized() and rank == dist.get_rank() else "")
        raise ValueError(f"{where}: rank={rank!r} but this process is rank {me} of its group "
                         f"(size {size}): pass the place in the group{hint}")
    raise ValueError(f"{where}: world={world!r} but its group has {size} rank"
                     f"{'s' if size != 1 else ''}: pass the group's size")


_CONTRACT = {
    "reduce_scatter": "In place: afterwards ``chunks[rank]`` holds the reduction (``op``) over the "
                      "group of every member's ``chunks[rank]``; the other chunks hold partial "
                      "results. ``chunks``: ``world`` contiguous 1-D tensors (sizes may differ, the "
                      "same on every rank: ``tensor_split``).",
    "all_gather": "In place: ``chunks[rank]`` is this rank's data; afterwards every chunk holds "
                  "its owner's (chunk ``i`` that of the group's rank ``i``), on every rank.",
    "all_reduce": "In place: afterwards ``flat`` (a contiguous 1-D tensor) holds the reduction "
                  "(``op``) over the group of every member's ``flat``, bit-identical on every "
                  "rank; ``avg`` adds, the division is left to the caller.",
}
_PLACE = ("``rank`` is this process's place in ``group`` (0 … world-1: for a sub-group not the "
          "global rank) and ``world`` the group's size; both are checked (``ValueError``). "
          "``group=None``: the world.")


def _documented(checked, fn, kind: str, name: str):
    """``checked`` as ``fn`` for ``help()`` and ``inspect``: its name, signature and source
    (``__wrapped__``), and a docstring that starts with the contract."""
    functools.update_wrapper(checked, fn)
    alias = f" (``ring.{name}``)" if name != fn.__name__ else ""
    paragraphs = [_CONTRACT[kind], _PLACE, f"{fn.__name__}{alias}: {inspect.getdoc(fn)}"]
    checked.__doc__ = "\n\n".join(
        "\n".join(textwrap.fill(line, 96) for line in p.split("\n")) for p in paragraphs)
    return checked


def _reducing(fn, kind: str, name: str):
    if kind == "reduce_scatter":
        def checked(chunks, op, rank, world, group=None):
            _check_place(name, rank, world, group)
            return fn(chunks, op, rank, world, group)
    else:
        def checked(flat, op, rank, world, group=None):
            _check_place(name, rank, world, group)
            return fn(flat, op, rank, world, group)
    return _documented(checked, fn, kind, name)


def _gathering(fn, name: str):
    def checked(chunks, rank, world, group=None):
        _check_place(name, rank, world, group)
        return fn(chunks, rank, world, group)
    return _documented(checked, fn, "all_gather", name)


# Each public name is its function with the check in front (``inspect.getsource`` and the chapter
# show the function itself: ``__wrapped__``). The rings call each other through these names.
reduce_scatter_simple = _reducing(reduce_scatter_simple, "reduce_scatter", "reduce_scatter_simple")
all_gather_simple = _gathering(all_gather_simple, "all_gather_simple")
all_reduce_simple = _reducing(all_reduce_simple, "all_reduce", "all_reduce_simple")
reduce_scatter_preposted = _reducing(reduce_scatter_preposted, "reduce_scatter",
                                     "reduce_scatter_chunks")
all_gather_preposted = _gathering(all_gather_preposted, "all_gather_chunks")
all_reduce_preposted = _reducing(all_reduce_preposted, "all_reduce", "all_reduce")

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
