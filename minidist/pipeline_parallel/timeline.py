"""Timelines of pipeline runs (simulated or measured), the bubble fraction, and a Gantt chart.

An :class:`Event` is one interval on one rank: a forward ``F`` or backward ``B`` of micro-batch
``mb`` through ``stage``, or a communication interval (``send``, ``recv``, ``wait``). The
simulator and the engine both produce lists of events, so one plot and one bubble formula serve
both.

**Bubble fraction (the definition this course uses).** Over the span of the step (from the first
event on any rank to the last), the fraction of time a rank does no compute (no F or B),
averaged over ranks::

    bubble = 1 - (Σ_r busy_r) / (P · span)

Communication and waiting count as bubble: they are time the rank is not computing. With equal
stage costs, GPipe and 1F1B give ``(P-1)/(M+P-1)`` (GPipe paper, Huang et al. 2019, §2.3; the
ratio to compute alone is ``(P-1)/M``, Narayanan et al. 2021 — another common definition).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Event", "bubble_fraction", "busy_time", "plot_timeline", "COMPUTE"]

COMPUTE = ("F", "B")


@dataclass(frozen=True)
class Event:
    """One interval on one rank. ``start``/``end`` in seconds (or simulator time units)."""

    rank: int
    kind: str  # "F", "B", "send", "recv", "wait"
    mb: int
    stage: int
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


def _span(events) -> tuple[float, float]:
    if not events:
        raise ValueError("bubble_fraction: no events")
    return min(e.start for e in events), max(e.end for e in events)


def busy_time(events, rank: int) -> float:
    """Total compute (F + B) time of ``rank``."""
    return sum(e.duration for e in events if e.rank == rank and e.kind in COMPUTE)


def bubble_fraction(events, n_ranks: int | None = None) -> float:
    """``1 - Σ busy / (P · span)`` over the events (see the module docstring)."""
    t0, t1 = _span(events)
    ranks = range(n_ranks) if n_ranks is not None else sorted({e.rank for e in events})
    if t1 <= t0:
        return 0.0
    busy = sum(busy_time(events, r) for r in ranks)
    return 1.0 - busy / (len(ranks) * (t1 - t0))


_COLORS = {"F": "#4C72B0", "B": "#55A868"}
_COMM = "#999999"


def plot_timeline(events, ax=None, title: str | None = None, show_comm: bool = True,
                  n_ranks: int | None = None, time_unit: str = "s", label_fontsize: int = 7):
    """Gantt chart: one row per rank (rank 0 on top), F in blue, B in green, labels = micro-batch.

    Blank space is the bubble. With ``show_comm``, send/recv/wait intervals are drawn as thin grey
    bars under each row. The legend sits right of the axes. Returns the matplotlib Axes.
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.5), dpi=80)
    t0, t1 = _span(events)
    P = n_ranks if n_ranks is not None else max(e.rank for e in events) + 1
    for e in events:
        y = P - 1 - e.rank
        if e.kind in COMPUTE:
            ax.broken_barh([(e.start - t0, e.duration)], (y - 0.4, 0.8),
                           facecolors=_COLORS[e.kind], edgecolors="white", linewidth=0.5)
            if e.duration > 0.012 * (t1 - t0):
                ax.text(e.start - t0 + e.duration / 2, y, str(e.mb), ha="center", va="center",
                        color="white", fontsize=label_fontsize)
        elif show_comm:
            ax.broken_barh([(e.start - t0, max(e.duration, 1e-9))], (y - 0.5, 0.08),
                           facecolors=_COMM)
    ax.set_yticks(range(P))
    ax.set_yticklabels([f"rank {r}" for r in reversed(range(P))])
    ax.set_xlim(0, t1 - t0)
    ax.set_xlabel(f"time ({time_unit})")
    bubble = bubble_fraction(events, P)
    ax.set_title(f"{title + ' — ' if title else ''}bubble {bubble:.1%}", fontsize=10)
    from matplotlib.patches import Patch
    handles = [Patch(color=_COLORS["F"], label="forward"), Patch(color=_COLORS["B"], label="backward")]
    if show_comm and any(e.kind not in COMPUTE for e in events):
        handles.append(Patch(color=_COMM, label="send / recv"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7,
              frameon=False)
    return ax
