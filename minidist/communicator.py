"""Hand-built or torch: the collectives a strategy uses, bound to one process group, and the one
communication thread that runs them beside the computation.

:class:`Communicator`: ``collectives="hand-built"`` (:mod:`minidist.collectives`, ``"auto"`` by
default) or ``"torch"``, in place and flat as torch's. :class:`CommThread` runs submitted work in
order on its own thread and process group, so communication overlaps backward and compute.

Design notes: docs/design/ground.md"""

from __future__ import annotations

import queue
import threading
import weakref

import torch
import torch.distributed as dist

from . import collectives as C
from .comm import hierarchical, p2p, threads, topology
from .comm.ops import check_group

__all__ = ["COLLECTIVES", "check_collectives", "check_algorithm", "Communicator", "CommThread",
           "Handle"]

COLLECTIVES = ("hand-built", "torch")
# torch renamed the flat-tensor collectives (the old names warn); keep torch >= 2.4 working
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_TORCH_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
              "min": dist.ReduceOp.MIN}


def check_algorithm(algorithm: str) -> str:
    """``"auto"`` or a hand-built algorithm name of at least one op; else ValueError."""
    names = {a for tables in (C.ALGORITHMS, C.TOPOLOGY_ALGORITHMS)
             for table in tables.values() for a in table}
    if algorithm != C.AUTO and algorithm not in names:
        raise ValueError(f"algorithm must be 'auto' or one of {sorted(names)}, got {algorithm!r}")
    return algorithm


def check_collectives(collectives: str) -> str:
    """``"hand-built"`` or ``"torch"``; anything else is a ValueError naming both."""
    if collectives not in COLLECTIVES:
        raise ValueError(f"collectives must be 'hand-built' or 'torch', got {collectives!r}")
    return collectives


