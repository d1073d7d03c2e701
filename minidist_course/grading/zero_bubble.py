"""Exercise 07, part C: turn 1F1B into ZB-H1 by placing W ops — graded by the simulator.

The learner's ``fn(P, M) -> Schedule`` must keep 1F1B's order of F and B, split every backward
(one ``W`` per ``B``, after it), hold no more micro-batches than 1F1B's peak ``min(P, M)`` on any
stage, and reach ZB-H1's step time with equal F, B, W (``3M + P - 1`` units when ``M >= P``;
:func:`minidist.pipeline_parallel.zb_h1`). Each failure names the rank and the op: the W placed
too late (memory) or where it leaves the rank idle (bubble), against the reference placement.
"""

from __future__ import annotations

from minidist.pipeline_parallel import (Op, PipelineDeadlock, ScheduleError, one_f_one_b, simulate,
    validate, zb_h1)
from .core import Report
from .generated import generated_check, st

__all__ = ["check_zb_h1", "grade_zb_h1", "CASES", "ZB_RULES"]

ZB_RULES = {
    "valid": "a valid schedule (validate: every W after its B, each op once), so it runs on "
             "pipeline_step with one process's gradients and loss",
    "order": "without the W ops each rank's list is 1F1B's: only W ops are placed",
    "split": "every backward is split: one W per B",
    "memory": "no stage holds more than 1F1B's peak min(P, M) micro-batches (activations are "
              "freed at W)",
    "oldest": "the waiting W ops run oldest first, in the order of their B",
    "bubble": "ZB-H1's step time with F = B = W = 1 (3M + P - 1 units when M >= P): rank r lags "
              "its W by r backwards",
}

CASES = [(1, 1), (2, 2), (2, 3), (4, 2), (4, 4), (4, 5), (4, 8), (8, 16)]


def _after(row, op):
    i = row.index(op)
    return row[i - 1] if i else None


def _misplaced_w(got, ref, P) -> str:
    """The first W (rank order, then list order) whose predecessor differs from ZB-H1's."""
    for r in range(P):
        for op in ref[r]:
            if op.kind == "W" and _after(list(got[r]), op) != _after(list(ref[r]), op):
                have, want = _after(list(got[r]), op), _after(list(ref[r]), op)
                return (f"rank {r}: {op!r} runs after {have!r}; ZB-H1 runs it after {want!r} "
                        f"(rank {r} runs its first {r} backwards without W, then one W per B, "
                        f"oldest first: the W fill the time rank {r} would wait for gradients)")
    return "the W ops are where ZB-H1 has them"


def check_zb_h1(fn, P: int, M: int):
    """None if ``fn(P, M)`` is a ZB-H1 schedule by :data:`ZB_RULES`, else ``(rule id, what is
    wrong)``."""
    s = fn(P, M)
    try:
        validate(s)
    except ScheduleError as e:
        return "valid", f"P={P}, M={M}: {e}"
    base = one_f_one_b(P, M)
    for r in range(P):
        fb = [op for op in s.ops[r] if op.kind != "W"]
        if fb != list(base.ops[r]):
            i = next((i for i, (a, b) in enumerate(zip(fb, base.ops[r])) if a != b),
                     min(len(fb), len(base.ops[r])))
            return "order", (f"P={P}, M={M}, rank {r}: without the W ops the list must be 1F1B's; at "
                    f"position {i} it has {fb[i] if i < len(fb) else 'nothing'!r}, 1F1B "
                    f"{base.ops[r][i] if i < len(base.ops[r]) else 'nothing'!r} (only place W ops)")
        missing = [Op("W", op.mb, op.stage) for op in fb if op.kind == "B"
                   and Op("W", op.mb, op.stage) not in s.ops[r]]
        if missing:
            return "split", (f"P={P}, M={M}, rank {r}: no {missing[0]!r}: every backward is split, so "
                    f"each B needs its W (else B is the fused backward)")
    limit = min(P, M)
    for r in range(P):
        live, pending = 0, []
        for op in s.ops[r]:
            if op.kind == "F":
                live += 1
                if live > limit:
                    return "memory", (f"P={P}, M={M}, rank {r}: at {op!r} {live} micro-batches are in flight, "
                            f"1F1B's peak is min(P, M) = {limit}: {pending[0]!r} must run before "
                            f"{op!r} (activations are freed at W)")
            elif op.kind == "B":
                pending.append(Op("W", op.mb, op.stage))
            else:
                if op != pending[0]:
                    return "oldest", (f"P={P}, M={M}, rank {r}: {op!r} runs before {pending[0]!r}: the W ops "
                            f"run oldest first, in the order of their B (ZB-H1's W of micro-batch "
                            f"i frees i's activations; a newer W first keeps the oldest alive)")
                live -= 1
                pending.remove(op)
    try:
        got = simulate(s, 1.0, 2.0, t_w=1.0)
    except PipelineDeadlock as e:
        return "valid", f"P={P}, M={M}: {e}"
    ref = zb_h1(P, M)
    want = simulate(ref, 1.0, 2.0, t_w=1.0)
    if got.makespan > want.makespan + 1e-9:
        return "bubble", (f"P={P}, M={M}: the step takes {got.makespan:g} units (bubble {got.bubble:.4f}) with "
                f"F = B = W = 1, ZB-H1 {want.makespan:g} (bubble {want.bubble:.4f}): "
                + _misplaced_w(s.ops, ref.ops, P))
    return None


def grade_zb_h1(fn, points: float = 3.0, cases=CASES, report: Report | None = None) -> Report:
    """One check per ``(P, M)`` of ``cases``, ``points`` in all; a failed one names its rule of
    :data:`ZB_RULES`."""
    report = report or Report("Part C: ZB-H1 from 1F1B", rules=ZB_RULES, default_rule="valid")
    share = points / (len(cases) + 1)   # the named cases and the generated ones: ``points`` in all
    for P, M in cases:
        report.check(f"ZB-H1 P={P}, M={M}: 1F1B's F/B order, W placed: memory and bubble",
                     lambda P=P, M=M: check_zb_h1(fn, P, M), points=share)
    generated_check(report, "P = 1-8, M = 1-24", st.tuples(st.integers(1, 8), st.integers(1, 24)),
                    lambda c: check_zb_h1(fn, *c), max_examples=40, crash_rule="valid",
                    describe=lambda c: "P={}, M={}".format(*c), points=share)
    return report
