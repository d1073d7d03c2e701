"""Where one 3-D training step spends its time, rank by rank: a Gantt chart of compute and of the
three kinds of communication.

:func:`record_step` runs :func:`minidist.hybrid.train_step` under a Timeline that observes every
span of the library and returns this rank's :class:`minidist.trace.Event` list:

=========  =====================================================================================
kind       events (``name``), and who records them
=========  =====================================================================================
compute    ``"F"``, ``"B"``: the pipeline engine's forward and backward of one (micro-batch, stage)
tp         ``"tp all_reduce"`` / ``"tp all_gather"`` / ``"tp reduce_scatter"``: each region
           crossing of a tensor-parallel layer (:mod:`minidist.tensor_parallel.accounting`, which
           times every collective it files); they run *inside* an F or B bar. ``"sp grads"``: the
           sequence-parallel gradient sum after the pipeline
pp         ``"send"`` (posting an isend), ``"recv"`` (the main thread waiting for an activation or a
           gradient), ``"send wait"`` (the sends at the end): the engine's transport; ``"tied grads"``:
           the tied embedding's gradient sum between the first and last stage
dp         ``"dp_sync"`` (flat and ZeRO-1 average after the last backward), ``"all-reduce bN"``
           (bucketed DDP, on its communication thread: lane ``"comm"``) and ``"ddp wait"``,
           ``"zero1 all-gather"`` (the parameters after ZeRO-1's sharded step); none when dp = 1
other      ``"clip"`` (global-norm all-reduces), ``"optimizer"`` (contains the ZeRO-1 all-gather)
=========  =====================================================================================

Events carry the *global* rank (``Event.rank``) and absolute ``time.perf_counter()`` times, which
one machine's processes share; :func:`align` (or :func:`plot_step_timeline`) shifts them so the
step starts at 0. ``Event.lane`` is ``"main"`` or the background thread that recorded it. The
per-kind sums of :func:`time_by_kind` overlap: a TP collective is inside its F/B.

Not on the chart: the vocabulary-parallel cross-entropy's two small all-reduces (inside the last
stage's F) and the loss reported to every rank after the step.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch.distributed as dist

from minidist.hybrid.step import train_step
from minidist.tensor_parallel import accounting
from minidist.trace import Event, Timeline, align

__all__ = ["KINDS", "kind_of", "record_step", "align", "time_by_kind", "plot_step_timeline"]

# kind -> (colour, legend label); F and B get two shades of the compute colour
KINDS = {"compute": ("#4C72B0", "compute (F / B)"), "tp": ("#DD8452", "TP comm"),
         "pp": ("#55A868", "PP comm"), "dp": ("#C44E52", "DP comm"),
         "other": ("#8172B2", "clip, optimizer")}
_SHADE = {"F": ("#7EA6E0", "forward"), "B": ("#2F4F8A", "backward")}
_NAMES = {"F": "compute", "B": "compute", "sp grads": "tp", "send": "pp", "recv": "pp", "send wait": "pp",
          "tied grads": "pp", "dp_sync": "dp", "ddp wait": "dp", "zero1 all-gather": "dp",
          "clip": "other", "optimizer": "other"}
_PREFIXES = (("tp ", "tp"), ("all-reduce b", "dp"))


def kind_of(event) -> str:
    """``"compute"``, ``"tp"``, ``"pp"``, ``"dp"`` or ``"other"`` for an Event (or a name)."""
    name = event if isinstance(event, str) else event.name
    if name in _NAMES:
        return _NAMES[name]
    return next((k for p, k in _PREFIXES if name.startswith(p)), "other")


class _TimedComm:
    """Stands in for a ZeRO optimizer's communicator during one step: its all-gathers are timed."""

    def __init__(self, comm, events: list):
        self._comm, self._events = comm, events

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def all_gather(self, *args, **kw):
        start = time.perf_counter()
        try:
            return self._comm.all_gather(*args, **kw)
        finally:
            self._events.append(Event("zero1 all-gather", start, time.perf_counter()))


