"""Autograding for the exercises: run the learner's code on several ranks, compare with torch, score.

Three layers, from generic to specific:

* :func:`check` runs one check ``fn()`` and returns a :class:`Result`: the check passes when ``fn``
  returns ``None``/``True``; it fails when it returns ``False`` or a message string, raises
  (``AssertionError`` → its message), or times out (:class:`minidist.RankTimeoutError` → where
  each rank was waiting; never a frozen notebook).
* :class:`Report` collects results, prints ``✓``/``✗`` lines and a score, and
  :meth:`Report.assert_passed` raises ``AssertionError`` when anything failed, so an autograded
  notebook cell fails (nbgrader gives it 0 points).
* :func:`grade_collective` runs a learner's collective on world sizes 1..4 and awkward sizes (empty,
  fewer elements than ranks, odd sizes), compares every rank's result with torch.distributed's own
  collective and says what was wrong: rank, index, expected, got.
  :func:`check_on_ranks` does the same for any per-rank check function (DDP, TP, PP exercises).

Example (a grading cell)::

    from minidist import grading
    grading.grade_collective(ring_all_reduce, "all_reduce").assert_passed()

:func:`compare` describes the first mismatch between two tensors; reuse it in your own checks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .comm import p2p
from .launch import RankError, RankTimeoutError, run

__all__ = ["Result", "Report", "check", "compare", "check_on_ranks", "grade_collective",
           "REFERENCES", "describe_exception"]


@dataclass
class Result:
    """One check: its name, whether it passed, its points, and what was wrong (empty if passed)."""

    name: str
    passed: bool
    points: float = 1.0
    max_points: float = 1.0
    message: str = ""

    def line(self) -> str:
        if self.passed:
            return f"✓ {self.name}"
        first, *rest = (self.message or "failed").splitlines()
        return "\n".join([f"✗ {self.name}: {first}"] + [f"    {r}" for r in rest])


def describe_exception(e: BaseException, max_lines: int = 6) -> str:
    """A short, learner-facing description of an exception raised by a check or by ranks."""
    if isinstance(e, RankTimeoutError):
        lines = [str(e).splitlines()[0]]
        for rank, state, stack in e.failures:
            if rank < 0:
                continue
            frames = [s.strip() for s in stack.splitlines() if s.strip().startswith("File")]
            user = [f for f in frames if "/minidist/" not in f and "/torch/" not in f]
            where = (user or frames or [""])[0]
            lines.append(f"rank {rank}: {state}" + (f" — at {where}" if where else ""))
        lines.append("(a deadlock? every send needs a matching receive posted at the same time)")
        return "\n".join(lines[:max_lines])
    if isinstance(e, RankError):
        rank, summary, _ = e.failures[0]
        if summary.startswith("NotImplementedError"):
            return f"rank {rank} raised NotImplementedError: the exercise code is not written yet"
        return f"rank {rank} raised {summary}"[:500]
    if isinstance(e, NotImplementedError):
        return "NotImplementedError: the exercise code is not written yet"
    if isinstance(e, AssertionError):
        return str(e) or "assertion failed"
    return f"{type(e).__name__}: {e}"[:500]


def check(name: str, fn, points: float = 1.0) -> Result:
    """Run ``fn()`` as one check; see the module docstring for what passes and fails."""
    try:
        out = fn()
    except Exception as e:  # noqa: BLE001 - a learner's bug of any kind is a failed check
        return Result(name, False, 0.0, points, describe_exception(e))
    if out is None or out is True:
        return Result(name, True, points, points)
    return Result(name, False, 0.0, points, out if isinstance(out, str) and out else "failed")


@dataclass
class Report:
    """A list of :class:`Result` with a score. ``print(report)`` shows one line per check."""

    title: str = "checks"
    results: list = field(default_factory=list)

    def add(self, result: Result) -> Result:
        self.results.append(result)
        return result

    def check(self, name: str, fn, points: float = 1.0) -> Result:
        """Run :func:`check` and add its result."""
        return self.add(check(name, fn, points))

    @property
    def score(self) -> float:
        return sum(r.points for r in self.results)

    @property
    def max_score(self) -> float:
        return sum(r.max_points for r in self.results)

    @property
    def passed(self) -> bool:
        return bool(self.results) and all(r.passed for r in self.results)

    @property
    def failed(self) -> list:
        return [r for r in self.results if not r.passed]

    def __str__(self) -> str:
        lines = [f"{self.title}:"] + ["  " + r.line().replace("\n", "\n  ") for r in self.results]
        lines.append(f"score: {self.score:g}/{self.max_score:g}")
        return "\n".join(lines)

    def assert_passed(self, show: bool = True) -> None:
        """Print the report, then raise ``AssertionError`` if any check failed (or none ran).

        Returns ``None`` on purpose: a grading cell that ends with this call displays nothing
        but the printed report (a returned object would add an output line to compare).
        """
        if show:
            print(self)
        if not self.results:
            raise AssertionError(f"{self.title}: no checks ran")
        if self.failed:
            raise AssertionError(f"{self.title}: {len(self.failed)} of {len(self.results)} checks "
                                 f"failed (score {self.score:g}/{self.max_score:g}); first: "
                                 f"{self.failed[0].line()}")


# --------------------------------------------------------------------------- tensors
def compare(got, expected: torch.Tensor, rank: int | None = None, what: str = "result",
            atol: float = 0.0, rtol: float = 0.0) -> str | None:
    """``None`` if ``got`` equals ``expected`` (within atol + rtol·|expected|), else a message
    naming the rank, the first wrong index, the expected and the received value."""
    who = f"rank {rank}: " if rank is not None else ""
    if not isinstance(got, torch.Tensor):
        return f"{who}{what} should be a tensor, got {type(got).__name__}"
    if got.shape != expected.shape:
        return (f"{who}{what} has shape {tuple(got.shape)}, expected {tuple(expected.shape)}")
    if got.dtype != expected.dtype:
        return f"{who}{what} has dtype {got.dtype}, expected {expected.dtype}"
    g, e = got.detach().cpu().reshape(-1), expected.detach().cpu().reshape(-1)
    if g.is_floating_point():
        bad = ~((g - e).abs() <= atol + rtol * e.abs()) | (g.isnan() != e.isnan())
        bad &= ~(g.isnan() & e.isnan())
    else:
        bad = g != e
    if not bool(bad.any()):
        return None
    idx = int(bad.nonzero()[0])
    pos = tuple(int(i) for i in torch.unravel_index(torch.tensor(idx), expected.shape)) \
        if expected.dim() > 1 else idx
    return (f"{who}{what}[{pos}]: expected {e[idx].item():g}, got {g[idx].item():g} "
            f"({int(bad.sum())} of {e.numel()} elements wrong)")


# --------------------------------------------------------------------------- generic multi-rank
def _not_implemented(result: Result) -> str | None:
    """Once the learner's code raises NotImplementedError, the other checks are failed unrun
    (each run would only fail the same way, and every failed run costs about a second)."""
    if not result.passed and "NotImplementedError" in result.message:
        return "the code raises NotImplementedError (not written yet)"
    return None


def _startup_failure(e: RankError) -> bool:
    """The ranks failed while connecting (before the learner's code ran): not the learner's fault."""
    return not isinstance(e, RankTimeoutError) and all(
        "connectFullMesh" in summary or "init_process_group" in details
        for _, summary, details in e.failures)


def _run(fn, world, *args, timeout, retries: int = 2):
    """:func:`minidist.run`, retried when gloo fails to connect at start-up (seen ~1 launch in 100
    on a loaded 2-core machine), so a learner is never marked down for it."""
    for attempt in range(retries + 1):
        try:
            return run(fn, world, *args, timeout=timeout)
        except RankError as e:
            if attempt == retries or not _startup_failure(e):
                raise


def check_on_ranks(name: str, rank_fn, world_sizes=(1, 2, 3, 4), *args, timeout: float = 30.0,
                   points: float = 1.0, report: Report | None = None) -> Report:
    """One check per world size W: ``rank_fn(rank, W, *args)`` runs on W ranks (via
    :func:`minidist.run`) and returns ``None`` (fine) or a message string, or raises.

    A rank that raises or hangs fails the check with the rank and the reason. Returns the report.
    """
    report = report if report is not None else Report(name)

    def one(world):
        msgs = _run(rank_fn, world, *args, timeout=timeout)
        bad = [m if m.startswith("rank ") else f"rank {r}: {m}"
               for r, m in enumerate(msgs) if m not in (None, True)]
        return "\n".join(str(b) for b in bad[:3]) or None

    todo = None
    for world in world_sizes:
        label = f"{name} (world size {world})"
        if todo:
            report.add(Result(label, False, 0.0, points, f"not run: {todo}"))
            continue
        result = report.check(label, lambda w=world: one(w), points)
        todo = _not_implemented(result)
    return report


# --------------------------------------------------------------------------- collectives
def _rank_data(rank: int, world: int, n: int, dtype) -> torch.Tensor:
    """Small integers (exact sums in fp32 whatever the order), different on every rank."""
    g = torch.Generator().manual_seed(1000 * world + 7 * rank + n)
    return torch.randint(-50, 50, (n,), generator=g).to(dtype)


_TORCH_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _ref_all_reduce(x, rank, world, op):
    y = x.clone()
    dist.all_reduce(y, op=_TORCH_OPS[op])
    return y


def _ref_all_gather(piece, world):
    """torch's all_gather of pieces whose sizes may differ by rank (padded to the largest)."""
    sizes = torch.tensor([piece.numel()])
    all_sizes = [torch.zeros_like(sizes) for _ in range(world)]
    dist.all_gather(all_sizes, sizes)
    m = max(int(s) for s in all_sizes)
    padded = torch.zeros(m, dtype=piece.dtype)
    padded[: piece.numel()] = piece
    out = [torch.zeros_like(padded) for _ in range(world)]
    if m:
        dist.all_gather(out, padded)
    return [o[: int(s)] for o, s in zip(out, all_sizes)]


def _case_all_reduce(fn, x, rank, world, op):
    expected = _ref_all_reduce(x, rank, world, op)
    t = x.clone()
    out = fn(t, rank, world)
    return (t if out is None else out), expected


def _case_reduce_scatter(fn, x, rank, world, op):
    expected = _ref_all_reduce(x, rank, world, op).tensor_split(world)[rank]
    chunks = [c.clone() for c in x.tensor_split(world)]
    out = fn(chunks, rank, world)
    return (chunks[rank] if out is None else out), expected


def _case_all_gather(fn, x, rank, world, op):
    mine = x.tensor_split(world)[rank].clone()
    expected = torch.cat(_ref_all_gather(mine, world))
    # the other ranks' slots start as NaN, so a slot that is never received is caught
    chunks = [c.clone().fill_(float("nan")) if x.is_floating_point() else c.clone().zero_()
              for c in x.tensor_split(world)]
    chunks[rank].copy_(mine)
    out = fn(chunks, rank, world)
    got = torch.cat(list(chunks if out is None else out))
    return got, expected


REFERENCES = {
    "all_reduce": (_case_all_reduce, 2, "fn(tensor, rank, world_size): reduce in place (or return)"),
    "reduce_scatter": (_case_reduce_scatter, 1,
                       "fn(chunks, rank, world_size): chunks = tensor.tensor_split(W); afterwards "
                       "chunks[rank] holds the reduction of every rank's chunks[rank]"),
    "all_gather": (_case_all_gather, 1,
                   "fn(chunks, rank, world_size): chunks[rank] holds this rank's piece; afterwards "
                   "every chunks[j] holds rank j's piece"),
}


def _collective_rank(rank, world, fn, reference, n, op, dtype, traffic):
    case = REFERENCES[reference][0]
    x = _rank_data(rank, world, n, dtype)
    with p2p.count_traffic() as t:
        got, expected = case(fn, x, rank, world, op)
    return got, expected, t.bytes_sent // x.element_size()


def _traffic_problem(sent: list, reference: str, world: int, n: int) -> str | None:
    """A ring moves each of the W chunks W-1 times per phase: (W-1)·N elements in all per phase,
    at most (W-1)·ceil(N/W) per rank (all-reduce: two phases)."""
    phases = REFERENCES[reference][1]
    total_expected = phases * (world - 1) * n
    per_rank_max = phases * (world - 1) * math.ceil(n / world)
    if sum(sent) == 0 and total_expected:
        return (f"no elements went through minidist.comm.p2p (expected {total_expected} in all): "
                "send with p2p.isend/irecv/exchange, not torch.distributed directly")
    worst = max(range(world), key=lambda r: sent[r])
    if sent[worst] > per_rank_max or sum(sent) != total_expected:
        return (f"traffic is not a ring's: ranks sent {sent} elements (total {sum(sent)}); a ring "
                f"sends {total_expected} in all and at most {per_rank_max} per rank")
    return None


def grade_collective(learner_fn, reference: str = "all_reduce", world_sizes=(1, 2, 3, 4),
                     sizes=(0, 1, 3, 10, 1001), op: str = "sum", dtype=torch.float32,
                     timeout: float = 20.0, traffic: str | None = None, points: float = 1.0,
                     title: str | None = None) -> Report:
    """Grade a learner's collective against torch.distributed on every (world size, size) pair.

    Calling conventions (``REFERENCES``; the function runs inside each rank, process group set up):

    * ``"all_reduce"``: ``fn(tensor, rank, world_size)`` reduces the 1-D ``tensor`` in place
      (or returns the result);
    * ``"reduce_scatter"``: ``fn(chunks, rank, world_size)`` with ``chunks = x.tensor_split(W)``
      (sizes differ when W does not divide N; some are empty when N < W); afterwards
      ``chunks[rank]`` must hold the reduction over ranks (or return it);
    * ``"all_gather"``: ``fn(chunks, rank, world_size)``; ``chunks[rank]`` holds this rank's
      piece, the others are NaN; afterwards ``chunks[j]`` must hold rank j's piece everywhere.

    Every rank's data are small random integers (so fp32 sums are exact in any order): results must
    match exactly. ``traffic="ring"`` also checks, through ``minidist.comm.p2p``'s counters, that the
    ranks sent what a ring sends ((W-1)·N elements in all per phase). A hang ends after ``timeout``
    seconds as a failed check naming where every rank waited; the remaining sizes on that world
    size are then skipped (failed) to keep grading short; once the function raises
    ``NotImplementedError`` every remaining check is failed without running.

    Returns:
        a :class:`Report`, one check per (world size, size). Call ``.assert_passed()`` on it.
    """
    if reference not in REFERENCES:
        raise ValueError(f"grade_collective: reference must be one of {sorted(REFERENCES)}, "
                         f"got {reference!r}")
    if op not in _TORCH_OPS:
        raise ValueError(f"grade_collective: op must be one of {sorted(_TORCH_OPS)}, got {op!r}")
    name = getattr(learner_fn, "__name__", "learner function")
    what = reference if reference == "all_gather" else f"{reference}, op={op}"
    report = Report(title or f"{name} graded against torch.distributed ({what})")
    todo = None
    for world in world_sizes:
        timed_out = None
        for n in sizes:
            label = f"world size {world}, {n} element{'s' if n != 1 else ''}"
            if todo or timed_out is not None:
                why = f"not run: {todo}" if todo else f"skipped: {timed_out} timed out"
                report.add(Result(label, False, 0.0, points, why))
                continue

            def one(world=world, n=n):
                outs = _run(_collective_rank, world, learner_fn, reference, n, op, dtype, traffic,
                           timeout=timeout)
                for rank, (got, expected, _) in enumerate(outs):
                    msg = compare(got, expected, rank)
                    if msg:
                        return msg
                if traffic == "ring":
                    return _traffic_problem([o[2] for o in outs], reference, world, n)
                return None

            result = report.check(label, one, points)
            todo = _not_implemented(result)
            if not result.passed and result.message.startswith("minidist.run timed out"):
                timed_out = f"{n} elements"
    return report
