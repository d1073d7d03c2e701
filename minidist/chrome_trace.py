"""Per-rank timelines as Chrome trace-event JSON, for Perfetto (ui.perfetto.dev) or chrome://tracing.

    from minidist.chrome_trace import write_chrome_trace
    write_chrome_trace(per_rank_events, "step.json")      # then drag step.json into Perfetto

One process per rank, one thread per lane, one complete event (``ph: "X"``) per interval.

Design notes: docs/design/ground.md"""

from __future__ import annotations

import json
import math
import os

from .trace import Event, align, as_events

__all__ = ["to_chrome_trace", "write_chrome_trace", "read_chrome_trace"]


def _tracks(spans: list[tuple[float, float]]) -> list[int]:
    """The track (0, 1, ...) of each of one lane's sorted spans, so that each track's spans nest."""
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
    """A time in µs rounded to the nanosecond (touching events stay touching)."""
    return round(t * us_per_unit, 3)


def to_chrome_trace(events, t0s=None, us_per_unit: float = 1e6, name: str = "minidist") -> dict:
    """The trace-event JSON dict of per-rank timelines: ``events`` flat or one list per rank; ``t0s``
    each rank's start (:func:`minidist.trace.align`); ``us_per_unit`` (1e6: seconds); ``name`` into
    ``otherData``. ValueError: a non-finite time, an end before its start, ``us_per_unit`` <= 0.
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
    """The Events of a :func:`to_chrome_trace` dict or JSON file, in its units, by (rank, start)."""
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