class Communicator:
    """``all_reduce`` / ``all_gather`` / ``reduce_scatter`` / ``broadcast`` on ``group`` (default: the
    world) by the implementation ``collectives`` names; ``algorithm`` (default ``"auto"``) applies to
    the ops that have it. ValueError: unknown ``collectives``; RuntimeError: no process group; a
    ``group`` not of this rank: TypeError / ValueError naming ``where``."""

    def __init__(self, collectives: str = "hand-built", group=None, where: str = "communicator",
                 algorithm: str = "auto"):
        check_collectives(collectives)
        check_algorithm(algorithm)
        self.algorithm = algorithm
        # a fixed name for the ops that have it; the others their default (the first listed)
        self._alg = {op: algorithm if (algorithm in table or algorithm == C.AUTO
                                       or algorithm in C.TOPOLOGY_ALGORITHMS.get(op, {}))
                     else next(iter(table)) for op, table in C.ALGORITHMS.items()}
        if not dist.is_initialized():
            raise RuntimeError("the process group is not initialised; run inside minidist.run(...) "
                               "or call minidist.init() first")
        check_group(where, group)              # ``where`` names the caller in the error
        self.collectives, self.group = collectives, group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """``t`` ← ``op`` ("sum", "avg", "max", "min") of every rank's ``t``, in place."""
        if self.world_size == 1:
            return t
        if self.collectives == "hand-built":
            return C.all_reduce(t, op=op, algorithm=self._alg["all_reduce"], group=self.group)
        if op not in _TORCH_OPS:
            raise ValueError(f"all_reduce (rank {self.rank}): op must be one of "
                             f"{sorted(_TORCH_OPS)}, got {op!r}")
        dist.all_reduce(t, op=_TORCH_OPS[op], group=self.group)
        if op == "avg":
            t.div_(self.world_size)
        return t

    def all_gather(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``out`` (contiguous, ``W · x.numel()`` elements, e.g. ``[W, *x.shape]``) ← every rank's
        ``x`` in rank order (``x`` may be a view of ``out``)."""
        if out.numel() != self.world_size * x.numel():
            raise ValueError(f"all_gather (rank {self.rank}): output has {out.numel()} elements, "
                             f"expected W x input = {self.world_size} x {x.numel()}")
        flat = out.view(-1)
        if self.world_size == 1:
            if flat.data_ptr() != x.data_ptr():
                flat.copy_(x.reshape(-1))
            return out
        if self.collectives == "hand-built":
            C.all_gather(flat, x.reshape(-1).contiguous(), algorithm=self._alg["all_gather"],
                         group=self.group)
        else:
            _ALL_GATHER(flat, x.reshape(-1).clone(), group=self.group)
        return out

    def reduce_scatter(self, shard: torch.Tensor, flat: torch.Tensor, op: str = "avg",
                       divisor: float | None = None) -> torch.Tensor:
        """``shard`` [S] ← piece ``rank`` of the sum over ranks of ``flat`` [W·S], divided by
        ``divisor`` (default: W when ``op="avg"``, 1 when ``"sum"``). ``flat`` is scratch."""
        if flat.numel() != self.world_size * shard.numel():
            raise ValueError(f"reduce_scatter (rank {self.rank}): flat buffer has {flat.numel()} "
                             f"elements, expected W x shard = {self.world_size} x {shard.numel()}")
        if self.world_size > 1:
            if self.collectives == "hand-built":
                C.reduce_scatter(shard, flat.reshape(-1), op="sum",
                                 algorithm=self._alg["reduce_scatter"], group=self.group)
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

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """From group rank ``src`` to every rank of the group, in place."""
        if self.world_size == 1:
            return t
        if self.collectives == "hand-built":
            return C.broadcast(t, src, algorithm=self._alg["broadcast"], group=self.group)
        dist.broadcast(t, dist.get_global_rank(self.group, src) if self.group is not None else src,
                       group=self.group)
        return t


class Handle:
    """Work running on a :class:`CommThread`: ``wait()`` re-raises its error here."""

    def __init__(self, what: str):
        self.what, self.error, self._done = what, None, threading.Event()

    def wait(self) -> None:
        self._done.wait()
        if self.error is not None:
            raise RuntimeError(f"{self.what} failed on the communication thread: "
                               f"{self.error}") from self.error


class CommThread:
    """The communication thread of ``comm``: runs ``fn(communicator, *args)`` for each :meth:`submit`,
    in order, on a process group of its own (the members of ``comm.group``). Every rank must submit the
    same collectives in the same order. Stopped by :meth:`close` or garbage collection."""

    def __init__(self, comm: Communicator, name: str = "comm"):
        group = comm.group
        # A group of its own: collectives on the main thread never share a wire with it. On a
        # subgroup only its members create it (use_local_synchronization: the name is hashed from
        # the ranks). A plain new_group expects every rank of the world to create the same group;
        # the DP groups of a ProcessGrid, each created by its own members, would get one name and
        # one store prefix, and two groups' ranks would connect to each other.
        # Under a two-level topology a world group's thread gets sub-groups of its own too, so
        # that "hierarchical" (chosen, or picked by "auto") runs there without sharing a wire with
        # the main thread's (every rank makes a world communicator's thread: the call is collective).
        topo = topology.current()
        if group is None and comm.collectives == "hand-built" and topo is not None \
                and topo.size == dist.get_world_size():
            own = hierarchical.new_group(list(range(dist.get_world_size())))
        elif group is None:
            own = dist.new_group()
        else:
            own = dist.new_group(ranks=dist.get_process_group_ranks(group),
                                 use_local_synchronization=True)
        # gloo's new_group returns on a rank once *its* side of every connection is up; a rank
        # that then closes this thread and exits at once (a DDP built and dropped) would leave
        # a slower rank inside gloo's connect: "Gloo connectFullMesh failed ... Connection
        # closed by peer" (seen in the test suite under load). Everyone waits until all are in,
        # as the launcher does after init (launch/rank_process.py).
        if isinstance(own, dist.ProcessGroup) and dist.get_backend(own) == "gloo":
            dist.barrier(group=own)
        self.comm: Communicator | None = Communicator(comm.collectives, own,
                                                      algorithm=comm.algorithm)
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=_serve, args=(self._queue,), daemon=True, name=name)
        self._thread.start()
        self._finalizer = weakref.finalize(self, self._queue.put, None)
        threads.register(self._thread, self._finalizer)   # stopped before the group goes

    def submit(self, what: str, fn, *args) -> Handle:
        """Run ``fn(self.comm, *args)`` on the thread; returns a :class:`Handle`."""
        if self.comm is None:
            raise RuntimeError(f"CommThread {self._thread.name!r}: submit({what!r}) after close()")
        h = Handle(what)
        self._queue.put((h, fn, (self.comm, *args)))
        return h

    def stop(self) -> None:
        """Ask the thread to finish after the queued work (safe from any thread, e.g. a finalizer)."""
        self._finalizer()

    def close(self) -> None:
        """Stop the thread (wait up to 5 s), then destroy its process group (kept if it has not stopped)."""
        self._finalizer()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)
        if not self._thread.is_alive() and self.comm is not None:
            hierarchical.destroy_subgroups(self.comm.group)
            p2p.destroy_group(self.comm.group)
            self.comm = None   # the last reference: the group's threads go now


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
