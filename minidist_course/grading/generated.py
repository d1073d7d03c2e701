"""Generated inputs for the graders: a learner's function is compared with the library's reference
on inputs hypothesis draws — sizes 0 and 1, empty rows, ties, -inf, W = 1-4 — not only on the
named cases a grader lists. The draw is seeded (``derandomize``): every learner, every run, gets
the same inputs, and a fixed budget of examples (a few seconds a part). On a mismatch hypothesis
shrinks the input, and the feedback shows the *smallest* input that fails, with the rule it
breaks (the check's ``(rule, message)``, as :meth:`~.core.Report.check` takes them).

Usage, in a grader::

    generated_check(report, "capacity", st.tuples(...), lambda case: _capacity_check(fn, case))

A check that raises (the learner's code crashed) is shrunk the same way; its exception is shown
with the smallest input, under the check's ``crash_rule`` when given.
"""

from __future__ import annotations

from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import strategies as st

from .core import Report, describe_exception

__all__ = ["generated_check", "st"]


class _Mismatch(Exception):
    def __init__(self, rule: str, message: str):
        super().__init__(message)
        self.rule, self.message = rule, message


def _smallest(strategy, check, max_examples: int):
    """Run ``check`` on ``max_examples`` drawn inputs; return ``None`` or ``(input, rule, message,
    exception)`` for the smallest failing input hypothesis finds."""
    last: list = [None]

    @settings(max_examples=max_examples, derandomize=True, database=None, deadline=None,
              verbosity=Verbosity.quiet, print_blob=False, report_multiple_bugs=False,
              suppress_health_check=list(HealthCheck),
              phases=(Phase.explicit, Phase.generate, Phase.shrink))
    @given(strategy)
    def prop(example):
        last[0] = example
        out = check(example)
        if out is not None and out is not True:
            rule, message = out if isinstance(out, tuple) else ("", str(out))
            raise _Mismatch(rule, message)

    try:
        prop()
    except _Mismatch as m:
        return last[0], m.rule, m.message, None
    except Exception as e:  # noqa: BLE001 - the learner's code raised on the smallest input
        return last[0], "", "", e
    return None


def generated_check(report: Report, name: str, strategy, check, max_examples: int = 60,
                    describe=repr, crash_rule: str = "", points: float = 1.0):
    """Add one check to ``report``: ``check(example)`` (``None`` when right, else ``(rule,
    message)``) on ``max_examples`` inputs drawn from ``strategy``. ``describe(example)`` words the
    failing input (``repr`` by default)."""
    def run():
        found = _smallest(strategy, check, max_examples)
        if found is None:
            return None
        example, rule, message, error = found
        where = f"on the smallest generated input that fails, {describe(example)}"
        if error is not None:
            return crash_rule, f"{where}, your code raised: {describe_exception(error)}"
        return rule, f"{where}: {message}"
    return report.check(f"{name} (generated inputs, {max_examples})", run, points)


def examples(strategy, n: int) -> list:
    """``n`` inputs hypothesis draws from ``strategy``, the same on every call (seeded): for checks
    that run many inputs in one launch of ranks, where shrinking one at a time would cost a launch
    per try. Boundary values come first, as hypothesis draws them (0, 1, empty, the minimum)."""
    out: list = []

    @settings(max_examples=n, derandomize=True, database=None, deadline=None,
              verbosity=Verbosity.quiet, suppress_health_check=list(HealthCheck),
              phases=(Phase.generate,))
    @given(strategy)
    def collect(example):
        if example not in out:
            out.append(example)

    collect()
    return out


def _batch_rank(rank, world, rank_check, drawn, args):
    return [rank_check(rank, world, *args, example) for example in drawn]


def generated_on_ranks(report: Report, name: str, rank_check, strategy, n: int,
                       world_sizes=(1, 2, 3, 4), args: tuple = (), describe=repr,
                       timeout: float = 60.0, rule: str = "", points: float = 1.0):
    """Add one check to ``report``: ``rank_check(rank, W, *args, example)`` (``None`` when right,
    else a message, ``[rule] ...``-tagged or not) on ``n`` inputs :func:`examples` draws from
    ``strategy``, at every world size — one launch per world size, all inputs in it (a launch is
    seconds; shrinking would cost one per try). The first failing input in the drawn order
    (hypothesis draws boundaries and small sizes first) is shown with its failing ranks. Added
    only once the part's named checks pass: their feedback comes first, and a wrong solution
    does not wait for more launches."""
    from minidist.launch import run

    from .core import _merge_rank_messages

    if report.failed:
        return None
    drawn = examples(strategy, n)

    def one():
        for world in world_sizes:
            per_rank = run(_batch_rank, world, rank_check, drawn, args, timeout=timeout)
            for i, example in enumerate(drawn):
                merged = _merge_rank_messages([msgs[i] for msgs in per_rank])
                if merged:
                    return f"W={world}, {describe(example)} (generated): {merged}"
        return None
    return report.check(f"{name} (generated inputs, {len(drawn)} per world size)", one, points,
                        rule=rule)
