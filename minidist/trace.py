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
