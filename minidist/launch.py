"""``minidist.run``: start ranks from a notebook cell or a script, and bring results or failures back.

What the launcher guarantees (each point is a real trap; see docs/ARCHITECTURE.md):

* Functions defined in a notebook cell work: ``fn`` and its arguments travel pickled by value
  (cloudpickle), so a spawned child never has to import the kernel's ``__main__``.
* A free port every time: rank 0 binds its ``TCPStore`` on port 0 and keeps it for the whole run,
  so two launches at the same moment cannot collide, and nothing needs 29500 to be free.
* Fork when it is safe (gloo, CUDA not initialised in the parent): 4 ranks start in well under a
  second. Otherwise a spawn context created here (never the global start method).
* Each child sets one intra-op thread before anything else (see ``rank_process.py``, the code
  that runs inside each rank).
* Results travel as cloudpickled bytes (never shared-memory tensor handles that die with the child),
  and the parent drains the queue while it waits, so large results cannot deadlock.
* If a rank raises or dies, the others are stopped within seconds and one :class:`RankError` shows
  the root-cause rank first — not another rank's secondary "connection closed by peer".
* Every run has a timeout. When it fires, :class:`RankTimeoutError` says, per rank still running,
  the minidist op it was in (op, peer, bytes, sequence number) and the Python line it was stuck on.
* What ranks print appears in the caller's output prefixed with ``[rank r]``; with
  ``ordered_output=True`` it is shown grouped by rank after the run (deterministic, for nbval).
* No process is left behind: children die with the parent (PR_SET_PDEATHSIG on Linux) and are
  killed on every error path, including KeyboardInterrupt.
"""

from __future__ import annotations

import logging
import os
import queue as queue_mod
import re
import shutil
import signal
import sys
import tempfile
import time
import warnings

import cloudpickle
import torch
import torch.multiprocessing as mp

from . import env as _env, rank_process

__all__ = ["run", "RankError", "RankTimeoutError"]

_SECONDARY = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|ECONNRESET|Socket closed|"
    r"Connection refused|connection was closed|stopped by the launcher|Read error|Timed out waiting",
    re.IGNORECASE)
_log = logging.getLogger("minidist")
_START_ATTEMPTS = 3  # gloo's connect can fail under load before any user code ran: safe to redo
_GRACE_S = 1.0  # after the first failure: how long to wait for the other ranks' own errors


class RankError(RuntimeError):
    """One or more ranks failed. ``failures`` lists (rank, summary, details), root cause first."""

    def __init__(self, message: str, failures: list[tuple[int, str, str]]):
        super().__init__(message)
        self.failures = failures

    @property
    def rank(self) -> int:
        """The rank whose failure is reported as the root cause."""
        return self.failures[0][0]


class RankTimeoutError(RankError, TimeoutError):
    """The run did not finish within ``timeout`` seconds; the message says where each rank waited."""


# --------------------------------------------------------------------------- parent side
class _Output:
    """Prefixes each line a rank prints with ``[rank r]``; live, or grouped by rank at the end."""

    def __init__(self, ordered: bool):
        self.ordered, self.held, self.at_line_start = ordered, [], {}

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


def _choose_start_method(backend: str, start_method: str | None) -> str:
    if start_method is not None:
        return start_method
    fork_ok = "fork" in mp.get_all_start_methods() and backend == "gloo"
    cuda_started = torch.cuda.is_available() and torch.cuda.is_initialized() if fork_ok else True
    return "fork" if fork_ok and not cuda_started else "spawn"


def _stack_of(dump_path: str) -> str:
    """The user-visible part of a faulthandler dump (innermost call first, launcher frames cut)."""
    try:
        with open(dump_path) as f:
            text = f.read()
    except OSError:
        return "    (no stack)"
    head, _, text = text.partition("\n")
    main = head.rsplit(" ", 1)[-1]
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", text)
    block = next((b for b in blocks if b.split("(", 1)[0].strip().endswith(main)), text)
    lines = [ln.rstrip() for ln in block.splitlines() if ln.strip().startswith("File")]
    keep = []
    for ln in lines:
        if "minidist/rank_process.py" in ln or "multiprocessing/" in ln:
            break
        keep.append("    " + ln.strip())
    return "\n".join(keep[:12]) or "    (no Python frames)"


