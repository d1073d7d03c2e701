"""Pipeline parallelism from scratch: schedules as data, one engine, a simulator, timelines.

``schedules``/``zero_bubble``/``catalog`` (per-rank op lists), ``engine`` (runs any of them),
``simulator``, ``split_backward`` (B and W), ``partition``, ``microbatch``, ``transport``.
Design notes: docs/design/pipeline_parallel.md
"""

from .schedules import (Op, Schedule, ScheduleError, gpipe, interleaved_one_f_one_b,  # noqa: F401
                        one_f_one_b, validate)
from .zero_bubble import dualpipe_v, zb_h1, zb_v  # noqa: F401
from .catalog import SCHEDULES, make_schedule  # noqa: F401
from .engine import StepResult, local_stages, pipeline_step
from .simulator import (PipelineDeadlock, SimResult, bubble_formula, message_order_mismatches,  # noqa: F401
                        messages, peak_bytes, peak_inflight, simulate)
from ..trace import Event, bubble_fraction, plot_timeline  # noqa: F401

__all__ = ["Op", "Schedule", "ScheduleError", "gpipe", "one_f_one_b", "interleaved_one_f_one_b",
           "make_schedule", "SCHEDULES", "validate", "zb_h1", "zb_v", "dualpipe_v", "simulate",
           "peak_bytes", "messages", "SimResult", "PipelineDeadlock", "bubble_formula", "peak_inflight",
           "message_order_mismatches", "Event", "bubble_fraction", "plot_timeline",
           "pipeline_step", "local_stages", "StepResult"]
