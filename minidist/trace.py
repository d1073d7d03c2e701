"""Per-rank timelines: named intervals for overlap pictures (DDP) and pipeline Gantt charts.

    tl = Timeline()
    with tl.record("backward"):          # a span the caller times
        loss.backward()
    with tl.observe():                   # and the library's own spans, from every thread
        ddp(x).sum().backward()          # "all-reduce b0" ... on the comm lane, "wait" on main

The library marks what it does with :func:`span` (a bucket's all-reduce, a ring step's compute
and wait, a pipeline send): nothing is timed unless a Timeline observes. Times: seconds since the
Timeline was created, per process; ``lane``: the plot row (default the thread's name). Bubble
fraction: ``1 - (Σ_r busy_r) / (P · span)`` (Huang et al. 2019, §2.3).

Design notes: docs/design/ground.md"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import NamedTuple

__all__ = ["Event", "Timeline", "span", "mark", "COMPUTE", "align", "as_events", "busy_time", "bubble_fraction",
           "plot_timeline"]

COMPUTE = ("F", "B", "W")  # a pipeline's compute ops (W: weight gradients); everything else is bubble


class Event(NamedTuple):
    """One interval on one rank's timeline (seconds, or simulator time units)."""

    name: str            # "backward", "all-reduce b3", ...; pipelines: "F", "B", "send", "recv", ...
    start: float
    end: float
    lane: str = "main"   # plot row within the rank (e.g. the recording thread)
    rank: int = 0
    mb: int = -1         # micro-batch (pipelines; -1 when it does not apply)
    stage: int = -1      # pipeline stage (-1 when it does not apply)

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def kind(self) -> str:
        """The pipeline op (the name), in the pipeline code's vocabulary."""
        return self.name


class Timeline:
    def __init__(self):
        self.origin = time.perf_counter()
        self.events: list[Event] = []
        self._lock = threading.Lock()

    def now(self) -> float:
        return time.perf_counter() - self.origin

    def add(self, name: str, start: float, end: float, lane: str | None = None,
            **fields) -> Event:
        """Append an Event (``fields``: its ``rank``, ``mb``, ``stage``)."""
        lane = lane or threading.current_thread().name
        event = Event(name, start, end, "main" if lane == "MainThread" else lane, **fields)
        with self._lock:
            self.events.append(event)
        return event

    @contextlib.contextmanager
    def observe(self):
        """Inside, every :func:`span` of the library (any thread) is also an Event here."""
        _OBSERVERS.append(self)
        try:
            yield self
        finally:
            _OBSERVERS.remove(self)

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


_OBSERVERS: list[Timeline] = []   # the timelines inside their observe()


@contextlib.contextmanager
def span(name: str, lane: str | None = None, **fields):
    """The block as Event ``name`` on every observing :class:`Timeline` (none: untimed)."""
    if not _OBSERVERS:
        yield
        return
    start = time.perf_counter()
    try:
        yield
    finally:
        end = time.perf_counter()
        for tl in list(_OBSERVERS):
            tl.add(name, start - tl.origin, end - tl.origin, lane, **fields)


def mark(name: str, lane: str | None = None, **fields) -> None:
    """A zero-length Event ``name`` now, on every observing :class:`Timeline`."""
    for tl in list(_OBSERVERS):
        t = tl.now()
        tl.add(name, t, t, lane, **fields)


def align(events, t0s=None) -> list[Event]:
    """Events of several ranks on one axis, earliest at 0, by (rank, start); ``t0s``: each rank's start."""
    per_rank = isinstance(events, (list, tuple)) and bool(events) and \
        isinstance(events[0], (list, tuple)) and not isinstance(events[0], Event)
    if t0s is not None:
        if not per_rank or len(t0s) != len(events):
            raise ValueError(f"align: t0s needs one list of events per rank, got {len(t0s)} "
                             f"offsets for {len(events) if per_rank else 'a flat list of'} events")
        events = [[e._replace(start=e.start + t0, end=e.end + t0) for e in evs]
                  for evs, t0 in zip(events, t0s)]
    flat = [e for evs in events for e in evs] if per_rank else list(events)
    if not flat:
        return []
    base = min(e.start for e in flat)
    return sorted((e._replace(start=e.start - base, end=e.end - base) for e in flat),
                  key=lambda e: (e.rank, e.start))


def _span(events) -> tuple[float, float]:
    if not events:
        raise ValueError("bubble_fraction: no events")
    return min(e.start for e in events), max(e.end for e in events)


def busy_time(events, rank: int) -> float:
    """Total compute (F + B + W) time of ``rank``."""
    return sum(e.duration for e in events if e.rank == rank and e.name in COMPUTE)


def bubble_fraction(events, n_ranks: int | None = None) -> float:
    """``1 - Σ busy / (P · span)`` over the events (see the module docstring)."""
    t0, t1 = _span(events)
    ranks = range(n_ranks) if n_ranks is not None else sorted({e.rank for e in events})
    if t1 <= t0:
        return 0.0
    busy = sum(busy_time(events, r) for r in ranks)
    return 1.0 - busy / (len(ranks) * (t1 - t0))