def record_step(model, optimizer, modules: dict, ids, targets, microbatches: int, **kw):
    """One :func:`~minidist.hybrid.train_step` (same arguments), timed: the engine's F/B ops and
    every span of the library (a :class:`~minidist.trace.Timeline` observes the step).

    Collective over the world (a barrier first, so that every rank's step starts together).
    Returns ``(StepOutput, events)``: this rank's Events, kinds as in the module docstring, global
    rank, absolute ``perf_counter`` seconds. Leaves the optimizer as it was.
    """
    grid = model.grid
    extra: list[Event] = []
    tl = Timeline()
    tl.origin = 0.0                       # spans on the absolute clock, as the engine's t0
    comm = getattr(optimizer, "comm", None)
    if comm is not None and hasattr(comm, "all_gather"):
        optimizer.comm = _TimedComm(comm, extra)
    dist.barrier()
    try:
        with accounting.comm_log() as log, tl.observe():
            out = train_step(model, optimizer, modules, ids, targets, microbatches, **kw)
    finally:
        if comm is not None and hasattr(comm, "all_gather"):
            optimizer.comm = comm
    t0 = out.result.t0
    events = [e._replace(start=e.start + t0, end=e.end + t0) for e in out.result.events]
    events += [e._replace(name="ddp wait") if e.name == "wait" else e
               for e in tl.events if not e.name.startswith("ready ")]
    events += [Event(f"tp {c.op}", c.start, c.end) for c in log if c.end > c.start]
    events = [e._replace(rank=grid.rank) for e in events + extra
              if grid.dp_size > 1 or kind_of(e) != "dp"]   # dp = 1: no DP communication
    return out, sorted(events, key=lambda e: e.start)


def time_by_kind(events) -> dict[int, dict[str, float]]:
    """``{rank: {kind: seconds}}`` summed over the events (TP time is also inside compute)."""
    out: dict = defaultdict(lambda: dict.fromkeys(KINDS, 0.0))
    for e in align(events):
        out[e.rank][kind_of(e)] += e.duration
    return dict(sorted(out.items()))


def plot_step_timeline(events, title: str = "", ax=None, n_ranks: int | None = None):
    """Gantt chart of one step: one row per rank (rank 0 on top), bars coloured by kind.

    F/B bars fill the row; the main thread's communication (TP crossings inside F/B, PP waits,
    DP syncs) and clip/optimizer are drawn over them, full height; what a background thread did
    (bucketed DDP's all-reduces) is a thin bar along the bottom of the row. Time in ms from the
    step's first event. Returns the matplotlib Axes.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    events = align(events)
    P = n_ranks if n_ranks is not None else max((e.rank for e in events), default=-1) + 1
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.5 * P + 1.4), dpi=80)
    order = {"compute": 0, "other": 1, "dp": 2, "pp": 3, "tp": 4}
    legend: dict = {}
    for e in sorted(events, key=lambda e: order[kind_of(e)]):
        if e.duration <= 0 or e.rank >= P:
            continue
        kind, y = kind_of(e), P - 1 - e.rank
        colour, label = _SHADE.get(e.name) or KINDS[kind]
        bottom, height = (y - 0.42, 0.84) if e.lane == "main" else (y - 0.46, 0.16)
        ax.broken_barh([(1e3 * e.start, 1e3 * e.duration)], (bottom, height), facecolors=colour,
                       linewidth=0)
        legend.setdefault(label, colour)
    ax.set_yticks(range(P))
    ax.set_yticklabels([f"rank {r}" for r in reversed(range(P))])
    ax.set_xlabel("time (ms)")
    if title:
        ax.set_title(title, fontsize=10)
    ranked = sorted(legend.items(), key=lambda kv: [*_SHADE_LABELS, *_KIND_LABELS].index(kv[0]))
    ax.legend(handles=[Patch(color=c, label=k) for k, c in ranked], loc="upper left",
              bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)
    return ax


_SHADE_LABELS = [v[1] for v in _SHADE.values()]
_KIND_LABELS = [v[1] for v in KINDS.values()]
