"""Point-to-point send/recv: the only primitives minidist's collectives are built from.

Every call is recorded per process: traffic counters (bytes and messages, keyed by the running
collective, ``"all_reduce/ring"``, ``"p2p"`` outside one) and the current operation (op, peer,
bytes, sequence number; in shared memory under :func:`minidist.run`, so a timeout can say who
waited on whom). Peers are group ranks; this module checks them itself (errors naming rank, op
and peer) and calls the group's own ``send``/``recv``. Empty tensors are never sent. CUDA tensors
on gloo go through :mod:`minidist.comm.staging`; under a two-level topology each send is paced to
its link's class (:mod:`minidist.comm.topology`).

Design notes: docs/design/ground.md"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import staging, topology as _topology

__all__ = [
    "send", "recv", "isend", "irecv", "wait_all", "exchange",
    "destroy_group", "group_rank_world", "LOCAL", "traffic", "reset_traffic", "count_traffic", "collective", "publish", "Traffic",
]


@dataclass
class Traffic:
    """Bytes and messages one rank sent and received (one row per collective name); ``*_inter`` /
    ``*_intra``: bytes sent between / inside nodes (only while a topology is installed)."""

    bytes_sent: int = 0
    bytes_recv: int = 0
    msgs_sent: int = 0
    msgs_recv: int = 0
    bytes_sent_inter: int = 0
    bytes_sent_intra: int = 0

    def __iadd__(self, other: "Traffic") -> "Traffic":
        for k, v in vars(other).items():
            setattr(self, k, getattr(self, k) + v)
        return self

    def __sub__(self, other: "Traffic") -> "Traffic":
        return Traffic(**{k: v - getattr(other, k) for k, v in vars(self).items()})


class _Scopes(threading.local):
    def __init__(self):
        self.stack = []  # collective names, innermost last; per thread (a DDP comm thread has its own)


@dataclass
class _State:
    seq: int = 0
    scopes: _Scopes = field(default_factory=_Scopes)
    traffic: dict = field(default_factory=lambda: defaultdict(Traffic))
    total: Traffic = field(default_factory=Traffic)   # the rows summed: count_traffic's snapshot
    # The counters are shared by the threads of a rank (a DDP comm thread sends while the main
    # thread's TP regions snapshot them): every read and write of the dict holds this lock.
    lock: Any = field(default_factory=threading.Lock)
    shm: Any = None  # multiprocessing.Array('c', N) installed by minidist.run
    last: str = "none yet"
    collectives: int = 0   # collectives this rank has finished (outermost scopes, main thread)


_state = _State()


def _install_shared_buffer(buf) -> None:
    """Called by the launcher in each child: where to publish the current op."""
    _state.shm = buf


def publish(text: str) -> None:
    """Say what this rank is doing now; shown per rank if :func:`minidist.run` times out."""
    _state.last = text
    if _state.shm is not None:
        data = text.encode("utf-8", "replace")[: len(_state.shm) - 1]
        _state.shm.raw = data + b"\0" * (len(_state.shm) - len(data))


def progress() -> tuple[int, str]:
    """``(collectives finished by the main thread, what it last published)``, for the launcher."""
    return _state.collectives, _state.last


def _scope_name() -> str:
    return _state.scopes.stack[-1] if _state.scopes.stack else "p2p"


class collective:
    """``with collective("all_reduce/ring"):`` attributes the p2p calls inside to that name."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __enter__(self) -> None:
        _state.scopes.stack.append(self.name)

    def __exit__(self, exc_type, *exc) -> None:
        _state.scopes.stack.pop()
        if not _state.scopes.stack:
            main = threading.current_thread() is threading.main_thread()
            if exc_type is not None:   # keep saying where it stopped
                if main:
                    publish(f"{self.name} (its collective #{_state.collectives + 1}), which failed")
                return
            _state.collectives += main
            publish(f"idle after {self.name} (seq {_state.seq})")


def _record(kind: str, tensor: torch.Tensor, peer: int) -> None:
    _state.seq += 1
    nbytes = tensor.numel() * tensor.element_size()
    scope = _scope_name()
    sending = kind in ("send", "isend")
    with _state.lock:
        for t in (_state.traffic[scope], _state.total):
            if sending:
                t.bytes_sent += nbytes
                t.msgs_sent += 1
            else:
                t.bytes_recv += nbytes
                t.msgs_recv += 1
    arrow = "to" if sending else "from"
    publish(f"{scope}: {kind} {arrow} rank {peer}, {nbytes} bytes, seq {_state.seq}")


