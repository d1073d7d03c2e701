"""Staging: move a CUDA tensor through a reusable (pinned) CPU buffer when the transport is gloo.

Gloo's ``send``/``recv`` take CPU tensors only; when ranks share a GPU (``device="cuda"``) every
message is a CUDA tensor. :mod:`minidist.comm.p2p` calls this module for each one: a send copies
the tensor into a CPU buffer (synchronous), a receive copies the buffer into the tensor when its
Work is waited on. Buffers come from a pool (pinned for GPU tensors: one DMA per copy) and are
reused. CPU tensors, and CUDA tensors on NCCL, go straight through. Without a GPU the path is
tested with ``staging.forced()`` or ``MINIDIST_FORCE_STAGING=1``; :func:`stats` counts buffers,
bytes and messages staged.

Design notes: docs/design/ground.md"""

from __future__ import annotations

import contextlib
import os
import threading

import torch
import torch.distributed as dist

__all__ = ["isend", "irecv", "needs_staging", "forced", "stats", "reset", "StagingPool"]

_MIN_BYTES = 4096  # smallest buffer: small messages (headers, sizes) share one size class


class StagingPool:
    """Free CPU byte buffers, pinned and pageable apart; lend the smallest that fits, else allocate
    the next power of two (dropping the largest too-small free one)."""

    def __init__(self):
        self._free = {True: [], False: []}
        self._lock = threading.Lock()  # a DDP communication thread stages too
        self.allocations = 0
        self.bytes_allocated = 0
        self.staged_sends = 0
        self.staged_recvs = 0

    def acquire(self, nbytes: int, pin: bool) -> torch.Tensor:
        """A 1-D uint8 CPU buffer of at least ``nbytes`` bytes (pinned if ``pin``)."""
        with self._lock:
            free = self._free[pin]
            fits = [b for b in free if b.numel() >= nbytes]
            if fits:
                buf = min(fits, key=torch.Tensor.numel)
                _remove(free, buf)
                return buf
            if free:  # it will be replaced by the bigger buffer allocated below
                _remove(free, max(free, key=torch.Tensor.numel))
            cap = max(_MIN_BYTES, 1 << max(0, nbytes - 1).bit_length())
            self.allocations += 1
            self.bytes_allocated += cap
        return torch.empty(cap, dtype=torch.uint8, pin_memory=pin)

    def release(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free[buf.is_pinned()].append(buf)

    def held(self) -> int:
        """Free buffers in the pool now (pinned + pageable)."""
        with self._lock:
            return len(self._free[True]) + len(self._free[False])


def _remove(buffers: list, buf: torch.Tensor) -> None:
    """``list.remove`` by identity (``==`` on tensors compares elements)."""
    del buffers[next(i for i, b in enumerate(buffers) if b is buf)]


_pool = StagingPool()
_force = threading.local()


_env_forced: dict = {}  # pid -> MINIDIST_FORCE_STAGING as first read there (reset() rereads)


@contextlib.contextmanager
def forced(enabled: bool = True):
    """Stage every message in the block, CPU tensors included (tests the path without a GPU)."""
    before = getattr(_force, "on", None)
    _force.on = enabled
    try:
        yield
    finally:
        _force.on = before


def _forced() -> bool:
    on = getattr(_force, "on", None)
    if on is not None:
        return on
    pid = os.getpid()    # per process: a forked rank reads the variable it was started with
    on = _env_forced.get(pid)
    if on is None:       # every message asks: read the variable once per process, not per message
        on = _env_forced[pid] = os.environ.get("MINIDIST_FORCE_STAGING", "") not in ("", "0")
    return on


def needs_staging(tensor: torch.Tensor, group=None) -> bool:
    """True when ``tensor`` must go through a CPU buffer (not CPU, not NCCL, or :func:`forced`)."""
    if tensor.device.type == "cpu":
        return _forced()
    return _forced() or dist.get_backend(group) != "nccl"


def _byte_view(buf: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """``buf``'s first bytes seen as a flat tensor of ``tensor``'s dtype and element count."""
    nbytes = tensor.numel() * tensor.element_size()
    return buf[:nbytes].view(tensor.dtype)


class _StagedWork:
    """A staged message's Work: on completion the buffer is copied in and returned to the pool."""

    def __init__(self, work, buf, target=None):
        self._work, self._buf, self._target = work, buf, target

    def _finish(self) -> None:
        if self._target is not None:
            self._target.view(-1).copy_(_byte_view(self._buf, self._target))
        _pool.release(self._buf)
        self._work = self._buf = self._target = None

    def wait(self, timeout=None):
        if self._work is not None:
            if timeout is None:
                self._work.wait()
            else:
                self._work.wait(timeout)
            self._finish()
        return True

    def is_completed(self) -> bool:
        if self._work is not None and self._work.is_completed():
            self.wait()
        return self._work is None


def _post(kind: str, tensor: torch.Tensor, peer: int, group, tag: int):
    """``group.send``/``group.recv`` of one tensor to/from group rank ``peer`` (p2p has checked it)."""
    pg = group if group is not None else dist.GroupMember.WORLD
    if pg is None:
        raise RuntimeError(f"{kind}: the default process group is not initialised; run inside "
                           "minidist.run(...) or call minidist.init() first")
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    return pg.send([tensor], peer, tag) if kind == "send" else pg.recv([tensor], peer, tag)


def isend(tensor: torch.Tensor, dst: int, group=None, tag: int = 0):
    """Non-blocking send to group rank ``dst``, through a CPU buffer when needed."""
    if not needs_staging(tensor, group):
        return _post("send", tensor, dst, group, tag)
    buf = _pool.acquire(tensor.numel() * tensor.element_size(), pin=tensor.is_cuda)
    view = _byte_view(buf, tensor)
    view.copy_(tensor.reshape(-1))
    _pool.staged_sends += 1
    return _StagedWork(_post("send", view, dst, group, tag), buf)


def irecv(tensor: torch.Tensor, src: int, group=None, tag: int = 0):
    """Non-blocking receive into ``tensor``, through a CPU buffer if needed (filled at ``wait``)."""
    if not needs_staging(tensor, group):
        return _post("recv", tensor, src, group, tag)
    buf = _pool.acquire(tensor.numel() * tensor.element_size(), pin=tensor.is_cuda)
    _pool.staged_recvs += 1
    return _StagedWork(_post("recv", _byte_view(buf, tensor), src, group, tag), buf, tensor)


def stats() -> dict:
    """This process's staging counters (allocations, bytes, staged sends/recvs, free buffers)."""
    return dict(allocations=_pool.allocations, bytes_allocated=_pool.bytes_allocated,
                staged_sends=_pool.staged_sends, staged_recvs=_pool.staged_recvs,
                free_buffers=_pool.held())


def reset() -> None:
    """Drop every pooled buffer and zero the counters (tests)."""
    global _pool
    _pool = StagingPool()
    _env_forced.clear()
