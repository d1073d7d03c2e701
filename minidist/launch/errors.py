"""How :func:`minidist.run` reports failures: the root-cause rank first, timeouts per rank.

:class:`RankError`: ranks raised or died; the rank that failed first on its own comes first, a
rank whose peer merely went away after it ("probably a consequence"). :class:`RankTimeoutError`:
for every rank still running, the minidist op it was in (:mod:`minidist.comm.p2p`) and the
Python lines it was stuck on, the learner's own first, paths relative to the project or as the
notebook cell. :data:`START_ATTEMPTS`: how often a launch whose ranks failed to connect is started.

Design notes: docs/design/ground.md"""

from __future__ import annotations

import logging
import os
import re
import signal
import sys

from . import cgroups as _cgroups

__all__ = ["RankError", "RankTimeoutError", "START_ATTEMPTS", "StartupFailure", "failure",
           "timeout_error", "is_startup_failure", "log_restart", "describe_exit", "memory_hint",
           "resident_bytes", "memory_limit", "oom_kill_count", "oom_cgroup", "oom_advice", "stack_of",
           "format_stack", "short_path", "tidy_traceback"]

# A failure before any user code ran, while the ranks were still connecting, has no side effects,
# so the launcher *could* start again; START_ATTEMPTS > 1 does that. It is 1 (no retry): the
# failure the retry was added for ("Gloo connectFullMesh failed ... Connection closed by peer"
# with several launches at once) was a rank leaving while another was still connecting. The
# retry never fired for it (the leaving rank had already run user code: 0 retries in 30 launches
# that failed 2 times, tools/concurrent_launches.py), and the barrier in rank_process.py removes
# it. Kept as a switch so a measurement can turn it on.
START_ATTEMPTS = 1

SECONDARY = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|ECONNRESET|Socket closed|"
    r"Connection refused|connection was closed|stopped by the launcher|Read error|Timed out waiting",
    re.IGNORECASE)


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


class StartupFailure(Exception):
    """The ranks failed to connect before any of them ran user code: safe to start again."""

    def __init__(self, error: RankError):
        super().__init__(str(error))
        self.error = error


def is_startup_failure(error: RankError, started: bool) -> bool:
    """True when no rank reached user code and a rank's error is a connection error."""
    return not started and any(SECONDARY.search(s) for _, s, _ in error.failures)


def log_restart(failure: StartupFailure, attempt: int) -> None:
    """Logged, not printed: a recovered start must not change a notebook's output."""
    logging.getLogger("minidist").info(
        "minidist.run: the ranks could not connect (%s); starting again (attempt %d of %d)",
        failure.error.failures[0][1][:200], attempt + 1, START_ATTEMPTS)


# --------------------------------------------------------------------------- paths
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout (or site-packages)
_CELL = re.compile(r"/tmp/ipykernel_\d+/(\d+)\.py|<ipython-input-(\d+)-[0-9a-f]+>")


def short_path(path: str) -> str:
    """``path`` as a learner sees it: project-relative, ``Cell In[n]``, or below site-packages."""
    cell = _cell_name(path)
    if cell:
        return cell
    for base in (os.getcwd(), _ROOT):
        if path.startswith(base + os.sep):
            return os.path.relpath(path, base)
    for marker in ("site-packages" + os.sep, "dist-packages" + os.sep, "lib" + os.sep + "python"):
        if marker in path:
            tail = path.split(marker, 1)[1]
            return tail.split(os.sep, 1)[1] if marker.startswith("lib") and os.sep in tail else tail
    return os.path.basename(path) if os.path.isabs(path) else path


def _cell_name(path: str) -> str | None:
    if not _CELL.search(path):
        return None
    try:  # IPython maps its temporary cell files to execution counts: "Cell In[12]"
        ip = sys.modules["IPython"].get_ipython() if "IPython" in sys.modules else None
        compiler = getattr(ip, "compile", None)
        number = getattr(compiler, "_filename_map", {}).get(path)
        if number is not None:
            return f"Cell In[{number}]"
    except Exception:  # noqa: BLE001 - naming a cell must never hide the report
        pass
    return "<notebook cell>"


_TB_FILE = re.compile(r'File "([^"]+)"')


def tidy_traceback(tb: str) -> str:
    """A rank's traceback with the launcher's entry frame cut and every path shortened."""
    lines = tb.rstrip().splitlines()
    out, skip = [], False
    for ln in lines:
        if ln.startswith("  File ") and ln.rstrip().endswith(", in main") and "rank_process.py" in ln:
            skip = True  # the launcher's frame and its source lines
            continue
        if skip and ln.startswith("    "):
            continue
        skip = False
        out.append(_TB_FILE.sub(lambda m: f'File "{short_path(m[1])}"', ln))
    return "\n".join(out)