_groups: dict = {}   # id(process group) -> (weakref to the group, this rank in it, its size)


class _Local:
    """The type of :data:`LOCAL`."""

    def __repr__(self) -> str:
        return "LOCAL"

    def __reduce__(self) -> str:
        return "LOCAL"     # copies and pickles are the one LOCAL (checked with ``is``)


LOCAL = _Local()
"""No process group: this process alone, ``(0, 1)``, and nothing is communicated. ``None`` is
always the world; a layer that can run with no communication at all (MoE's ``ep_group`` and
``stats_group``: the one-process layer) says so with ``LOCAL`` instead."""


def group_rank_world(group=None) -> tuple[int, int]:
    """``(rank in group, group size)``; None is the world, ``LOCAL`` and no world ``(0, 1)``."""
    if group is LOCAL:
        return 0, 1
    if not dist.is_initialized():
        if group is not None:
            raise RuntimeError("a process group was given but torch.distributed is not initialised")
        return 0, 1
    return rank_and_size(group)


def destroy_group(group) -> None:
    """Destroy ``group`` on this rank (local, idempotent) once every collective on it is done."""
    if group is None or not isinstance(group, dist.ProcessGroup):
        return                     # the world (not destroyed here) or a non-member's placeholder
    _groups.pop(id(group), None)
    try:
        dist.destroy_process_group(group)
    except ValueError:             # "Invalid process group": already destroyed, or gone with the world
        pass


def rank_and_size(group=None) -> tuple[int, int]:
    """``(dist.get_rank(group), dist.get_world_size(group))``, remembered per group object."""
    pg = group if group is not None else dist.GroupMember.WORLD
    hit = _groups.get(id(pg))
    if hit is None or hit[0]() is not pg:
        me, size = dist.get_rank(group), dist.get_world_size(group)
        if pg is None:           # not initialised: torch raised above; never cache
            return me, size
        if len(_groups) > 64:    # groups made and dropped in a loop: do not grow without end
            _groups.clear()
        ref = weakref.ref(pg) if isinstance(pg, dist.ProcessGroup) else (lambda: pg)
        hit = _groups[id(pg)] = (ref, me, size)   # weak: a dropped group's threads can go
    return hit[1], hit[2]


def _check(tensor: torch.Tensor, kind: str, peer: int, group) -> None:
    """Refuse what gloo would turn into a hang or an opaque C++ error, naming rank, op and peer."""
    if type(peer) is int and isinstance(tensor, torch.Tensor):   # the hot path: a valid message
        me, size = rank_and_size(group)
        if me >= 0 and 0 <= peer < size and peer != me and tensor.is_contiguous():
            return
    _refuse(tensor, kind, peer, group)


