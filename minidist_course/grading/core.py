"""Generic grading: checks, reports with a score, tensor comparison, checks run on several ranks."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from minidist.launch import RankError, RankTimeoutError, run

__all__ = ["Result", "Report", "check", "compare", "check_on_ranks", "describe_exception",
           "check_rules", "rules_text", "tagged"]


@dataclass
class Result:
    """One check: its name, whether it passed, its points, and what was wrong (empty if passed)."""

    name: str
    passed: bool
    points: float = 1.0
    max_points: float = 1.0
    message: str = ""
    stop: str = ""  # why later checks of the same code are not worth running ("timeout", ...)
    rule: str = ""  # the id of the rule this check enforces (an exercise part's RULES key)
    not_checked: bool = False  # could not be judged (another check's failure hides it): no points,
    #                            shown "–", not a failure of its own rule (the message says why)

    def line(self) -> str:
        if self.passed:
            return f"✓ {self.name}"
        first, *rest = (self.message or "failed").splitlines()
        mark = "–" if self.not_checked else "✗"
        return "\n".join([f"{mark} {self.name}: {first}"] + [f"    {r}" for r in rest])


def describe_exception(e: BaseException, max_lines: int = 6) -> str:
    """A short, learner-facing description of an exception raised by a check or by ranks."""
    if isinstance(e, RankTimeoutError):
        lines = [str(e).splitlines()[0]]
        for rank, state, stack in e.failures:
            if rank < 0:
                continue
            lines.append(f"rank {rank}: {_where_waiting(stack, state)}")
        hint = ("(a deadlock? every send needs a matching receive posted at the same time, or a "
                "collective that only some ranks of a group called)")
        return "\n".join(lines[:max_lines - 1] + [hint])   # the hint survives many ranks
    if isinstance(e, RankError):
        rank, summary, _ = e.failures[0]
        if summary.startswith("NotImplementedError"):
            return f"rank {rank} raised NotImplementedError: the exercise code is not written yet"
        if " returned from the function after " in summary:   # uneven collectives: the launcher's
            head = str(e).split("\n\n", 1)[0].splitlines()         # who returned, where the rest were
            return "\n".join(head[:max_lines])[:700]
        text = f"rank {rank} raised {summary}"[:500]
        if "Connection closed" in summary or "Connection reset by peer" in summary:
            text += ("\n(a peer rank had already finished or died: did one rank return or skip a "
                     "collective that the others made? every rank must make the same calls)")
        return text
    if isinstance(e, NotImplementedError):
        return "NotImplementedError: the exercise code is not written yet"
    if isinstance(e, AssertionError):
        return str(e) or "assertion failed"
    return f"{type(e).__name__}: {e}"[:500]


def _where_waiting(stack: str, state: str) -> str:
    """Where a timed-out rank waits, in the learner's terms: their own line (and its source) when
    the rank is inside their code; otherwise that their code had returned and the rank waits in
    the grader's own collective — it skipped one that the other ranks are still in."""
    import linecache
    import re
    m = re.search(r"your code: (.+), line (\d+), in (\S+)(?:\n\s{8}(\S.*))?", stack)
    last = state.replace("idle after ", "")
    if m and "minidist_course/grading/" in m.group(1):
        m = None   # the launcher's "your code" is the grader's frame: the learner's had returned
    if m:
        path, line, func, src = m.group(1), int(m.group(2)), m.group(3), m.group(4)
        src = src or linecache.getline(path, line).strip()
        return (f"waiting at your line {line} in {func}" + (f": `{src}`" if src else "")
                + f" (minidist's last message: {last})")
    if "minidist_course/grading/" in stack:
        return ("your function had returned on this rank, which waits in the grader's next "
                "collective: it skipped a collective that the other ranks are still in")
    frames = re.findall(r"(\S+:\d+ \S+)", stack.split("call stack (innermost first):")[-1])
    if state.startswith("idle after "):   # the rank waits in a torch call, not in minidist's
        state = f"outside minidist's collectives (the last it ran: {last})"
    return state + (f" — at {frames[0]}" if frames else "")


def _stop_kind(e: BaseException) -> str:
    if isinstance(e, RankTimeoutError):
        return "timeout"
    if isinstance(e, NotImplementedError) or (
            isinstance(e, RankError) and e.failures[0][1].startswith("NotImplementedError")):
        return "not_implemented"
    return ""


def check(name: str, fn, points: float = 1.0) -> Result:
    """Run ``fn()`` as one check; see the module docstring for what passes and fails."""
    try:
        out = fn()
    except Exception as e:  # noqa: BLE001 - a learner's bug of any kind is a failed check
        return Result(name, False, 0.0, points, describe_exception(e), stop=_stop_kind(e))
    if out is None or out is True:
        return Result(name, True, points, points)
    if isinstance(out, tuple) and len(out) == 2:  # (rule id, message): the rule it breaks
        return Result(name, False, 0.0, points, str(out[1]) or "failed", rule=str(out[0]))
    return Result(name, False, 0.0, points, out if isinstance(out, str) and out else "failed")


