"""Grade exercise 13: what a run costs, against ``minidist_course.planner.cost``.

The learner writes (see ``exercises/13_cost.ipynb``; units: FLOPs, FLOP/s, seconds):

* ``gpus_for_deadline(flops, deadline, peak_flops, mfu, gpus_per_node)`` → the fewest GPUs, in
  whole nodes, that do ``flops`` within ``deadline`` at ``mfu`` of ``peak_flops`` each;
  ``ValueError`` for a deadline <= 0 or an MFU outside (0, 1];
* ``spot_wall_time(work_time, interruptions_per_hour, checkpoint_interval, checkpoint_time,
  restart_time)`` → the expected wall time of an interrupted run: each interruption loses half a
  checkpoint interval of work plus the restart (Young 1974's first-order model);
  ``ValueError`` when the run loses work as fast as it makes it;
* ``young_interval(checkpoint_time, mtbf)`` → sqrt(2·C·MTBF) (Young 1974).

A wrong spot time is compared with the usual slips (a whole interval lost instead of half, the
checkpoint writes or the restarts forgotten, the rate taken per second) and the grader says which
one it matches (all of them when this case gives two slips the same number). A case that must
raise ``ValueError`` says so in its name, so its ✓ line reads "...: raises ValueError".
"""

from __future__ import annotations

import math

from ..planner import calc
from ..planner import cost as reference
from .core import Report
from .generated import generated_check, st

__all__ = ["DEADLINE_CASES", "SPOT_CASES", "YOUNG_CASES", "grade_gpus_for_deadline",
           "grade_spot_wall_time", "grade_young_interval", "DEADLINE_RULES", "SPOT_RULES",
           "YOUNG_RULES"]

DEADLINE_RULES = {
    "enough": "enough GPUs to finish by the deadline: round up, never down",
    "nodes": "whole nodes: a multiple of gpus_per_node, at least one node, no more than needed",
    "gpus": "the answer counts GPUs, not nodes",
    "seconds": "the deadline is in seconds and the peak in FLOP/s: no unit conversion",
    "errors": "ValueError for a deadline <= 0 or an MFU outside (0, 1] (50 is not 50 %)",
}
SPOT_RULES = {
    "half": "each interruption loses half a checkpoint interval of work on average",
    "checkpoints": "the checkpoint writes take time: work · (1 + checkpoint_time / interval)",
    "restarts": "each interruption also waits restart_time",
    "per_hour": "interruptions_per_hour is a rate per hour (/ 3600 for a rate per second)",
    "never": "ValueError when the run loses work as fast as it makes it",
    "formula": "Young's first-order expected wall time, within 1e-6",
}
YOUNG_RULES = {"young": "the interval is sqrt(2 · C · MTBF) (Young 1974), in seconds"}
_SLIP_RULE = {"whole interval": "half", "no checkpoints": "checkpoints", "no restarts": "restarts",
              "per second": "per_hour"}

_DAY = 86400.0
_H100 = calc.GPUS["H100-80GB"]["peak_flops"]
_EIGHT = 8 * _DAY * 1e15 * 0.5                     # FLOPs that take exactly 8 GPUs one day
DEADLINE_CASES = [  # (flops, deadline, peak_flops, mfu, gpus_per_node)
    (_EIGHT, _DAY, 1e15, 0.5, 8),                   # exactly one node: no extra node
    (_EIGHT * 1.001, _DAY, 1e15, 0.5, 8),           # a little more: a second node
    (_EIGHT, _DAY, 1e15, 0.3, 1),                   # 13.3 GPUs -> 14
    (reference.training_flops(100e9, 2e12), 90 * _DAY, _H100, 0.4, 8),   # the primer's model
    (1.0, _DAY, 1e15, 0.5, 8),                      # tiny work: still one node
    (_EIGHT, 0.0, 1e15, 0.5, 8),                    # no time at all: ValueError
    (_EIGHT, _DAY, 1e15, 0.0, 8),                   # MFU 0: ValueError
    (_EIGHT, _DAY, 1e15, 50, 8),                    # "50" for 50%: ValueError
]
SPOT_CASES = [  # (work_time, interruptions_per_hour, checkpoint_interval, checkpoint_time, restart_time)
    (360000.0, 0.0, 3600.0, 60.0, 600.0),           # no interruptions: only the checkpoint writes
    (360000.0, 0.1, 3600.0, 60.0, 900.0),           # C/τ = 1/60 and λR = 1/40: slips tell apart
    (360000.0, 1.0, 1200.0, 30.0, 300.0),
    (956650.0, 0.32, 1162.0, 60.0, 600.0),          # chapter 13's 7B run on 32 spot nodes
    (360000.0, 2.0, 3600.0, 60.0, 600.0),           # 2/h x 1800 s lost: never finishes
]
YOUNG_CASES = [(60.0, 86400.0), (60.0, 3600 / 0.32), (1.0, 1.0), (300.0, 40000.0)]

