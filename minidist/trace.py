"""A small per-rank timeline recorder: named intervals, for overlap and pipeline pictures.

    tl = Timeline()
    with tl.record("backward"):
        loss.backward()
    tl.events  # [Event(name="backward", start=0.0012, end=0.0410, lane="main"), ...]

Times are seconds since the Timeline was created (``time.perf_counter``), per process: compare
timelines of different ranks by their shapes, not by absolute clocks. ``lane`` groups events into
rows of a plot (e.g. "compute" and "comm"); it defaults to the recording thread's name. Recording
from several threads is safe (a DDP communication thread records beside backward).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import NamedTuple

__all__ = ["Event", "Timeline", "overlap_seconds"]


class Event(NamedTuple):
    name: str
    start: float  # seconds since the timeline's origin
    end: float
    lane: str = "main"

    @property
    def duration(self) -> float:
        return self.end - self.start


class Timeline:
    def __init__(self):
        self.origin = time.perf_counter()
        self.events: list[Event] = []
        self._lock = threading.Lock()

    def now(self) -> float:
        return time.perf_counter() - self.origin

    def add(self, name: str, start: float, end: float, lane: str | None = None) -> Event:
        lane = lane or threading.current_thread().name
        event = Event(name, start, end, "main" if lane == "MainThread" else lane)
        with self._lock:
            self.events.append(event)
        return event

    @contextlib.contextmanager
    def record(self, name: str, lane: str | None = None):
        start = self.now()
        try:
            yield
        finally:
            self.add(name, start, self.now(), lane)

    def clear(self) -> None:
        with self._lock:
            self.events.clear()
        self.origin = time.perf_counter()

    def total(self, prefix: str = "", lane: str | None = None) -> float:
        """Summed duration of the events whose name starts with ``prefix`` (and in ``lane``)."""
        return sum(e.duration for e in self.events
                   if e.name.startswith(prefix) and (lane is None or e.lane == lane))

    def as_dicts(self) -> list[dict]:
        return [e._asdict() for e in self.events]


def overlap_seconds(a: list[Event], b: list[Event]) -> float:
    """Seconds during which some event of ``a`` and some event of ``b`` both run (a's own
    events must not overlap each other, nor b's)."""
    total = 0.0
    for x in a:
        for y in b:
            total += max(0.0, min(x.end, y.end) - max(x.start, y.start))
    return total


_COLOURS = {"backward": "#4C72B0", "forward": "#55A868", "all-reduce": "#DD8452", "wait": "#C44E52",
            "optimizer": "#8172B2"}


def _colour(name: str) -> str:
    for prefix, colour in _COLOURS.items():
        if name.startswith(prefix):
            return colour
    return "#999999"


def plot_timeline(timelines, title: str = "", lanes: list[str] | None = None, ax=None,
                  labels: bool = True):
    """Draw per-rank timelines: one row per (rank, lane), one bar per event, time in ms.

    ``timelines``: a list with one entry per rank, each a list of :class:`Event` (or of tuples
    ``(name, start, end[, lane])``). Zero-length events are drawn as ticks (e.g. "bucket ready").
    Colours by name prefix: backward, forward, all-reduce, wait, optimizer. Returns the axes.
    """
    import matplotlib.pyplot as plt

    timelines = [[e if isinstance(e, Event) else Event(*e) for e in events] for events in timelines]
    rows = []
    for r, events in enumerate(timelines):
        present = list(dict.fromkeys(e.lane for e in events))
        for lane in (lanes if lanes is not None else present):
            rows.append((r, lane))
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 0.45 * len(rows) + 1.2), dpi=80)
    seen = set()
    for i, (r, lane) in enumerate(rows):
        for e in timelines[r]:
            if e.lane != lane:
                continue
            key = next((p for p in _COLOURS if e.name.startswith(p)), e.name)
            if e.end > e.start:
                ax.broken_barh([(1e3 * e.start, 1e3 * e.duration)], (i - 0.38, 0.76),
                               color=_colour(e.name), edgecolor="white", linewidth=0.5,
                               label=None if key in seen else key)
                seen.add(key)
                if labels and e.name.startswith("all-reduce") and " b" in e.name:
                    ax.text(1e3 * (e.start + e.end) / 2, i, e.name.rsplit(" ", 1)[-1], ha="center",
                            va="center", fontsize=6, color="white")
            else:
                ax.plot([1e3 * e.start] * 2, [i - 0.45, i + 0.45], color="black", linewidth=0.8)
    ax.set_yticks(range(len(rows)), [f"rank {r} {lane}" for r, lane in rows])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    if title:
        ax.set_title(title, loc="right", fontsize=9)
    if seen:
        ax.legend(loc="lower left", bbox_to_anchor=(0.0, 1.0), fontsize=7, ncols=len(seen),
                  frameon=False)
    return ax
