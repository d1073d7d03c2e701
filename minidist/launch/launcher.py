"""``minidist.run``: start ranks from a notebook cell or a script, and bring results or failures back.

Functions defined in a notebook cell work (cloudpickled by value). Ranks rendezvous through a file
store in a private folder, gloo pinned to loopback: nothing reachable from the network, no two
launches meet. Fork when safe (gloo, CUDA not initialised), else spawn. Results come back as
pickled bytes, drained while waiting. If a rank raises or dies the others are stopped and one
:class:`RankError` names the root cause; every run has a timeout (:class:`RankTimeoutError` shows
where each rank waited). Output is prefixed ``[rank r]`` (``ordered_output=True``: grouped by
rank). No process is left behind, on any error path.

Design notes: docs/design/ground.md"""

from __future__ import annotations

import os
import queue as queue_mod
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import warnings

import cloudpickle
import torch
import torch.multiprocessing as mp

from .. import env as _env
from . import rank_process
from .errors import (RankError, RankTimeoutError, StartupFailure, failure,
                            is_startup_failure, stack_of, timeout_error)
from . import errors as _errors

__all__ = ["run", "RankError", "RankTimeoutError"]

_GRACE_S = 1.0  # after the first failure: how long to wait for the other ranks' own errors
_SAMPLE_S = 0.1  # how often the launcher samples each rank's resident size (for a SIGKILL report)