# --------------------------------------------------------------------------- failures
def oom_kill_count() -> int | None:
    """OOM kills counted in this process's memory cgroup (:mod:`.cgroups`); None if unreadable."""
    group = _cgroups.memory_cgroup()
    return None if group is None else group.oom_kills()


def oom_cgroup() -> str:
    """The memory cgroup whose counter :func:`oom_kill_count` reads, for the report."""
    group = _cgroups.memory_cgroup()
    return "?" if group is None else f"{group.path or '/'} (cgroup v{group.version})"


TRY_FOR_MEMORY = ("Try a smaller batch or model, fewer ranks on this machine, activation "
                  "recomputation, or sharding (ZeRO-2/3, fully_shard); `minidist plan` estimates "
                  "the memory per rank")


def oom_advice(kills: int | None = None) -> str:
    """What a SIGKILL says when the OOM killer's count rose (by ``kills``) during the run."""
    rose = "rose" if kills is None else f"rose by {kills}"
    return (f"out of memory: the kernel's OOM killer ended it (the oom_kill count of cgroup "
            f"{oom_cgroup()} {rose} during the run). " + TRY_FOR_MEMORY)


def resident_bytes(pid: int) -> int | None:
    """A live process's ``VmRSS`` in bytes; None when unreadable."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def memory_limit() -> tuple[int, str] | None:
    """(bytes, what) the ranks share: the cgroup's limit, else ``MemTotal``; or None."""
    group = _cgroups.memory_cgroup()
    limit = None if group is None else group.limit()
    if limit is not None:
        return limit, "this cgroup's memory limit"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024, "this machine's memory"
    except (OSError, ValueError, IndexError):
        pass
    return None


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def memory_hint(resident: int | None) -> str:
    """A SIGKILL's hint without the OOM counter: the rank's last resident size against the limit."""
    size = "not sampled" if resident is None else _gib(resident)
    limit = memory_limit()
    share = ""
    if resident is not None and limit:
        share = f", {100 * resident / limit[0]:.0f} % of {_gib(limit[0])} ({limit[1]})"
    return (f": maybe out of memory (this machine's OOM-kill counter is unreadable, so the kernel "
            f"cannot confirm it); its last resident size, sampled by the launcher, was {size}"
            f"{share}. If nobody sent the SIGKILL, the OOM killer is the usual sender. "
            + TRY_FOR_MEMORY)


def describe_exit(code: int, oom_killed: int | bool | None = False, resident: int | None = None) -> str:
    """What a rank's exit code says: a signal's name with a hint (SIGABRT; SIGKILL by the OOM killer,
    known or possible, with the rank's last ``resident`` bytes) or os._exit."""
    if code < 0:
        name = signal.Signals(-code).name
        hint = (" (SIGABRT from gloo often means a message and its receive buffer differ in "
                "size: ranks sent or received different chunks, or tensors of different shapes; "
                "MINIDIST_DEBUG=1 checks the arguments of minidist's collectives, not your own "
                "send/recv)") if name == "SIGABRT" else ""
        if name == "SIGKILL" and oom_killed:
            hint = ": " + oom_advice(None if oom_killed is True else int(oom_killed))
        elif name == "SIGKILL" and oom_killed is None:
            hint = memory_hint(resident)
        return f"killed by {name}{hint}"
    return f"exited with code {code} without raising (os._exit or a crash in C code)"


def failure(world_size: int, errors: dict, exited: dict, have: set,
            oom_killed: int | bool | None = False, resident: dict | None = None,
            returned: dict | None = None, progress: dict | None = None) -> RankError:
    """One :class:`RankError` from what the ranks reported (``{rank: ...}`` dicts of errors, exits,
    results, resident bytes, progress), the root cause first: a rank that returned while the others
    lost their connections in a collective it never joined (uneven inputs) counts as the cause.
    """
    events = []  # (secondary?, time, rank, summary, details)
    for r, (t, summary, tb) in errors.items():
        events.append((bool(SECONDARY.search(summary)), t, r, summary, tb))
    for r, (t, code) in exited.items():
        if r not in errors:
            events.append((False, t, r, f"rank {r} {describe_exit(code, oom_killed, (resident or {}).get(r))}", ""))
    events.sort(key=lambda e: (e[0], e[1]))
    early = _returned_early(events, returned or {}, progress or {})
    if early is not None:
        return early
    failures = [(r, s, d) for _, _, r, s, d in events]
    secondary = {r for sec, _, r, _, _ in events if sec}
    stopped = [r for r in range(world_size) if r not in have and r not in errors and r not in exited]
    root_rank, root_summary, root_tb = failures[0]
    lines = [f"rank {root_rank} failed: {root_summary}", "",
             f"--- rank {root_rank} (root cause) ---", tidy_traceback(root_tb) or root_summary]
    for r, s, d in failures[1:]:
        why = "probably a consequence" if r in secondary else "also failed"
        lines += ["", f"--- rank {r} ({why}) ---", s]
    if stopped:
        lines += ["", f"ranks {stopped} were stopped by the launcher after rank {root_rank} failed."]
    return RankError("\n".join(lines), failures)


