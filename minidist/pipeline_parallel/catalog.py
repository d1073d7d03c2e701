"""Every schedule by name: ``make_schedule("1f1b", P, M)`` (above schedules and zero_bubble).
Design notes: docs/design/pipeline_parallel.md
"""

from __future__ import annotations

from .schedules import Schedule, ScheduleError, gpipe, interleaved_one_f_one_b, one_f_one_b
from .zero_bubble import dualpipe_v, zb_h1, zb_v

__all__ = ["SCHEDULES", "make_schedule"]

SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved_one_f_one_b,
             "zb-h1": zb_h1, "zb-v": zb_v, "dualpipe-v": dualpipe_v}


def make_schedule(name: str, P: int, M: int, v: int = 2) -> Schedule:
    """``name``: gpipe, 1f1b, interleaved, zb-h1, zb-v or dualpipe-v; ``v`` is for interleaved only."""
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    return interleaved_one_f_one_b(P, M, v) if name == "interleaved" else SCHEDULES[name](P, M)