@dataclass
class Report:
    """A list of :class:`Result` with a score. ``print(report)`` shows one line per check.

    ``total``: the points the exercise text gives this part; the printed score is then scaled to
    it (``score: 3/4``), so the text and the grader say the same numbers. ``notes`` are printed
    under the title (e.g. "fails because ring_reduce_scatter fails").

    Once a check times out (a deadlock) or hits ``NotImplementedError``, every later check added
    through :meth:`check`, :func:`check_on_ranks` or ``grade_collective`` is failed unrun with a
    message saying why: each would only wait out the same timeout, so feedback comes after about
    one timeout instead of one per check.
    """

    title: str = "checks"
    results: list = field(default_factory=list)
    total: float | None = None
    notes: list = field(default_factory=list)
    rules: dict | None = None   # {rule id: text}: a failed check's message starts "[id] text: "
    default_rule: str = ""      # the rule of a failed check that names none
    timeout_rule: str = ""      # the rule of a check that timed out (a deadlock), if any
    brief_repeats: bool = False  # a rule failed again with a message of several lines (one per
    #                              rank): one line, pointing to where it was printed in full

    def add(self, result: Result) -> Result:
        self.results.append(result)
        return result

    @property
    def blocked(self) -> str | None:
        """Why the remaining checks are not run (``None``: run them)."""
        said = any(r.message.startswith("not run:") for r in self.results)
        for r in self.results:
            if r.stop == "timeout" and said:
                return "not run (a check above timed out)"
            if r.stop == "not_implemented" and said:
                return "not run (NotImplementedError above)"
            if r.stop == "timeout":
                return (f"not run: '{r.name}' timed out (a deadlock?) and every later check would "
                        "wait out the same timeout; fix that first, then run this cell again")
            if r.stop == "not_implemented":
                return "not run: the code raises NotImplementedError (not written yet)"
        return None

    def check(self, name: str, fn, points: float = 1.0, rule: str = "") -> Result:
        """Run :func:`check` and add its result (or a failed, unrun one when :attr:`blocked`)."""
        if (why := self.blocked) is not None:
            return self.add(Result(name, False, 0.0, points, why, rule=rule))
        result = check(name, fn, points)
        if result.stop == "timeout" and self.timeout_rule:
            result.rule = self.timeout_rule
        result.rule = result.rule or rule or ("" if result.passed else self.default_rule)
        if (not result.passed and self.rules and result.rule in self.rules
                and not name.startswith(f"[{result.rule}]")
                and not any(f"[{k}] " in result.message for k in self.rules)):
            result.message = f"[{result.rule}] {self.rules[result.rule]}: {result.message}"
        return self.add(result)

    def relabel(self, old: str, new: str) -> None:
        """Failed checks of rule ``old`` become rule ``new`` (a grader that learns later that a
        mistake is more general than the first check suggested)."""
        for r in self.failed:
            if r.rule == old:
                r.rule = new
                if self.rules and r.message.startswith(f"[{old}] {self.rules.get(old)}: "):
                    r.message = (f"[{new}] {self.rules[new]}: "
                                 + r.message[len(f"[{old}] {self.rules.get(old)}: "):])

    @property
    def failed_rules(self) -> list:
        """The rule ids of the failed checks, in order, each once (not those not checked)."""
        return list(dict.fromkeys(r.rule for r in self.failed if r.rule and not r.not_checked))

    @property
    def raw_score(self) -> float:
        return sum(r.points for r in self.results)

    @property
    def raw_max(self) -> float:
        return sum(r.max_points for r in self.results)

    @property
    def score(self) -> float:
        """Points earned; scaled to :attr:`total` when it is set (rounded to 2 decimals)."""
        if self.total is None:
            return self.raw_score
        return round(self.total * self.raw_score / self.raw_max, 2) if self.raw_max else 0.0

    @property
    def max_score(self) -> float:
        return self.raw_max if self.total is None else self.total

    @property
    def passed(self) -> bool:
        return bool(self.results) and all(r.passed for r in self.results)

    @property
    def failed(self) -> list:
        return [r for r in self.results if not r.passed]

    def __str__(self) -> str:
        lines = [f"{self.title}:"] + [f"  ! {n}" for n in self.notes]
        i, rs = 0, self.results
        told: dict = {}   # rule -> the check whose failure of it was printed in full
        while i < len(rs):   # a run of checks not run for the same reason: one line
            j = i
            while rs[i].message.startswith("not run (") and j + 1 < len(rs) \
                    and rs[j + 1].message == rs[i].message:
                j += 1
            if j > i:
                lines.append(f"  ✗ {j - i + 1} checks, {rs[i].name} … {rs[j].name}: {rs[i].message}")
            elif (self.brief_repeats and not rs[i].passed and rs[i].rule in told
                  and "\n" in rs[i].message and "decoded" not in rs[i].message):
                lines.append(f"  ✗ {rs[i].name}: [{rs[i].rule}] broken again (in full at "
                             f"{told[rs[i].rule]} above)")
            else:
                lines.append("  " + rs[i].line().replace("\n", "\n  "))
                if not rs[i].passed and rs[i].rule and "\n" in rs[i].message \
                        and not rs[i].message.startswith("not run ("):
                    told[rs[i].rule] = rs[i].name
            i = j + 1
        lines.append(f"score: {self.score:g}/{self.max_score:g}")
        return "\n".join(lines)

    def first_failure(self) -> "Result":
        """The failed check to quote first: one whose message decodes the mistake (which chunk,
        which step) if any, else the first (a check not checked comes last)."""
        failed = sorted(self.failed, key=lambda r: r.not_checked)
        return next((r for r in failed if "first difference" in r.message
                     or "decoded" in r.message), failed[0])

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
            note = f" {self.notes[0]}." if self.notes else ""
            unchecked = sum(r.not_checked for r in self.failed)
            failed = f"{len(self.failed) - unchecked} of {len(self.results)} checks failed" + (
                f", {unchecked} not checked" if unchecked else "")
            raise AssertionError(f"{self.title}: {failed} (score {self.score:g}/"
                                 f"{self.max_score:g}).{note} First: "
                                 f"{self.first_failure().line()}")


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
def _merge_rank_messages(msgs) -> str | None:
    """Per-rank messages → one text; the same message on several ranks is shown once."""
    by_text = {}
    for r, m in enumerate(msgs):
        if m not in (None, True):
            m = str(m)
            by_text.setdefault(m.split(": ", 1)[1] if m.startswith(f"rank {r}: ") else m,
                               []).append(r)
    return "\n".join((f"rank {rs[0]}: " if len(rs) == 1 else
                      f"ranks {', '.join(map(str, rs))}: ") + m
                     for m, rs in by_text.items()) or None


