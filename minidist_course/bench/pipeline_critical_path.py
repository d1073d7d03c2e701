"""Where a pipeline step's time goes: its critical path, split into compute, messages and gaps.

A step ends when its last op ends. Walking back from that op, each op started either when its
input arrived (the op it depends on, on another rank, ended — then a **message** separates them)
or when its rank finished the op before it (then a **gap**: the engine's own time between two ops).
Following the later of the two at every op gives the chain of ops that decided the step's length;
its length is exactly the step's span, and it splits into

* **compute**: the durations of the ops on the chain,
* **messages**: the waits for inputs from other ranks (send → receive → the op starts),
* **gaps**: the time between two ops of one rank that the chain runs through,
* **start**: how late the chain's first op started after the step's first op (clock alignment).

The same walk over the simulator's timeline with the measured costs says where the model thinks
the time goes; the difference between the two is what the model leaves out. A constant message
latency (the simulator's ``t_comm``, a median) cannot see a few slow messages on the chain — the
usual reason a measured bubble sits above the simulated one on a loaded machine.

Source: the critical-path method (Kelley & Walker 1959), as profilers apply it to distributed
traces (e.g. Holistic Trace Analysis's critical path analysis, pytorch/HolisticTraceAnalysis).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["CriticalPath", "critical_path"]


@dataclass
class CriticalPath:
    """The chain of ops that decided a step's span (seconds, or simulator units)."""

    span: float                  # last op's end − first op's start
    compute: float               # Σ durations of the chain's ops
    messages: float              # Σ waits for another rank's output
    gaps: float                  # Σ idle between two consecutive ops of one rank on the chain
    start: float                 # the chain's first op's start − the step's first op's start
    ops: list = field(default_factory=list)       # (kind, mb, stage, rank), first to last
    waits: list = field(default_factory=list)     # each message's wait, in chain order
    links: list = field(default_factory=list)     # ("message" | "gap", seconds, op before, op after)

    def line(self, unit: float = 1e3, name: str = "ms") -> str:
        hops = len(self.waits)
        worst = f", longest {max(self.waits) * unit:.1f}" if self.waits else ""
        return (f"span {self.span * unit:.1f} {name} = compute {self.compute * unit:.1f} + "
                f"messages {self.messages * unit:.1f} ({hops} on the path{worst}) + gaps "
                f"{self.gaps * unit:.1f} + start {self.start * unit:.1f}")


def _dependency(kind: str, mb: int, stage: int, n_stages: int):
    """The op whose output ``(kind, mb, stage)`` needs (None: none; W needs its own B, on the
    same rank, which the previous-op link covers)."""
    if kind == "F":
        return ("F", mb, stage - 1) if stage > 0 else None
    if kind == "B":
        return ("F", mb, stage) if stage == n_stages - 1 else ("B", mb, stage + 1)
    return None


def critical_path(events, n_stages: int) -> CriticalPath:
    """The critical path of one step's timeline: ``events`` with ``name`` in ``F``/``B``/``W``
    (others ignored), ``rank``, ``mb``, ``stage``, ``start``, ``end`` — an engine's recorded
    timeline (aligned across ranks) or :func:`~minidist.pipeline_parallel.simulator.simulate`'s.

    Raises:
        ValueError: no compute op in ``events``, or an op's input is missing from them.
    """
    ops = [e for e in events if e.name in ("F", "B", "W")]
    if not ops:
        raise ValueError("critical_path: the timeline has no F, B or W op")
    by_key = {(e.name, e.mb, e.stage): e for e in ops}
    prev = {}
    for r in {e.rank for e in ops}:
        mine = sorted((e for e in ops if e.rank == r), key=lambda e: (e.start, e.end))
        prev.update({id(b): a for a, b in zip(mine, mine[1:])})
    t0 = min(e.start for e in ops)
    e = max(ops, key=lambda e: e.end)
    out = CriticalPath(span=e.end - t0, compute=0.0, messages=0.0, gaps=0.0, start=0.0)
    while True:
        out.compute += e.duration
        out.ops.append((e.name, e.mb, e.stage, e.rank))
        dep_key = _dependency(e.name, e.mb, e.stage, n_stages)
        if dep_key is not None and dep_key not in by_key:
            raise ValueError(f"critical_path: {e.name} of micro-batch {e.mb}, stage {e.stage} "
                             f"needs {dep_key} which is not in the timeline")
        dep = by_key.get(dep_key) if dep_key else None
        before = prev.get(id(e))
        if dep is not None and dep.rank != e.rank and (before is None or dep.end >= before.end):
            wait = max(0.0, e.start - dep.end)
            out.messages += wait
            out.waits.append(wait)
            out.links.append(("message", e.start - dep.end, _op(dep), _op(e)))
            out.gaps += (e.start - dep.end) - wait   # negative skew (clock alignment) kept exact
            e = dep
        elif before is not None:
            out.gaps += e.start - before.end
            out.links.append(("gap", e.start - before.end, _op(before), _op(e)))
            e = before
        else:
            out.start = e.start - t0
            break
    out.ops.reverse()
    out.waits.reverse()
    out.links.reverse()
    return out


def _op(e) -> str:
    return f"{e.name}{e.mb}s{e.stage}@r{e.rank}"
