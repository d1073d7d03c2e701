"""Every schedule by name: ``make_schedule("1f1b", P, M)``, the way in for the CLI, the benchmarks
and the chapters.

The builders live in :mod:`.schedules` (GPipe, 1F1B, interleaved 1F1B) and :mod:`.zero_bubble`
(ZB-H1, ZB-V, DualPipe-V, which build on the former's ``Op`` and ``Schedule``); this module sits
above both, so neither imports the other back.
"""

from __future__ import annotations

from .schedules import Schedule, ScheduleError, gpipe, interleaved_one_f_one_b, one_f_one_b
from .zero_bubble import dualpipe_v, zb_h1, zb_v

__all__ = ["SCHEDULES", "make_schedule"]

SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved_one_f_one_b,
             "zb-h1": zb_h1, "zb-v": zb_v, "dualpipe-v": dualpipe_v}


def make_schedule(name: str, P: int, M: int, v: int = 2) -> Schedule:
    """``make_schedule("gpipe" | "1f1b" | "interleaved" | "zb-h1" | "zb-v" | "dualpipe-v", P, M, v)``;
    ``v`` is used by interleaved only (ZB-V and DualPipe-V always have 2 chunks per rank)."""
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    return interleaved_one_f_one_b(P, M, v) if name == "interleaved" else SCHEDULES[name](P, M)