_SLIPS = {  # what a wrong spot time matches -> what it means
    "whole interval": "each interruption loses half an interval on average (it strikes anywhere "
                      "between two checkpoints), not a whole one",
    "no checkpoints": "the checkpoint writes are missing: work · (1 + checkpoint_time / interval)",
    "no restarts": "the restarts are missing: each interruption also waits restart_time",
    "per second": "interruptions_per_hour is per hour: divide by 3600 for a rate per second",
}


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _ratio_text(got, want) -> str:
    return f"expected {want:.6g}, got {got:.6g} (yours/expected = {got / want:.4g})" if want else \
        f"expected {want:.6g}, got {got:.6g}"


def _expect_error(fn, args, what, rule="errors"):
    try:
        got = fn(*args)
    except ValueError:
        return None
    except Exception as e:  # noqa: BLE001
        return rule, f"expected ValueError ({what}), got {type(e).__name__}: {e}"
    return rule, f"expected ValueError ({what}), got {got!r}"


def _deadline_check(fn, case):
    try:
        want = reference.gpus_for_deadline(*case)
    except ValueError as e:
        return _expect_error(fn, case, str(e).split(":")[0])
    try:
        got = fn(*case)
    except ValueError as e:
        return "errors", f"raised ValueError ({e}) for valid arguments: expected {want} GPUs"
    if isinstance(got, bool) or not isinstance(got, int):
        return "gpus", f"expected a whole number of GPUs ({want}), got {type(got).__name__} {got!r}"
    if got == want:
        return None
    flops, deadline, peak, mfu, per_node = case
    exact = flops / (deadline * peak * mfu)
    text = f"expected {want} GPUs, got {got}"
    for factor, unit in ((3600, "hours"), (86400, "days"), (1 / 3600, "hours"),
                         (1 / 86400, "days")):
        if exact / factor > per_node and got == reference.gpus_for_deadline(
                flops, deadline * factor, peak, mfu, per_node):
            how = "multiplied" if factor > 1 else "divided"
            return "seconds", (f"{text}: that is the answer for the deadline {how} by "
                               f"{max(factor, 1 / factor):g}: the deadline is already in seconds "
                               f"(did you treat it as {unit}?)")
    if got == math.ceil(exact) and per_node > 1 and got % per_node:
        return "nodes", f"{text}: round up to whole nodes of {per_node} GPUs"
    if per_node > 1 and got * per_node == want:
        return "gpus", f"{text}: {got} is the number of nodes; return GPUs (nodes x {per_node})"
    if 10 * got < exact:
        return "seconds", (f"{text}: {exact:.4g} GPUs are needed, more than 10x yours: is the "
                           "deadline taken in seconds and the peak in FLOP/s?")
    if got < exact:
        return "enough", (f"{text}: {exact:.4g} GPUs are needed, so {got} miss the deadline "
                          "(round up, not down)")
    if got == math.ceil(exact) and per_node > 1:
        return "nodes", f"{text}: round up to whole nodes of {per_node} GPUs"
    if got % per_node:
        return "nodes", f"{text}: not a whole number of nodes of {per_node} GPUs"
    return "nodes", f"{text}: more GPUs than the fewest whole nodes that make the deadline"


def _spot_variants(work, per_hour, tau, c, r):
    rate = per_hour / 3600
    run = lambda lost, lam=rate: work * (1 + c / tau) / (1 - lam * lost)  # noqa: E731
    out = {"whole interval": run(tau) * (1 + rate * r),
           "no checkpoints": work / (1 - rate * tau / 2) * (1 + rate * r),
           "no restarts": run(tau / 2)}
    if per_hour * tau / 2 < 1:
        out["per second"] = run(tau / 2, per_hour) * (1 + per_hour * r)
    return out