def _refuse(tensor: torch.Tensor, kind: str, peer: int, group) -> None:
    """:func:`_check`'s slow path: raise the error that names what is wrong (returns if nothing is)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{kind}: expected a torch.Tensor, got {type(tensor).__name__}")
    me, size = rank_and_size(group)
    where = f"{kind} on rank {dist.get_rank()}" + ("" if group is None else f" (group rank {me})")
    role = "dst" if kind.endswith("send") else "src"
    if me < 0:
        raise ValueError(f"{where}: this rank is not a member of the group it passed; only the "
                         "group's members may call point-to-point operations on it (check the "
                         "ranks given to new_group, or pass the group this rank belongs to)")
    if not isinstance(peer, int) or not 0 <= peer < size:
        raise ValueError(f"{where}: {role}={peer!r} is not a rank of the group (ranks 0..{size - 1}"
                         f", world size {size}). Peers are ranks inside the group; wrap around "
                         "with % world_size, e.g. (rank + 1) % world_size")
    if peer == me:
        verb, other = ("send to", "receive from") if kind.endswith("send") else ("receive from", "send to")
        raise ValueError(
            f"{where}: {role}={peer} is this rank itself; a rank cannot {verb} itself "
            f"(gloo has no connection to self). At world size {size} "
            + ("there is no other rank: a ring of W ranks makes W - 1 steps, none at W = 1 "
               "(check the loop's count: range(world_size - 1)); elsewhere copy the tensor "
               "locally or skip the exchange when world_size == 1" if size == 1 else
               f"pick another rank as the peer (e.g. (rank + 1) % world_size), and have that "
               f"rank {other} this one"))
    if not tensor.is_contiguous():
        raise ValueError(f"{where}, {role}={peer}: tensor must be contiguous; call .contiguous() "
                         "first")


class _Done:
    """Stands in for the Work of an empty message: nothing to wait for."""

    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True


def isend(tensor: torch.Tensor, dst: int, group=None, tag: int = 0, *, _kind: str = "isend"):
    """Non-blocking send of ``tensor`` to group rank ``dst``; returns a Work. ValueError: ``dst`` is
    this rank or not in ``group``; a non-contiguous tensor."""
    _check(tensor, _kind, dst, group)
    if tensor.numel() == 0:
        return _Done()
    _record(_kind, tensor, dst)
    if _topology.state.maybe:        # a two-level topology: pace to the link, count per class
        _shape(tensor, dst, group)
    return staging.isend(tensor, dst, group, tag)  # CUDA via CPU


def _shape(tensor: torch.Tensor, dst: int, group) -> None:
    nbytes = tensor.numel() * tensor.element_size()
    kind = _topology.pace(nbytes, dst, group)
    if kind is not None:
        with _state.lock:
            for t in (_state.traffic[_scope_name()], _state.total):
                setattr(t, f"bytes_sent_{kind}", getattr(t, f"bytes_sent_{kind}") + nbytes)


def irecv(tensor: torch.Tensor, src: int, group=None, tag: int = 0, *, _kind: str = "irecv"):
    """Non-blocking receive into ``tensor`` (contiguous, preallocated) from group rank ``src``.
    ValueError: ``src`` is this rank or not in ``group``; a non-contiguous tensor."""
    _check(tensor, _kind, src, group)
    if tensor.numel() == 0:
        return _Done()
    _record(_kind, tensor, src)
    return staging.irecv(tensor, src, group, tag)  # CUDA via CPU


def wait_all(works) -> None:
    """Wait for every Work; what this rank waits on is published for the launcher's timeout report."""
    works = list(works)
    if works and _state.shm is not None:
        publish(_state.last + " (waiting)")
    for w in works:
        w.wait()


def send(tensor: torch.Tensor, dst: int, group=None, tag: int = 0) -> None:
    """Blocking send (two ranks that both send first deadlock). Raises like :func:`isend`."""
    wait_all([isend(tensor, dst, group, tag, _kind="send")])


def recv(tensor: torch.Tensor, src: int, group=None, tag: int = 0) -> None:
    """Blocking receive into ``tensor`` from group rank ``src``. Raises like :func:`irecv`."""
    wait_all([irecv(tensor, src, group, tag, _kind="recv")])


def exchange(send_tensor, dst: int, recv_tensor, src: int, group=None) -> None:
    """Send to ``dst`` and receive from ``src``, both posted before waiting for both (the
    receive first: gloo sends a message once its receive is posted)."""
    works = []
    if recv_tensor is not None:
        works.append(irecv(recv_tensor, src, group))
    if send_tensor is not None:
        works.append(isend(send_tensor, dst, group))
    wait_all(works)


def traffic(name: str | None = None) -> dict | Traffic:
    """This rank's traffic so far: a dict ``{collective name: Traffic}``, or one row by name."""
    with _state.lock:
        if name is not None:
            return Traffic(**vars(_state.traffic.get(name, Traffic())))
        return {k: Traffic(**vars(v)) for k, v in _state.traffic.items()}


def reset_traffic() -> None:
    with _state.lock:
        _state.traffic.clear()
        _state.total = Traffic()


def _total() -> Traffic:
    with _state.lock:
        return Traffic(**vars(_state.total))


@contextlib.contextmanager
def count_traffic():
    """Count the traffic of the block: ``with count_traffic() as t: ...`` then ``t.bytes_sent``
    (every thread's sends and receives while the block runs, as :func:`traffic`)."""
    before = _total()
    total = Traffic()
    yield total
    total += _total() - before
