"""Pipeline parallelism from scratch: schedules as data, one engine, a simulator, timelines.

* ``schedules``  — GPipe, 1F1B, interleaved 1F1B as per-rank lists of (op, micro-batch, stage)
* ``simulator``  — the timeline, bubble and peak activations of a schedule, no processes
* ``partition``  — cut an ``nn.Sequential`` into stages (by layers, parameters or measured time)
* ``microbatch`` — ``tensor_split`` a batch; each micro-batch's loss weighted by its size
* ``transport``  — activations forward, gradients backward, with a shape/dtype header
* ``engine``     — runs any schedule on the ranks of a pipeline group; records a timeline

Timelines (events, the bubble fraction, the Gantt chart) are :mod:`minidist.trace`'s, re-exported
here.
"""

from .schedules import (Op, Schedule, ScheduleError, gpipe, interleaved_one_f_one_b,  # noqa: F401
                        make_schedule, one_f_one_b, validate)
from .engine import StepResult, local_stages, pipeline_step
from .simulator import (PipelineDeadlock, SimResult, bubble_formula, message_order_mismatches,  # noqa: F401
                        peak_inflight, simulate)
from ..trace import Event, bubble_fraction, plot_timeline  # noqa: F401

__all__ = ["Op", "Schedule", "ScheduleError", "gpipe", "one_f_one_b", "interleaved_one_f_one_b",
           "make_schedule", "validate", "simulate", "SimResult", "PipelineDeadlock", "bubble_formula",
           "peak_inflight", "message_order_mismatches", "Event", "bubble_fraction", "plot_timeline",
           "pipeline_step", "local_stages", "StepResult"]
