"""The collectives a sharding strategy needs, bound to one process group and one implementation.

``collectives="hand-built"`` runs minidist's own ring (:mod:`minidist.collectives`, built from
isend/irecv, traffic counted by :mod:`minidist.comm.p2p`); ``"torch"`` runs ``torch.distributed``'s
(``all_gather_single`` / ``reduce_scatter_single``, formerly ``*_into_tensor``/``*_tensor``;
not counted by minidist's counters).

Every sharded buffer here is *flat and padded*: ``numel = W · shard_numel``, rank r's shard is
elements ``[r·S, (r+1)·S)``. So both collectives move equal pieces, and per rank a ring moves
(W-1)/W of the buffer: an all-gather plus a reduce-scatter is exactly one ring all-reduce
(Rajbhandari et al. 2020, ZeRO, §7.2.1).

:class:`CommWorker` runs collectives on a thread of its own, on a process group of its own, so a
reduce-scatter overlaps the rest of backward (as :class:`minidist.data_parallel.BucketedDDP` does)
and a prefetched all-gather overlaps the current unit's compute (FSDP, Zhao et al. 2023, §3.3).
"""

from __future__ import annotations

import queue
import threading
import weakref

import torch
import torch.distributed as dist

from .. import collectives as C
from ..comm import threads
from ..comm.ops import check_group

__all__ = ["Collectives", "CommWorker", "Handle", "KINDS"]

KINDS = ("hand-built", "torch")
# torch renamed the flat-tensor collectives (the old names warn); keep torch >= 2.4 working
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Collectives:
    """``all_gather``/``reduce_scatter``/``all_reduce``/``broadcast`` on ``group`` with ``kind``.

    Raises ``ValueError`` for an unknown ``kind`` and ``RuntimeError`` without a process group.
    """

    def __init__(self, kind: str = "hand-built", group=None):
        if kind not in KINDS:
            raise ValueError(f"collectives must be one of {KINDS}, got {kind!r}")
        if not dist.is_initialized():
            raise RuntimeError("sharding: the process group is not initialised; run inside "
                               "minidist.run(...) or call minidist.init() first")
        check_group("sharding", group)
        self.kind, self.group = kind, group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)

    def all_gather(self, flat: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
        """``flat`` [W·S] ← every rank's ``shard`` [S] (``shard`` may be a view of ``flat``)."""
        if flat.numel() != self.world_size * shard.numel():
            raise ValueError(f"all_gather (rank {self.rank}): flat buffer has {flat.numel()} "
                             f"elements, expected W x shard = {self.world_size} x {shard.numel()}")
        if self.world_size == 1:
            if flat.data_ptr() != shard.data_ptr():
                flat.copy_(shard.reshape(-1))
            return flat
        if self.kind == "hand-built":
            C.all_gather(flat, shard.reshape(-1), group=self.group)
        else:
            _ALL_GATHER(flat, shard.reshape(-1).clone(), group=self.group)
        return flat

    def reduce_scatter(self, shard: torch.Tensor, flat: torch.Tensor, op: str = "avg",
                       divisor: float | None = None) -> torch.Tensor:
        """``shard`` [S] ← piece ``rank`` of the sum over ranks of ``flat`` [W·S], divided by
        ``divisor`` (default: W when ``op="avg"``, 1 when ``"sum"``). ``flat`` is scratch."""
        if flat.numel() != self.world_size * shard.numel():
            raise ValueError(f"reduce_scatter (rank {self.rank}): flat buffer has {flat.numel()} "
                             f"elements, expected W x shard = {self.world_size} x {shard.numel()}")
        if self.world_size > 1:
            if self.kind == "hand-built":
                C.reduce_scatter(shard, flat.reshape(-1), op="sum", group=self.group)
            else:
                out = torch.empty_like(shard)
                _REDUCE_SCATTER(out, flat.reshape(-1), group=self.group)
                shard.copy_(out)
        elif flat.data_ptr() != shard.data_ptr():
            shard.copy_(flat.reshape(-1))
        if divisor is None:
            divisor = self.world_size if op == "avg" else 1
        if divisor != 1:
            shard.div_(divisor)
        return shard

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if self.world_size == 1:
            return t
        if self.kind == "hand-built":
            return C.all_reduce(t, op=op, group=self.group)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        if op == "avg":
            t.div_(self.world_size)
        return t

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """From group rank ``src`` to every rank of the group, in place."""
        if self.world_size == 1:
            return t
        if self.kind == "hand-built":
            return C.broadcast(t, src, group=self.group)
        dist.broadcast(t, dist.get_global_rank(self.group, src) if self.group else src,
                       group=self.group)
        return t


class Handle:
    """A collective running on a :class:`CommWorker`: ``wait()`` re-raises its error here."""

    def __init__(self, what: str):
        self.what, self.error, self._done = what, None, threading.Event()

    def wait(self) -> None:
        self._done.wait()
        if self.error is not None:
            raise RuntimeError(f"{self.what} failed on the communication thread: "
                               f"{self.error}") from self.error


class CommWorker:
    """A thread that runs submitted collectives in submission order on its own process group.

    Every rank must submit the same collectives in the same order. The thread releases the GIL
    while gloo waits, so the main thread keeps computing. Stopped by :meth:`close` or when
    garbage-collected.
    """

    def __init__(self, kind: str = "hand-built", group=None):
        # a group of its own: collectives on the main thread never share a wire with it. Only the
        # members create it (a data-parallel subgroup's peers do not call this at the same time)
        ranks = dist.get_process_group_ranks(group) if group is not None else None
        self.comm = Collectives(kind, dist.new_group(ranks=ranks, use_local_synchronization=True)
                                if ranks is not None else dist.new_group())
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=_serve, args=(self._queue,), daemon=True,
                                        name="sharding-comm")
        self._thread.start()
        self._finalizer = weakref.finalize(self, self._queue.put, None)
        threads.register(self._thread, self._finalizer)   # stopped before the group goes

    def submit(self, what: str, fn, *args) -> Handle:
        """Run ``fn(self.comm, *args)`` on the thread; returns a :class:`Handle`."""
        h = Handle(what)
        self._queue.put((h, fn, (self.comm, *args)))
        return h

    def close(self) -> None:
        self._finalizer()
        self._thread.join(timeout=5)


def _serve(q: queue.Queue) -> None:
    while True:
        item = q.get()
        if item is None:
            return
        h, fn, args = item
        try:
            fn(*args)
        except BaseException as e:  # noqa: BLE001 - re-raised by Handle.wait on the main thread
            h.error = e
        finally:
            h._done.set()
            del h, fn, args, item
