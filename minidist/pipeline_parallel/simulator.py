"""A pure-Python pipeline simulator: the timeline, bubble and activation memory of a schedule.

No processes: each rank runs its op list; an op starts when the rank is free and its dependency
(the engine's receive) is done. A schedule it cannot finish raises :class:`PipelineDeadlock`.
Design notes: docs/design/pipeline_parallel.md
"""

from __future__ import annotations

from dataclasses import dataclass

from .schedules import Op, Schedule
from ..trace import Event, bubble_fraction

__all__ = ["simulate", "SimResult", "PipelineDeadlock", "peak_inflight", "peak_bytes",
           "bubble_formula", "message_order_mismatches", "messages", "link_costs"]


class PipelineDeadlock(RuntimeError):
    """The schedule's orders wait on each other in a circle; ``waiting`` maps rank -> (op, needed op)."""

    def __init__(self, message: str, waiting: dict):
        super().__init__(message)
        self.waiting = waiting


@dataclass
class SimResult:
    """``events``, ``makespan``, ``bubble``, ``peak_inflight`` {stage: peak}, and ``messages``
    ``(time, src, dst, "act"|"grad", mb, from_stage)``."""

    schedule: Schedule
    events: list
    makespan: float
    bubble: float
    peak_inflight: dict
    messages: tuple | list = ()

    def plot(self, ax=None, title: str | None = None, time_unit: str = "units"):
        from ..trace import plot_timeline
        return plot_timeline(self.events, ax=ax, title=title or f"simulated {self.schedule.name}, "
                             f"P={self.schedule.P}, M={self.schedule.M}", n_ranks=self.schedule.P,
                             time_unit=time_unit)


def bubble_formula(P: int, M: int, v: int = 1) -> float:
    """Equal costs, no communication: ``(P-1)/(v·M + P-1)`` (Narayanan et al. 2021, §2.2.2)."""
    return (P - 1) / (v * M + P - 1)


def _dependency(op: Op, n_stages: int) -> Op | None:
    if op.kind == "F":
        return Op("F", op.mb, op.stage - 1) if op.stage > 0 else None
    if op.kind == "W":
        return Op("B", op.mb, op.stage)
    if op.stage == n_stages - 1:
        return Op("F", op.mb, op.stage)
    return Op("B", op.mb, op.stage + 1)


def peak_inflight(schedule: Schedule) -> dict:
    """{stage: peak number of micro-batches with saved activations} from the op order alone."""
    return peak_bytes(schedule, lambda mb, stage: 1)


def peak_bytes(schedule: Schedule, bytes_of) -> dict:
    """{stage: peak saved-activation bytes}, ``bytes_of(mb, stage)`` held from F to B (or W)."""
    peak: dict = {}
    for r, row in enumerate(schedule.ops):
        split = schedule.split(r)
        live: dict = {}
        for op in row:
            frees = op.kind == "W" or (op.kind == "B" and (op.mb, op.stage) not in split)
            step = bytes_of(op.mb, op.stage) if op.kind == "F" else (
                -bytes_of(op.mb, op.stage) if frees else 0)
            live[op.stage] = live.get(op.stage, 0) + step
            peak[op.stage] = max(peak.get(op.stage, 0), live[op.stage])
    return dict(sorted(peak.items()))


def link_costs(topology, nbytes: float):
    """``t_comm`` for :func:`simulate`: a message of ``nbytes`` from pipeline rank ``src`` to
    ``dst`` costs its link class's ``alpha + nbytes · beta`` (a
    :class:`minidist.comm.topology.Topology`; pipeline rank r is global rank r)."""
    return lambda src, dst: topology.cost(topology.link(src, dst)).seconds(nbytes)