def _kill(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    end = time.monotonic() + 1.0
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(1.0)


def run(fn, world_size: int, *args, backend: str = "auto", timeout: float = 60.0,
        ordered_output: bool = False, start_method: str | None = None) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks and return the results by rank.

    Args:
        fn: any picklable-by-value callable (functions defined in a notebook cell work).
        world_size: number of ranks, >= 1 (all on this machine).
        backend: ``"auto"`` (nccl when every rank can have its own GPU, else gloo), ``"gloo"``
            or ``"nccl"``; see :func:`minidist.env.choose_backend`.
        timeout: seconds for the whole run, start-up included.
        ordered_output: hold what ranks print and show it grouped by rank at the end.
        start_method: ``"fork"``/``"spawn"``/``"forkserver"``; default: fork when safe, else spawn.

    Returns:
        ``[result of rank 0, result of rank 1, ...]``; tensors come back on the CPU.

    Raises:
        RankError: a rank raised or died; the root-cause rank's traceback comes first.
        RankTimeoutError: the run exceeded ``timeout``; says where every live rank was waiting.
        ValueError: bad arguments (world size, backend).
    """
    if not callable(fn):
        raise TypeError(f"minidist.run: fn must be callable, got {type(fn).__name__}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"minidist.run: world_size must be an int >= 1, got {world_size!r}")
    backend = _env.choose_backend(backend, local_world_size=world_size)
    method = _choose_start_method(backend, start_method)
    for attempt in range(1, _START_ATTEMPTS + 1):
        try:
            return _launch(fn, world_size, args, backend, timeout, ordered_output, method)
        except _StartupFailure as e:
            if attempt == _START_ATTEMPTS:
                raise e.error from None
            # logged, not printed: a recovered start must not change a notebook's output
            _log.info("minidist.run: the ranks could not connect (%s); starting again (attempt "
                      "%d of %d)", e.error.failures[0][1][:80], attempt + 1, _START_ATTEMPTS)


class _StartupFailure(Exception):
    """gloo failed to connect before any rank ran user code: safe to start again (no side effects)."""

    def __init__(self, error: RankError):
        super().__init__(str(error))
        self.error = error


def _launch(fn, world_size, args, backend, timeout, ordered_output, method):
    ctx = mp.get_context(method)
    if method == "fork":
        # The first optimizer a process builds imports torch._dynamo (2-3 s); import it once here
        # so that W forked ranks do not each pay it on 2 cores.
        import torch._dynamo  # noqa: F401
    # a forked child already has fn in memory (real tracebacks, no pickling); spawn needs bytes
    payload = (fn, args) if method == "fork" else cloudpickle.dumps((fn, args))
    rendezvous = (ctx.Value("i", 0, lock=False), ctx.Event())
    tmp = tempfile.mkdtemp(prefix="minidist-run-")
    q = ctx.Queue()
    shms = [ctx.Array("c", 256, lock=False) for _ in range(world_size)]
    dumps = [os.path.join(tmp, f"stack-{r}.txt") for r in range(world_size)]
    out = _Output(ordered_output)
    procs = []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork of a threaded parent
            for r in range(world_size):
                p = ctx.Process(target=rank_process.main, daemon=True, name=f"minidist-rank-{r}",
                                args=(r, world_size, payload, rendezvous, backend, timeout + 30,
                                      q, shms[r], dumps[r]))
                p.start()
                procs.append(p)
        return _supervise(procs, q, out, shms, dumps, timeout, world_size)
    finally:
        _kill(procs)
        out.finish()
        q.close()
        os.environ.get("MINIDIST_KEEP_TMP") or shutil.rmtree(tmp, ignore_errors=True)


def _supervise(procs, q, out, shms, dumps, timeout, world_size):
    deadline = time.monotonic() + timeout
    results, have = [None] * world_size, set()
    errors = {}  # rank -> (time, summary, traceback)
    exited = {}  # rank -> (time, exitcode) for ranks seen dead without a result
    first_failure = None
    while len(have) < world_size:
        now = time.monotonic()
        if first_failure is not None and (now - first_failure > _GRACE_S
                                          or len(have) + len(errors) == world_size):
            break  # everyone has reported (or the grace period is over): no need to wait longer
        if first_failure is None and now > deadline:
            _timeout(procs, shms, dumps, timeout, have)
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
            elif kind == "error":
                errors[rank] = (time.monotonic(), msg[2], msg[3])
                first_failure = first_failure or time.monotonic()
            continue  # drain everything queued before looking at exit codes
        for r, p in enumerate(procs):
            if r not in have and r not in errors and r not in exited and p.exitcode is not None:
                exited[r] = (time.monotonic(), p.exitcode)
        # a dead rank's last messages may still be in the pipe: give them a moment
        for r, (t, code) in exited.items():
            if r not in errors and r not in have and time.monotonic() - t > 0.3:
                first_failure = first_failure or t
    if len(have) == world_size:
        return results
    error = _failure(procs, errors, exited, have)
    started = any(shm.raw.split(b"\0", 1)[0] for shm in shms)
    if not started and any(_SECONDARY.search(s) for _, s, _ in error.failures):
        raise _StartupFailure(error)
    raise error


def _describe_exit(code: int) -> str:
    if code < 0:
        name = signal.Signals(-code).name
        hint = " (SIGABRT from gloo often means ranks disagreed on a tensor's size: rerun with " \
               "MINIDIST_DEBUG=1)" if name == "SIGABRT" else ""
        return f"killed by {name}{hint}"
    return f"exited with code {code} without raising (os._exit or a crash in C code)"


def _failure(procs, errors, exited, have) -> RankError:
    events = []  # (secondary?, time, rank, summary, details)
    for r, (t, summary, tb) in errors.items():
        events.append((bool(_SECONDARY.search(summary)), t, r, summary, tb))
    for r, (t, code) in exited.items():
        if r not in errors:
            events.append((False, t, r, f"rank {r} {_describe_exit(code)}", ""))
    events.sort(key=lambda e: (e[0], e[1]))
    failures = [(r, s, d) for _, _, r, s, d in events]
    secondary = {r for sec, _, r, _, _ in events if sec}
    stopped = [r for r in range(len(procs)) if r not in have and r not in errors and r not in exited]
    root_rank, root_summary, root_tb = failures[0]
    lines = [f"rank {root_rank} failed: {root_summary}", "",
             f"--- rank {root_rank} (root cause) ---", root_tb.rstrip() or root_summary]
    for r, s, d in failures[1:]:
        why = "probably a consequence" if r in secondary else "also failed"
        lines += ["", f"--- rank {r} ({why}) ---", s]
    if stopped:
        lines += ["", f"ranks {stopped} were stopped by the launcher after rank {root_rank} failed."]
    return RankError("\n".join(lines), failures)


def _timeout(procs, shms, dumps, timeout, have):
    live = [r for r, p in enumerate(procs) if p.is_alive() and r not in have]
    for r in live:
        try:
            os.kill(procs[r].pid, signal.SIGUSR1)
        except OSError:
            pass
    time.sleep(0.5)
    lines = [f"minidist.run timed out after {timeout:g} s; {len(live)} of {len(procs)} ranks were "
             "still running (a deadlock, or a rank that never joined a collective).", ""]
    failures = []
    for r in live:
        state = shms[r].raw.split(b"\0", 1)[0].decode("utf-8", "replace") or "starting up"
        lines += [f"rank {r}: {state}", "  where (innermost call first):", _stack_of(dumps[r])]
        failures.append((r, state, _stack_of(dumps[r])))
    lines += ["", "Fix: make every send meet a matching recv (post isend/irecv pairs, or order "
              "even/odd ranks), and make every rank call the same collectives in the same order."]
    raise RankTimeoutError("\n".join(lines), failures or [(-1, "timeout", "")])
