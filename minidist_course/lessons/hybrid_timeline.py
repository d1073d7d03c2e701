"""The capstone's timeline and MFU cells in one call each: one recorded 3-D step of the tiny GPT on
``dp·tp·pp`` ranks (:func:`minidist_course.diagrams.step_timeline.record_step`), drawn per rank, and its MFU.

    events = step_timeline(2, 2, 2)                  # 8 ranks, after one warm-up step
    plot_step_timeline(events, title="(dp, tp, pp) = (2, 2, 2)")
    time_by_kind(events)                             # {rank: {"compute": s, "tp": s, ...}}
"""

from __future__ import annotations

from ..bench.hybrid import MODEL, build
from minidist_course.diagrams.step_timeline import align, plot_step_timeline, record_step, time_by_kind  # noqa: F401
from minidist.launch import run

__all__ = ["step_timeline", "plot_step_timeline", "time_by_kind"]


def _rank(rank, world, dp, tp, pp, model, batch, microbatches, dp_mode, warmup, seed):
    from minidist.hybrid import train_step

    net, opt, modules, ids, targets = build(dp, tp, pp, model, batch, dp_mode, seed)
    for _ in range(warmup):   # first-step costs (allocations, group set-up) stay off the chart
        train_step(net, opt, modules, ids, targets, microbatches, dp_mode=dp_mode)
    return record_step(net, opt, modules, ids, targets, microbatches, dp_mode=dp_mode)[1]


def step_timeline(dp: int, tp: int, pp: int, model: dict = MODEL, batch: int = 16,
                  microbatches: int = 4, dp_mode: str = "flat", warmup: int = 1, seed: int = 0,
                  timeout: float = 300.0) -> list:
    """Events of every rank of one recorded training step (after ``warmup`` steps), aligned to
    start at 0: the input of :func:`plot_step_timeline` and :func:`time_by_kind`."""
    per_rank = run(_rank, dp * tp * pp, dp, tp, pp, dict(model), batch, microbatches, dp_mode,
                   warmup, seed, timeout=timeout)
    return align(per_rank)
