"""The size agreement carried beside the data, for an all-gather or a reduce-scatter of two ranks.

Every collective agrees the per-rank sizes before data moves, because gloo aborts the process on a
message longer than its receive buffer and silently accepts a shorter one (a stale element):
:func:`.ops.check_sizes_agree`, one small all-reduce, a round trip before the data's. At W = 2
these collectives are one exchange. A caller that names its call site (``key``: the same on every
rank, e.g. tensor parallelism's module scope and dimension) gets every rank to remember the sizes
that site agreed last: the calls come in the same order on every rank, so every rank remembers the
same. Each rank then sends a 2-element header, its own sizes, beside a payload of that **agreed**
length, and receives the same: one round trip for data and agreement together.

- Both ranks' sizes are the agreed ones (a training loop's steady state): the data has moved.
- Both ranks' sizes are equal but new (the next shape): the payloads were the old length and are
  dropped; both ranks agree on the new sizes and exchange again.
- They differ: both ranks raise the same :class:`CollectiveMismatchError` as ``check_sizes_agree``.

No message is ever longer or shorter than its receive buffer, whatever the ranks pass. A site's
first call runs ``check_sizes_agree`` and the caller's algorithm. gloo and CPU tensors only (where
a round trip costs most: ~0.5 ms on 2 shared cores); the header is bookkeeping, as the all-reduce it
replaces, so it goes by ``torch.distributed`` and is not counted as the collective's traffic.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from . import p2p
from .ops import check_sizes_agree, sizes_mismatch

__all__ = ["exchange_agreed"]

# group -> {(op, call site): the sizes its ranks agreed last}
_AGREED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_HEADER_TAG = 1 << 30   # the header's own tag: never matched with a payload


def _table(group) -> dict:
    return _AGREED.setdefault(group if group is not None else dist.group.WORLD, {})


def exchange_agreed(opname: str, group, key, sizes: list[int], send: torch.Tensor,
                    recv: torch.Tensor) -> bool:
    """At W = 2: send ``send`` to the other rank and receive its message into ``recv`` (1-D,
    contiguous CPU tensors, ``sizes[this rank]`` / ``sizes[the other]`` elements or the reverse,
    as the op says), after agreeing that both ranks passed ``sizes`` (elements per piece). ``key``:
    the call site, the same on every rank. Returns False without moving data on the site's first
    call (the sizes are agreed then, :func:`.ops.check_sizes_agree`, and the caller runs its
    algorithm).

    Raises:
        CollectiveMismatchError: on both ranks, when they passed different ``sizes`` (the
            message of :func:`.ops.check_sizes_agree`).
    """
    site = (opname, key)
    agreed = _table(group).get(site)
    if agreed is None:
        check_sizes_agree(opname, group, sizes, send.device)
        _table(group)[site] = list(sizes)
        return False
    rank = dist.get_rank(group)
    peer = 1 - rank
    mine = torch.tensor(sizes, dtype=torch.int64)
    theirs = torch.empty(2, dtype=torch.int64)
    # the payloads have the agreed lengths: this rank's send is the piece the other rank expects
    out_n, in_n = agreed[_send_piece(opname, rank)], agreed[_send_piece(opname, peer)]
    out = send if send.numel() == out_n else torch.zeros(out_n, dtype=send.dtype, device=send.device)
    into = recv if recv.numel() == in_n else torch.empty(in_n, dtype=recv.dtype, device=recv.device)
    header = [dist.irecv(theirs, group=group, tag=_HEADER_TAG, group_src=peer),
              dist.isend(mine, group=group, tag=_HEADER_TAG, group_dst=peer)]
    data = [p2p.irecv(into, peer, group), p2p.isend(out, peer, group)]
    p2p.wait_all(data)
    for work in header:
        if work is not None:   # torch types a non-member's call as None; both are members here
            work.wait()
    theirs_list = theirs.tolist()
    if theirs_list == list(sizes) == agreed:
        return True
    if theirs_list != list(sizes):
        everyone = [list(sizes), theirs_list] if rank == 0 else [theirs_list, list(sizes)]
        raise sizes_mismatch(opname, rank, everyone, when="(the output is no result)")
    _table(group)[site] = list(sizes)   # the next shape: both ranks agree, exchange again
    p2p.exchange(send, peer, recv, peer, group)
    return True


def _send_piece(opname: str, rank: int) -> int:
    """Which piece ``rank`` sends at W = 2: its own (all-gather), the other's (reduce-scatter)."""
    return rank if opname == "all_gather" else 1 - rank