# colour and legend label by name prefix (first match)
_STYLE = {"F": ("#4C72B0", "forward"), "B": ("#55A868", "backward"),
          "W": ("#CCB974", "weight gradient"),
          "backward": ("#4C72B0", "backward"), "forward": ("#55A868", "forward"),
          "all-reduce": ("#DD8452", "all-reduce"), "wait": ("#C44E52", "wait"),
          "optimizer": ("#8172B2", "optimizer"), "data": ("#937860", "waiting for data")}
_THIN = ("#999999", "send / recv")  # a pipeline's communication, drawn under its rank's row


def _style(name: str) -> tuple[str, str]:
    if name in _STYLE:
        return _STYLE[name]
    return next((v for k, v in _STYLE.items() if len(k) > 1 and name.startswith(k)),
                ("#999999", name))


def as_events(events) -> list[Event]:
    """A flat list of Events; one list per rank (of Events or tuples) gets its ranks from the index."""
    if events and not isinstance(events[0], Event) and isinstance(events[0], (list, tuple)) \
            and (not events[0] or isinstance(events[0][0], (Event, list, tuple))):
        return [(e if isinstance(e, Event) else Event(*e))._replace(rank=r)
                for r, per_rank in enumerate(events) for e in per_rank]
    return [e if isinstance(e, Event) else Event(*e) for e in events]


def plot_timeline(events, title: str = "", lanes: list[str] | None = None, ax=None,
                  labels: bool = True, n_ranks: int | None = None, show_comm: bool = True,
                  time_unit: str | None = None, label_fontsize: int = 7):
    """Gantt chart of per-rank timelines, rank 0 on top. Returns the matplotlib Axes.

    ``events``: a flat list of :class:`Event`, or one list per rank (of Events or ``(name, start,
    end[, lane])``). Pipeline timelines (``"F"``/``"B"``): one row per rank, the bubble fraction in
    the title, times in ``time_unit``; others: one row per (rank, lane) (``lanes``), times in ms."""
    import matplotlib.pyplot as plt

    events = as_events(events)
    pipeline = any(e.name in COMPUTE for e in events)
    P = n_ranks if n_ranks is not None else max((e.rank for e in events), default=-1) + 1
    rows = [(r, None) for r in range(P)] if pipeline else [
        (r, lane) for r in range(P) for lane in
        (lanes if lanes is not None else dict.fromkeys(e.lane for e in events if e.rank == r))]
    y_of = {row: len(rows) - 1 - i for i, row in enumerate(rows)}  # first row on top
    (t0, t1), scale = (_span(events), 1.0) if pipeline else ((0.0, 0.0), 1e3)
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.5 if pipeline else 0.45 * len(rows) + 1.2), dpi=80)
    legend: dict = {}
    for e in events:
        y = y_of.get((e.rank, None if pipeline else e.lane))
        if y is None:
            continue
        x, w = scale * (e.start - t0), scale * e.duration
        if pipeline and e.name not in COMPUTE:
            if show_comm:
                ax.broken_barh([(x, max(w, 1e-9))], (y - 0.5, 0.08), facecolors=_THIN[0])
                legend.setdefault(_THIN[1], _THIN[0])
        elif w <= 0:
            ax.plot([x] * 2, [y - 0.45, y + 0.45], color="black", linewidth=0.8)
        else:
            colour, label = _style(e.name)
            ax.broken_barh([(x, w)], (y - 0.4, 0.8), facecolors=colour, edgecolors="white",
                           linewidth=0.5)
            legend.setdefault(label, colour)
            text = (str(e.mb) if w > 0.012 * (t1 - t0) else None) if pipeline else \
                (e.name.rsplit(" ", 1)[-1] if labels and e.name.startswith("all-reduce")
                 and " b" in e.name else None)
            if text:
                ax.text(x + w / 2, y, text, ha="center", va="center", color="white",
                        fontsize=label_fontsize if pipeline else 6)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"rank {r}" + (f" {lane}" if lane is not None else "")
                        for r, lane in reversed(rows)])
    ax.set_xlabel(f"time ({time_unit or ('s' if pipeline else 'ms')})")
    if pipeline:
        ax.set_xlim(0, t1 - t0)
        title = f"{title + ' — ' if title else ''}bubble {bubble_fraction(events, P):.1%}"
    _decorate(ax, title, legend, pipeline)
    return ax


def _decorate(ax, title: str, legend: dict, pipeline: bool) -> None:
    """Title and legend: right of the axes for a pipeline; above it (title right) for lanes."""
    from matplotlib.patches import Patch

    if title:
        ax.set_title(title, fontsize=10) if pipeline else ax.set_title(title, loc="right", fontsize=9)
    handles = [Patch(color=c, label=k) for k, c in legend.items()]
    if handles and pipeline:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7,
                  frameon=False)
    elif handles:
        ax.legend(handles=handles, loc="lower left", bbox_to_anchor=(0.0, 1.0), fontsize=7,
                  ncols=len(handles), frameon=False)