def _spot_check(fn, case):
    try:
        want = reference.spot_wall_time(*case)
    except ValueError:
        return _expect_error(fn, case, "the run never finishes: interruptions_per_hour/3600 · "
                                       "checkpoint_interval/2 >= 1", rule="never")
    try:
        got = fn(*case)
    except ValueError as e:
        text = f"raised ValueError ({e}) but the run finishes: expected {want:.6g} s"
        if case[1] * case[2] / 2 >= 1:
            return "per_hour", f"{text}: {_SLIPS['per second']}"
        return "never", text
    if not _number(got):
        return "formula", f"expected a number of seconds ({want:.6g}), got {got!r}"
    if abs(got - want) <= 1e-6 * want:
        return None
    text = _ratio_text(got, want)
    slips = [name for name, value in _spot_variants(*case).items()
             if value > 0 and abs(got - value) <= 1e-6 * value and abs(value - want) > 1e-6 * want]
    if len(slips) > 1:  # two slips give the same number here: name both, the learner knows which
        return _SLIP_RULE[slips[0]], (f"{text}: this case cannot tell which of these it is "
                                      f"(the other cases can):\n- "
                                      + "\n- ".join(f"[{_SLIP_RULE[n]}] {_SLIPS[n]}"
                                                     for n in slips))
    return (_SLIP_RULE[slips[0]], f"{text}: {_SLIPS[slips[0]]}") if slips else ("formula", text)


def _young_check(fn, case):
    want = reference.young_interval(*case)
    got = fn(*case)
    if not _number(got):
        return "young", f"expected a number of seconds ({want:.6g}), got {got!r}"
    if abs(got - want) <= 1e-9 * want:
        return None
    text = _ratio_text(got, want)
    if abs(got - math.sqrt(case[0] * case[1])) <= 1e-9 * want:
        text += ": the 2 is missing: sqrt(2 · C · MTBF)"
    return "young", text


def _raises(reference_fn, case) -> bool:
    try:
        reference_fn(*case)
    except ValueError:
        return True
    return False


def _deadline_name(case) -> str:
    flops, deadline, peak, mfu, per_node = case
    name = (f"{flops:.4g} FLOPs in {deadline / _DAY:g} days at {peak:.3g} FLOP/s, MFU {mfu:g}, "
            f"{per_node} GPUs per node")
    return name + (": raises ValueError" if _raises(reference.gpus_for_deadline, case) else "")


def _spot_name(case) -> str:
    work, per_hour, tau, c, r = case
    name = (f"{work / 3600:.4g} h of work, {per_hour:g} interruptions/h, a {c:g} s checkpoint "
            f"every {tau:g} s, {r:g} s restarts")
    if _raises(reference.spot_wall_time, case):
        name += f" (λτ/2 = {per_hour / 3600 * tau / 2:g}): raises ValueError"
    return name


def grade_gpus_for_deadline(fn, total: float = 2) -> Report:
    """``fn(flops, deadline, peak_flops, mfu, gpus_per_node)`` against ``cost.gpus_for_deadline``."""
    report = Report("Part A: GPUs for a deadline", total=total, rules=DEADLINE_RULES)
    for case in DEADLINE_CASES:
        report.check(_deadline_name(case), lambda c=case: _deadline_check(fn, c))
    generated_check(report, "random runs, deadlines and nodes", st.tuples(
        st.floats(1.0, 1e26), st.floats(60.0, 1e8), st.floats(1e12, 5e15), st.floats(0.01, 1.0),
        st.sampled_from([1, 2, 4, 8, 16])), lambda c: _deadline_check(fn, c), max_examples=60,
        describe=_deadline_name)
    return report


def grade_spot_wall_time(fn, total: float = 3) -> Report:
    """``fn(work_time, interruptions_per_hour, checkpoint_interval, checkpoint_time,
    restart_time)`` against ``cost.spot_wall_time``."""
    report = Report("Part B: the wall time of a run on spot machines", total=total,
                    rules=SPOT_RULES)
    for case in SPOT_CASES:
        report.check(_spot_name(case), lambda c=case: _spot_check(fn, c))
    generated_check(report, "random runs and interruption rates", st.tuples(
        st.floats(60.0, 1e7), st.floats(0.0, 4.0), st.floats(60.0, 20000.0), st.floats(0.0, 600.0),
        st.floats(0.0, 3600.0)), lambda c: _spot_check(fn, c), max_examples=60,
        describe=_spot_name)
    return report


def grade_young_interval(fn, total: float = 1) -> Report:
    """``fn(checkpoint_time, mtbf)`` against ``cost.young_interval``."""
    report = Report("Part C: Young's checkpoint interval", total=total, rules=YOUNG_RULES)
    for case in YOUNG_CASES:
        report.check(f"C = {case[0]:g} s, MTBF = {case[1]:.6g} s", lambda c=case: _young_check(fn, c))
    generated_check(report, "C and MTBF", st.tuples(st.floats(0.01, 3600.0), st.floats(1.0, 1e8)),
                    lambda c: _young_check(fn, c), max_examples=40,
                    describe=lambda c: f"C = {c[0]!r} s, MTBF = {c[1]!r} s")
    return report