def _returned_early(events: list, returned: dict, progress: dict) -> RankError | None:
    """The uneven-inputs report (see :func:`failure`), or None when it does not apply."""
    if not events or not returned or not all(sec for sec, *_ in events):
        return None
    first = min(t for _, t, *_ in events)
    early = sorted(r for r, (t, _) in returned.items() if t <= first)
    if not early:
        return None
    done = {r: returned[r][1] for r in early}
    lines = [f"rank{'s' if len(early) > 1 else ''} {', '.join(map(str, early))} returned from "
             f"the function after {', '.join(str(done[r]) for r in early)} collective(s), while "
             "other ranks were still in a collective they never joined (uneven inputs: one rank "
             "ran fewer steps or batches than the others):"]
    for _, _, r, summary, _ in events:
        n, doing = progress.get(r, (None, "unknown"))
        count = f"had finished {n} collective(s) and " if n is not None else ""
        lines.append(f"  rank {r} {count}was in: {doing}")
    lines += ["", "Every rank must run the same collectives in the same order: give every rank "
              "the same number of batches (DistributedSampler(drop_last=True), or pad the last "
              "one), or stop all ranks together (agree on a flag with an all-reduce)."]
    for _, _, r, summary, _ in events:
        lines += ["", f"--- rank {r} (a consequence: its peer had gone) ---", summary]
    failures = [(early[0], lines[0], "")] + [(r, s, d) for _, _, r, s, d in events]
    return RankError("\n".join(lines), failures)


# --------------------------------------------------------------------------- timeouts
_LIBRARY = (os.sep + "minidist" + os.sep, os.sep + "torch" + os.sep, "multiprocessing" + os.sep,
            os.sep + "threading.py")
_FRAME = re.compile(r'File "(?P<path>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


def stack_of(dump_path: str) -> list[tuple[str, int, str]]:
    """The main thread's frames of a faulthandler dump, innermost first, ``(path, line, func)``."""
    try:
        with open(dump_path) as f:
            text = f.read()
    except OSError:
        return []
    head, _, text = text.partition("\n")
    main = head.rsplit(" ", 1)[-1]
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", text)
    block = next((b for b in blocks if b.split("(", 1)[0].strip().endswith(main)), text)
    frames = []
    for m in _FRAME.finditer(block):
        path = m["path"]
        if path.endswith(os.path.join("minidist", "launch", "rank_process.py")) or "multiprocessing" + os.sep in path:
            break
        frames.append((path, int(m["line"]), m["func"]))
    return frames


def _is_library(path: str) -> bool:
    return any(p in path for p in _LIBRARY) and not _CELL.search(path)


def _source_line(path: str, line: int) -> str:
    import linecache
    return linecache.getline(path, line).strip()


def format_stack(frames: list[tuple[str, int, str]], limit: int = 8) -> str:
    """The learner's innermost frame first (with its source line), then the library's frames."""
    if not frames:
        return "    (no Python frames: the rank was still starting up)"
    own = [f for f in frames if not _is_library(f[0])]
    lines = []
    if own:
        path, line, func = own[0]
        src = _source_line(path, line)
        lines.append(f"    your code: {short_path(path)}, line {line}, in {func}")
        if src:
            lines.append(f"        {src}")
    inner = [f"{short_path(p)}:{ln} {fn}" for p, ln, fn in frames[:limit]]
    lines.append("    call stack (innermost first): " + " <- ".join(inner))
    return "\n".join(lines)


def timeout_error(timeout: float, world_size: int, states: dict, stacks: dict,
                  finished: set) -> RankTimeoutError:
    """The report when a run outlived ``timeout``, one block per rank: ``states`` (what each running
    rank published), ``stacks`` (:func:`stack_of`), ``finished`` (ranks that had returned)."""
    live = sorted(states)
    lines = [f"minidist.run timed out after {timeout:g} s; {len(live)} of {world_size} ranks were "
             "still running (a deadlock, or a rank that never joined a collective).", ""]
    failures = []
    for r in range(world_size):
        if r in finished:
            lines.append(f"rank {r}: finished (returned its result)")
            continue
        if r not in states:
            lines.append(f"rank {r}: exited")
            continue
        state = states[r] or "starting up"
        stack = format_stack(stacks.get(r, []))
        lines += [f"rank {r}: {state}", stack]
        failures.append((r, state, stack))
    lines += ["", "Fix: make every send meet a matching recv (post isend/irecv pairs, or order "
              "even/odd ranks), and make every rank call the same collectives in the same order."]
    return RankTimeoutError("\n".join(lines), failures or [(-1, "timeout", "")])
