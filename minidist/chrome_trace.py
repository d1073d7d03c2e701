"""Per-rank timelines as Chrome trace-event JSON: open them in Perfetto (ui.perfetto.dev) or
``chrome://tracing``.

Every timeline minidist records is a list of :class:`minidist.trace.Event` — DDP's lanes (the
main thread's forward/backward/wait and the communication thread's ``all-reduce bN``), a
pipeline's ``F``/``B``/``W``/``send``/``recv`` (engine or simulator), a 3-D step
(:func:`minidist.hybrid.timeline.record_step`), ring attention's steps — and every one exports the
same way::

    from minidist.chrome_trace import write_chrome_trace
    write_chrome_trace(per_rank_events, "step.json")      # then drag step.json into Perfetto

The format is the Trace Event Format's JSON object form (Google's "Trace Event Format" document,
the one chrome://tracing and Perfetto's JSON importer read): ``{"traceEvents": [...],
"displayTimeUnit": "ms"}``, with

* one *process* per rank: ``pid`` = rank, named ``"rank r"`` by a ``process_name`` metadata event
  (``ph: "M"``) and ordered by ``process_sort_index``;
* one *thread* per lane (``tid`` numbered per rank in order of first appearance), named by a
  ``thread_name`` metadata event;
* one *complete event* (``ph: "X"``) per interval: ``ts`` its start and ``dur`` its length, in
  microseconds rounded to the nanosecond, the earliest event of the trace at 0; ``cat`` the lane; ``args`` the micro-batch
  and stage where they apply; an event shorter than a nanosecond (DDP's ``ready bN`` marks) becomes a
  thread-scoped *instant event* (``ph: "i"``, ``s: "t"``).

Complete events on one thread must nest (the viewers draw a thread as a stack of slices). Events
of one lane that overlap without nesting — a pipeline's ``send`` posted while a ``recv`` waits —
go to an extra thread named ``"<lane> (2)"``, ``"(3)"``..., so nothing is dropped or misdrawn.

Times: seconds by default (``us_per_unit=1e6``); a simulator's unit-less times with e.g.
``us_per_unit=1e3`` (one unit drawn as a millisecond).
"""

from __future__ import annotations

import json
import math
import os

from .trace import Event, align, as_events

__all__ = ["to_chrome_trace", "write_chrome_trace", "read_chrome_trace"]


def _tracks(spans: list[tuple[float, float]]) -> list[int]:
    """For (start, end) spans of one lane sorted by (start, -end): the track (0, 1, ...) of each,
    so that the spans of every track nest (each either contains the next or ends before it
    starts)."""
    stacks: list[list[float]] = []           # per track: the ends of the spans still open
    out = []
    for start, end in spans:
        for k, stack in enumerate(stacks):
            while stack and stack[-1] <= start:
                stack.pop()
            if not stack or end <= stack[-1]:
                stack.append(end)
                out.append(k)
                break
        else:
            stacks.append([end])
            out.append(len(stacks) - 1)
    return out


def _us(t: float, us_per_unit: float) -> float:
    """A time in µs, rounded to the nanosecond: equal times stay equal after scaling, so touching
    events do not overlap by a rounding error (which a viewer would draw as misnested)."""
    return round(t * us_per_unit, 3)