def run(fn, world_size: int, *args, backend: str = "auto", timeout: float = 60.0,
        ordered_output: bool = False, start_method: str | None = None, device: str | None = None,
        memory_fraction: float | None = None) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks and return the results by rank.

    ``fn``: picklable by value; ``backend``: ``"auto"``, ``"gloo"``, ``"nccl"``; ``timeout``: seconds
    for the whole run; ``ordered_output``: output grouped by rank at the end; ``device``: None, ``"cpu"``
    or ``"cuda"`` (ranks may share a GPU, each with ``memory_fraction``: :func:`minidist.env.plan_devices`).
    Returns ``[result of rank 0, ...]`` (tensors on the CPU). Raises RankError (root cause first),
    RankTimeoutError, ValueError (bad arguments).
    """
    __tracebackhide__ = True  # IPython: the learner's traceback starts at the report, not here
    if not callable(fn):
        raise TypeError(f"minidist.run: fn must be callable, got {type(fn).__name__}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"minidist.run: world_size must be an int >= 1, got {world_size!r}")
    if device in (None, "auto"):
        backend = _env.choose_backend(backend, local_world_size=world_size)
        device = "cuda" if backend == "nccl" else "cpu"
    else:  # device_count() leaves torch's CUDA state uninitialised here (is_initialized() False)
        backend = _env.plan_devices(device, backend, world_size, torch.cuda.device_count(),
                                    torch.distributed.is_nccl_available()).backend
    method = _choose_start_method(backend, start_method, device)
    for attempt in range(1, _errors.START_ATTEMPTS + 1):
        try:
            return _launch(fn, world_size, args, backend, timeout, ordered_output, method,
                           (device, memory_fraction))
        except StartupFailure as e:
            error = e.error
            if attempt < _errors.START_ATTEMPTS:
                _errors.log_restart(e, attempt)
        except RankError as e:
            error = e
            break
    # raised here with no inner frames: IPython (which always shows the innermost frame) shows
    # the learner's cell and this one line, then the report
    raise error.with_traceback(None) from None


def _choose_start_method(backend: str, start_method: str | None, device: str | None = None) -> str:
    """Fork only for gloo CPU ranks in a parent without CUDA initialised; else spawn."""
    if start_method is not None:
        return start_method
    fork_ok = "fork" in mp.get_all_start_methods() and backend == "gloo" and device != "cuda"
    return "fork" if fork_ok and not torch.cuda.is_initialized() else "spawn"


def _kill(procs) -> None:
    """Stop every rank and whatever it started (each rank leads its own process group)."""
    for p in procs:
        if p.is_alive():
            _signal_group(p, signal.SIGTERM)
    end = time.monotonic() + 1.0
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
        if p.is_alive():
            _signal_group(p, signal.SIGKILL)
            p.join(1.0)
        _signal_group(p, signal.SIGKILL)  # a rank's own children (data loader workers) too


def _signal_group(p, sig) -> None:
    try:
        os.killpg(p.pid, sig)  # the rank called setpgrp(): its pid is its group's id
    except (OSError, TypeError):
        try:
            os.kill(p.pid, sig)
        except (OSError, TypeError):
            pass


def _launch(fn, world_size, args, backend, timeout, ordered_output, method, placement=(None, None)):
    __tracebackhide__ = True
    ctx = mp.get_context(method)
    if method == "fork":
        # The first optimizer a process builds imports torch._dynamo (2-3 s); import it once here
        # so that W forked ranks do not each pay it on 2 cores.
        _import_whole("torch._dynamo")
    # a forked child already has fn in memory (real tracebacks, no pickling); spawn needs bytes
    payload = (fn, args) if method == "fork" else cloudpickle.dumps((fn, args))
    tmp = tempfile.mkdtemp(prefix="minidist-run-")  # mode 0700: this user only
    q = ctx.Queue()
    shms = [ctx.Array("c", 256, lock=False) for _ in range(world_size)]
    dumps = [os.path.join(tmp, f"stack-{r}.txt") for r in range(world_size)]
    out = _Output(ordered_output)
    procs = []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork of a threaded parent
            for r in range(world_size):
                # not daemonic: a rank may start processes of its own (DataLoader workers)
                p = ctx.Process(target=rank_process.main, daemon=False, name=f"minidist-rank-{r}",
                                args=(r, world_size, payload, tmp, backend, timeout + 30,
                                      q, shms[r], dumps[r], *placement))
                p.start()
                procs.append(p)
        return _supervise(procs, q, out, shms, dumps, timeout, world_size)
    finally:
        _without_interrupts(_clean_up, procs, out, q, tmp)


def _clean_up(procs, out, q, tmp) -> None:
    _kill(procs)
    out.finish()
    q.close()
    if not os.environ.get("MINIDIST_KEEP_TMP"):
        shutil.rmtree(tmp, ignore_errors=True)


def _without_interrupts(fn, *args) -> None:
    """Run ``fn`` with Ctrl-C held back (raised afterwards), so stopping the ranks always finishes."""
    if threading.current_thread() is not threading.main_thread():
        fn(*args)
        return
    held = []
    previous = signal.signal(signal.SIGINT, lambda *_: held.append(True))
    try:
        fn(*args)
    finally:
        signal.signal(signal.SIGINT, previous)
    if held and not sys.exc_info()[0]:
        raise KeyboardInterrupt


def _import_whole(name: str) -> None:
    """``import name``; if interrupted half-way, forget the modules it added (no half packages)."""
    if name in sys.modules:
        return
    before = set(sys.modules)
    try:
        __import__(name)
    except BaseException:
        for added in set(sys.modules) - before:
            sys.modules.pop(added, None)
        raise


def _supervise(procs, q, out, shms, dumps, timeout, world_size):
    __tracebackhide__ = True
    deadline = time.monotonic() + timeout
    oom_at_start = _errors.oom_kill_count()   # a SIGKILL with this count risen: out of memory
    resident: dict = {}                        # rank -> last resident size (bytes), sampled
    sampled_at = 0.0
    results, have = [None] * world_size, set()
    errors = {}  # rank -> (time, summary, traceback)
    returned = {}  # rank -> (time, collectives it finished) for ranks that returned a result
    progress = {}  # rank -> (collectives finished, what it was doing) for ranks that raised
    exited = {}  # rank -> (time, exitcode) for ranks seen dead without a result
    first_failure = None
    while len(have) < world_size:
        now = time.monotonic()
        if first_failure is not None and (now - first_failure > _GRACE_S
                                          or len(have) + len(errors) == world_size):
            break  # everyone has reported (or the grace period is over): no need to wait longer
        if first_failure is None and now > deadline:
            raise _timeout(procs, shms, dumps, timeout, have)
        try:
            msg = q.get(timeout=0.05)
        except queue_mod.Empty:
            msg = None
        if msg is not None:
            kind, rank = msg[0], msg[1]
            if kind == "out":
                out.add(rank, msg[2], msg[3])
            elif kind == "result":
                results[rank] = cloudpickle.loads(msg[2])
                have.add(rank)
                returned[rank] = (time.monotonic(), msg[3])
            elif kind == "error":
                errors[rank] = (time.monotonic(), msg[2], msg[3])
                progress[rank] = msg[4]
                first_failure = first_failure or time.monotonic()
            continue  # drain everything queued before looking at exit codes
        if now - sampled_at > _SAMPLE_S:   # for the report of a rank SIGKILLed without a trace
            sampled_at = now
            for r, p in enumerate(procs):
                if r not in have and r not in exited:
                    size = _errors.resident_bytes(p.pid)
                    if size is not None:
                        resident[r] = size
        for r, p in enumerate(procs):
            if r not in have and r not in errors and r not in exited and p.exitcode is not None:
                exited[r] = (time.monotonic(), p.exitcode)
        # a dead rank's last messages may still be in the pipe: give them a moment
        for r, (t, code) in exited.items():
            if r not in errors and r not in have and time.monotonic() - t > 0.3:
                first_failure = first_failure or t
    if len(have) == world_size:
        return results
    oom_now = _errors.oom_kill_count()
    oom_killed = None if None in (oom_at_start, oom_now) else max(0, oom_now - oom_at_start)
    error = failure(world_size, errors, exited, have, oom_killed=oom_killed, resident=resident,
                    returned=returned, progress=progress)
    if is_startup_failure(error, started=any(shm.raw.split(b"\0", 1)[0] for shm in shms)):
        raise StartupFailure(error)
    raise error


def _timeout(procs, shms, dumps, timeout, have) -> RankTimeoutError:
    """Ask every live rank for its stack (SIGUSR1 -> faulthandler), then build the report."""
    live = [r for r, p in enumerate(procs) if p.is_alive() and r not in have]
    for r in live:
        try:
            os.kill(procs[r].pid, signal.SIGUSR1)
        except OSError:
            pass
    time.sleep(0.5)
    states = {r: shms[r].raw.split(b"\0", 1)[0].decode("utf-8", "replace") for r in live}
    stacks = {r: stack_of(dumps[r]) for r in live}
    return timeout_error(timeout, len(procs), states, stacks, have)


class _Output:
    """Prefixes each line a rank prints with ``[rank r]``; live, or grouped by rank at the end."""

    def __init__(self, ordered: bool):
        self.ordered = ordered
        self.held: list = []
        self.at_line_start: dict = {}

    def add(self, rank: int, stream: str, text: str) -> None:
        if self.ordered:
            self.held.append((rank, stream, text))
        else:
            self._emit(rank, stream, text)

    def _emit(self, rank, stream, text):
        out = sys.stdout if stream == "stdout" else sys.stderr
        start = self.at_line_start.get((rank, stream), True)
        pieces = re.split(r"([\r\n])", text)
        buf = []
        for piece in pieces:
            if piece in ("\n", "\r"):
                buf.append(piece)
                start = True
            elif piece:
                buf.append((f"[rank {rank}] " if start else "") + piece)
                start = False
        self.at_line_start[(rank, stream)] = start
        out.write("".join(buf))
        out.flush()

    def finish(self) -> None:
        for rank in sorted({r for r, _, _ in self.held}):
            for r, stream, text in self.held:
                if r == rank:
                    self._emit(r, stream, text)
            for stream in ("stdout", "stderr"):
                if not self.at_line_start.get((rank, stream), True):
                    self._emit(rank, stream, "\n")
        self.held.clear()