def tagged(rules: dict, key: str, message: str) -> str:
    """``"[key] rule text: message"``: a check's message naming the rule it breaks (for rank
    functions, which return strings)."""
    return f"[{key}] {rules[key]}: {message}"


def rules_text(rules: dict) -> str:
    """The rules of an exercise part as the lines printed in its introduction."""
    return "\n".join(f"  [{key}] {text}" for key, text in rules.items())


def check_rules(report: Report, rules: dict, rank_fn, world_sizes, *args, timeout: float = 60.0,
                points: float = 1.0) -> Report:
    """One launch per world size, one result per rule: ``rank_fn(rank, W, *args)`` returns
    ``{rule id: message}`` for the rules it found broken (a missing key: kept). Each rule becomes
    a check named ``"[id] text"`` and tagged with its id, failing with ``"W=w: ranks ...: message"``
    for every world size that broke it. A launch that raises or times out fails every rule with
    the reason; after a timeout the remaining world sizes are not launched (each would only wait
    out the same timeout)."""
    found: dict = {key: [] for key in rules}
    stop = ""
    for world in world_sizes:
        if stop:
            for key in rules:
                found[key].append(f"W={world}: not run (W={stop} timed out: fix that first)")
            continue
        try:
            per_rank = run(rank_fn, world, *args, timeout=timeout)
        except Exception as e:  # noqa: BLE001 - the learner's failure, reported per rule
            text = describe_exception(e)
            for i, key in enumerate(rules):   # the whole story once, a pointer to it after
                found[key].append(f"W={world}: {text}" if i == 0 else
                                  f"W={world}: not checked: the run failed (see the first check)")
            if _stop_kind(e):
                stop = str(world)
            continue
        for key in rules:
            merged = _merge_rank_messages([(d or {}).get(key) for d in per_rank])
            if merged:
                found[key].append(f"W={world}: {merged}")
        unknown = {k for d in per_rank for k in (d or {})} - set(rules)
        if unknown:
            raise KeyError(f"grader bug: rank function returned unknown rules {sorted(unknown)}")
    for key, text in rules.items():
        msgs = found[key]
        report.add(Result(f"[{key}] {text}", not msgs, 0.0 if msgs else points, points,
                          "\n".join(msgs),
                          stop="timeout" if stop else "", rule=key))
    return report


def check_on_ranks(name: str, rank_fn, world_sizes=(1, 2, 3, 4), *args, timeout: float = 30.0,
                   points: float = 1.0, report: Report | None = None, rule: str = "") -> Report:
    """One check per world size W: ``rank_fn(rank, W, *args)`` runs on W ranks (via
    :func:`minidist.run`) and returns ``None`` (fine) or a message string, or raises.

    A rank that raises or hangs fails the check with the rank and the reason; every failing rank
    is listed. After a timeout or ``NotImplementedError`` the remaining checks of ``report`` are
    failed unrun (see :class:`Report`). Returns the report.
    """
    report = report if report is not None else Report(name)

    def one(world):
        return _merge_rank_messages(run(rank_fn, world, *args, timeout=timeout))

    for world in world_sizes:
        report.check(f"{name} (world size {world})", lambda w=world: one(w), points, rule=rule)
    return report