def to_chrome_trace(events, t0s=None, us_per_unit: float = 1e6, name: str = "minidist") -> dict:
    """The trace-event JSON object (a dict, ready for ``json.dump``) of per-rank timelines.

    Args:
        events: a flat list of :class:`~minidist.trace.Event` (their ``rank`` is the process), or
            one list per rank (of Events or ``(name, start, end[, lane])`` tuples; the rank is the
            index), as :func:`minidist.trace.plot_timeline` takes.
        t0s: with one list per rank, each rank's clock at its start (added first; see
            :func:`minidist.trace.align`).
        us_per_unit: microseconds per unit of the events' times (1e6: seconds).
        name: put in ``otherData`` (the viewers show it as the trace's metadata).

    Returns:
        ``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}``: ``M`` metadata,
        ``X`` complete and ``i`` instant events (see the module docstring).

    Raises:
        ValueError: a time that is not finite, an event that ends before it starts, or a
            non-positive ``us_per_unit``.
    """
    if not (isinstance(us_per_unit, (int, float)) and math.isfinite(us_per_unit) and us_per_unit > 0):
        raise ValueError(f"to_chrome_trace: us_per_unit must be a positive number, got {us_per_unit!r}")
    flat = as_events(events)
    for e in flat:
        if not (math.isfinite(e.start) and math.isfinite(e.end)):
            raise ValueError(f"to_chrome_trace: event {e.name!r} of rank {e.rank} has a non-finite "
                             f"time (start {e.start}, end {e.end})")
        if e.end < e.start:
            raise ValueError(f"to_chrome_trace: event {e.name!r} of rank {e.rank} ends before it "
                             f"starts (start {e.start}, end {e.end})")
    if t0s is not None:
        flat = align([[e for e in flat if e.rank == r] for r in range(len(t0s))], t0s)
    else:
        flat = align(flat)
    flat.sort(key=lambda e: (e.rank, e.start, -e.end))
    trace: list[dict] = []
    tids: dict[tuple[int, str], int] = {}
    for rank in sorted({e.rank for e in flat}):
        trace.append({"ph": "M", "pid": rank, "tid": 0, "name": "process_name",
                      "args": {"name": f"rank {rank}"}})
        trace.append({"ph": "M", "pid": rank, "tid": 0, "name": "process_sort_index",
                      "args": {"sort_index": rank}})
        mine = [e for e in flat if e.rank == rank]
        for lane in dict.fromkeys(e.lane for e in mine):
            in_lane = [e for e in mine if e.lane == lane]
            spans = [(_us(e.start, us_per_unit), _us(e.end, us_per_unit)) for e in in_lane]
            order = sorted(range(len(in_lane)), key=lambda i: (spans[i][0], -spans[i][1]))
            in_lane, spans = [in_lane[i] for i in order], [spans[i] for i in order]
            for e, (ts, end), track in zip(in_lane, spans, _tracks(spans)):
                label = lane if track == 0 else f"{lane} ({track + 1})"
                if (rank, label) not in tids:
                    tid = tids[rank, label] = sum(1 for r, _ in tids if r == rank)
                    trace.append({"ph": "M", "pid": rank, "tid": tid, "name": "thread_name",
                                  "args": {"name": label}})
                    trace.append({"ph": "M", "pid": rank, "tid": tid, "name": "thread_sort_index",
                                  "args": {"sort_index": tid}})
                args = {k: v for k, v in (("mb", e.mb), ("stage", e.stage)) if v >= 0}
                item = {"name": e.name, "cat": lane, "pid": rank, "tid": tids[rank, label],
                        "ts": ts, "args": args}
                if end > ts:
                    item.update(ph="X", dur=round(end - ts, 3))
                else:
                    item.update(ph="i", s="t")
                trace.append(item)
    return {"traceEvents": trace, "displayTimeUnit": "ms",
            "otherData": {"producer": name, "us_per_unit": us_per_unit}}


def write_chrome_trace(events, path: str | os.PathLike, **kwargs) -> str:
    """Write :func:`to_chrome_trace` of ``events`` to ``path`` (JSON); returns the path."""
    with open(path, "w") as f:
        json.dump(to_chrome_trace(events, **kwargs), f)
    return os.fspath(path)


def read_chrome_trace(trace) -> list[Event]:
    """The Events of a trace written by :func:`to_chrome_trace` (a dict, or the path of its JSON):
    ``rank`` from ``pid``, ``lane`` from the thread's name (without a ``" (k)"`` overflow
    suffix), times back in the units written (``otherData.us_per_unit``). Sorted by (rank, start).
    Metadata events are read, not returned; events of other phases are ignored."""
    if not isinstance(trace, dict):
        with open(trace) as f:
            trace = json.load(f)
    scale = float(trace.get("otherData", {}).get("us_per_unit", 1e6))
    names = {(t["pid"], t["tid"]): t["args"]["name"] for t in trace["traceEvents"]
             if t.get("ph") == "M" and t.get("name") == "thread_name"}
    out = []
    for t in trace["traceEvents"]:
        if t.get("ph") not in ("X", "i"):
            continue
        lane = names.get((t["pid"], t["tid"]), str(t["tid"]))
        if lane.endswith(")") and " (" in lane and lane.rsplit(" (", 1)[1][:-1].isdigit():
            lane = lane.rsplit(" (", 1)[0]
        start = t["ts"] / scale
        args = t.get("args", {})
        out.append(Event(t["name"], start, start + t.get("dur", 0.0) / scale, lane, t["pid"],
                         args.get("mb", -1), args.get("stage", -1)))
    return sorted(out, key=lambda e: (e.rank, e.start))
