"""A pure-Python pipeline simulator: the timeline, bubble and activation memory of a schedule.

No processes, no tensors: each rank runs its op list in order; an op starts when the rank is free
and the op it depends on has finished (plus ``t_comm`` when that op ran on another rank):

* ``F(m, s)`` depends on ``F(m, s-1)`` (the activation), none for stage 0;
* ``B(m, s)`` depends on ``B(m, s+1)`` (the gradient); for the last stage on ``F(m, s)``.

This is the same dependency rule the engine enforces with its receives, so a schedule the
simulator finishes cannot deadlock in the engine, and one it cannot finish is a circular wait:
:class:`PipelineDeadlock` names each stuck rank, its stage and what it waits for.

Costs: ``t_f`` and ``t_b`` are one micro-batch's forward and backward through a whole rank's share
of the model; with ``v`` chunks per rank, each op costs ``t_f / v`` (or ``t_b / v``).

Peak in-flight activations of a stage: the largest number of micro-batches whose forward has run
on that stage and whose backward has not. It depends on the op order only, not on the costs.
"""

from __future__ import annotations

from dataclasses import dataclass

from .schedules import Op, Schedule
from ..trace import Event, bubble_fraction

__all__ = ["simulate", "SimResult", "PipelineDeadlock", "peak_inflight", "bubble_formula",
           "message_order_mismatches"]


class PipelineDeadlock(RuntimeError):
    """The schedule's orders wait on each other in a circle; ``waiting`` maps rank -> (op, needed op)."""

    def __init__(self, message: str, waiting: dict):
        super().__init__(message)
        self.waiting = waiting


@dataclass
class SimResult:
    """``events``: the timeline; ``makespan``: its length; ``bubble``: see :func:`minidist.trace.bubble_fraction`;
    ``peak_inflight``: {stage: peak micro-batches of saved activations}."""

    schedule: Schedule
    events: list
    makespan: float
    bubble: float
    peak_inflight: dict

    def plot(self, ax=None, title: str | None = None, time_unit: str = "units"):
        from ..trace import plot_timeline
        return plot_timeline(self.events, ax=ax, title=title or f"simulated {self.schedule.name}, "
                             f"P={self.schedule.P}, M={self.schedule.M}", n_ranks=self.schedule.P,
                             time_unit=time_unit)


def bubble_formula(P: int, M: int, v: int = 1) -> float:
    """Closed form for equal costs and no communication time: ``(P-1)/(v·M + P-1)``.

    v=1: GPipe and 1F1B (GPipe paper §2.3). v>1: interleaved 1F1B shrinks the bubble's share of
    the ideal time by v (Narayanan et al. 2021, §2.2.2).
    """
    return (P - 1) / (v * M + P - 1)


def _dependency(op: Op, n_stages: int) -> Op | None:
    if op.kind == "F":
        return Op("F", op.mb, op.stage - 1) if op.stage > 0 else None
    if op.stage == n_stages - 1:
        return Op("F", op.mb, op.stage)
    return Op("B", op.mb, op.stage + 1)


def peak_inflight(schedule: Schedule) -> dict:
    """{stage: peak number of micro-batches with saved activations} from the op order alone."""
    peak: dict = {}
    for row in schedule.ops:
        live: dict = {}
        for op in row:
            live[op.stage] = live.get(op.stage, 0) + (1 if op.kind == "F" else -1)
            peak[op.stage] = max(peak.get(op.stage, 0), live[op.stage])
    return dict(sorted(peak.items()))


def simulate(schedule: Schedule, t_f: float = 1.0, t_b: float = 2.0, t_comm: float = 0.0) -> SimResult:
    """Run ``schedule`` in simulated time. Costs per micro-batch per rank (see module docstring).

    Raises:
        PipelineDeadlock: the ranks' orders wait on each other in a circle.
        ValueError: negative costs.
    """
    if min(t_f, t_b, t_comm) < 0:
        raise ValueError(f"simulate: costs must be >= 0, got t_f={t_f}, t_b={t_b}, t_comm={t_comm}")
    P, v, n_stages = schedule.P, schedule.v, schedule.n_stages
    cost = {"F": t_f / v, "B": t_b / v}
    ptr = [0] * P
    free = [0.0] * P
    done: dict = {}  # op -> end time
    events = []
    remaining = sum(len(row) for row in schedule.ops)
    while remaining:
        progressed = False
        for r in range(P):
            row = schedule.ops[r]
            while ptr[r] < len(row):  # run this rank as far as its dependencies allow
                op = row[ptr[r]]
                dep = _dependency(op, n_stages)
                if dep is not None and dep not in done:
                    break
                ready = 0.0 if dep is None else done[dep] + (
                    t_comm if schedule.owner(dep.stage) != r else 0.0)
                start = max(free[r], ready)
                end = start + cost[op.kind]
                events.append(Event(op.kind, start, end, rank=r, mb=op.mb, stage=op.stage))
                done[op] = free[r] = end
                ptr[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            waiting = {r: (schedule.ops[r][ptr[r]], _dependency(schedule.ops[r][ptr[r]], n_stages))
                       for r in range(P) if ptr[r] < len(schedule.ops[r])}
            lines = [f"rank {r} (stage {op.stage}) is stuck at {op!r}, waiting for {dep!r} "
                     f"from stage {dep.stage} on rank {schedule.owner(dep.stage)}"
                     for r, (op, dep) in waiting.items()]
            raise PipelineDeadlock(f"schedule {schedule.name} (P={P}, M={schedule.M}) deadlocks: "
                                   "the ranks wait on each other in a circle.\n  " + "\n  ".join(lines),
                                   waiting)
    events.sort(key=lambda e: (e.rank, e.start))
    makespan = max(e.end for e in events)
    return SimResult(schedule, events, makespan, bubble_fraction(events, P), peak_inflight(schedule))


def message_order_mismatches(schedule: Schedule) -> list[tuple]:
    """Rank pairs whose messages are sent in a different order than the receiver asks for them.

    Gloo matches point-to-point messages by tag, so the engine works whatever the order; NCCL
    ignores tags and matches the messages between two ranks in the order they were issued. A
    schedule is safe there only if, for every pair (a, b), the activations and gradients ``a``
    sends to ``b`` (in ``a``'s op order) are the ones ``b`` receives (in ``b``'s op order). Returns
    ``[(src, dst, sent, received), ...]``; empty for GPipe, 1F1B and interleaved 1F1B.
    """
    last = schedule.n_stages - 1
    sent: dict = {}
    recvd: dict = {}
    for r, row in enumerate(schedule.ops):
        for op in row:
            if op.kind == "F":
                if op.stage > 0:
                    recvd.setdefault((schedule.owner(op.stage - 1), r), []).append(
                        ("act", op.mb, op.stage - 1))
                if op.stage < last:
                    sent.setdefault((r, schedule.owner(op.stage + 1)), []).append(
                        ("act", op.mb, op.stage))
            else:
                if op.stage < last:
                    recvd.setdefault((schedule.owner(op.stage + 1), r), []).append(
                        ("grad", op.mb, op.stage + 1))
                if op.stage > 0:
                    sent.setdefault((r, schedule.owner(op.stage - 1)), []).append(
                        ("grad", op.mb, op.stage))
    return [(a, b, sent.get((a, b), []), recvd.get((a, b), []))
            for a, b in sorted(set(sent) | set(recvd))
            if a != b and sent.get((a, b), []) != recvd.get((a, b), [])]