def simulate(schedule: Schedule, t_f: float = 1.0, t_b: float = 2.0, t_comm=0.0,
             t_w: float | None = None, t_gap: float = 0.0, t_sync: float = 0.0,
             t_exposed: float = 0.0, overlap_pairs: bool = False) -> SimResult:
    """Run ``schedule`` in simulated time; costs per micro-batch and rank, or {stage: seconds}.

    ``t_comm``: seconds from the end of an op to its result on another rank: a number, or
    ``t_comm(src_rank, dst_rank)`` per link (:func:`link_costs`: alpha + bytes · beta per link
    class, Hockney 1994). ``t_gap``: per-op overhead; ``t_sync``: a global sync after the last op;
    ``t_exposed``: communication inside each F/B, hidden for F-B pairs with ``overlap_pairs``
    (DualPipe, §3.2.1). Raises ``PipelineDeadlock`` (a circular wait) and ``ValueError``
    (negative costs, ``t_w > t_b``)."""
    P, v, n_stages = schedule.P, schedule.v, schedule.n_stages
    comm = t_comm if callable(t_comm) else (lambda src, dst: t_comm)

    def per_stage(c):  # a number, or {stage: op cost} (measured, one chunk: not divided by v)
        return dict(c) if isinstance(c, dict) else {s: c / v for s in range(n_stages)}

    f, b = per_stage(t_f), per_stage(t_b)
    w = {s: b[s] / 2 for s in b} if t_w is None else per_stage(t_w)
    bad = [s for s in range(n_stages) if min(f[s], b[s], w[s]) < 0 or w[s] > b[s]]
    if (not callable(t_comm) and t_comm < 0) or t_gap < 0 or t_sync < 0 or t_exposed < 0 or bad:
        raise ValueError(f"simulate: costs must be >= 0 and t_w <= t_b (W is part of the backward), "
                         f"got t_f={t_f}, t_b={t_b}, t_w={t_w}, t_comm={t_comm}")
    splits = [schedule.split(r) for r in range(P)]
    hidden: list[set] = [set() for _ in range(P)]  # list positions whose communication a pair hides
    for r, row in enumerate(schedule.ops):
        for i in range(len(row) - 1):
            if overlap_pairs and row[i].kind == "F" and row[i + 1].kind == "B" \
                    and row[i].stage != row[i + 1].stage and i not in hidden[r]:
                hidden[r] |= {i, i + 1}
    cost = {(k, s): c for s in range(n_stages)
            for k, c in (("F", f[s]), ("B", b[s]), ("W", w[s]), ("Bi", b[s] - w[s]))}
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
                src = None if dep is None else schedule.owner(dep.stage)
                ready = 0.0 if dep is None else done[dep] + (comm(src, r) if src != r else 0.0)
                start = max(free[r] + (t_gap if ptr[r] else 0.0), ready)
                kind = "Bi" if op.kind == "B" and (op.mb, op.stage) in splits[r] else op.kind
                end = start + cost[(kind, op.stage)] + (
                    t_exposed / v if kind != "W" and ptr[r] not in hidden[r] else 0.0)
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
    if t_sync:
        last_op = max(e.end for e in events)
        events += [Event("sync", free[r], last_op + t_sync, rank=r) for r in range(P)]
    events.sort(key=lambda e: (e.rank, e.start))
    makespan = max(e.end for e in events)
    return SimResult(schedule, events, makespan, bubble_fraction(events, P), peak_inflight(schedule),
                     messages(schedule, events))


def messages(schedule: Schedule, events) -> list[tuple]:
    """The sends of a timeline in time order: ``(time, src, dst, "act"|"grad", mb, from_stage)``
    (hand-offs inside one rank left out)."""
    last, out = schedule.n_stages - 1, []
    for e in events:
        if e.kind == "F" and e.stage < last:
            dst, kind = schedule.owner(e.stage + 1), "act"
        elif e.kind == "B" and e.stage > 0:
            dst, kind = schedule.owner(e.stage - 1), "grad"
        else:
            continue
        if dst != e.rank:
            out.append((e.end, e.rank, dst, kind, e.mb, e.stage))
    return sorted(out)


def message_order_mismatches(schedule: Schedule) -> list[tuple]:
    """Rank pairs whose messages are sent in another order than received (NCCL matches in
    issue order): ``[(src, dst, sent, received), ...]``; empty for GPipe and both 1F1B."""
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
            elif op.kind == "B":
                if op.stage < last:
                    recvd.setdefault((schedule.owner(op.stage + 1), r), []).append(
                        ("grad", op.mb, op.stage + 1))
                if op.stage > 0:
                    sent.setdefault((r, schedule.owner(op.stage - 1)), []).append(
                        ("grad", op.mb, op.stage))
    return [(a, b, sent.get((a, b), []), recvd.get((a, b), []))
            for a, b in sorted(set(sent) | set(recvd))
            if a != b and sent.get((a, b), []) != recvd.get((a, b), [])]
