"""Autograding for the exercises: run the learner's code on several ranks, compare with torch, score.

Three layers, from generic to specific:

* :func:`check` runs one check ``fn()`` and returns a :class:`Result`: the check passes when ``fn``
  returns ``None``/``True``; it fails when it returns ``False`` or a message string, raises
  (``AssertionError`` → its message), or times out (:class:`minidist.RankTimeoutError` → where
  each rank was waiting; never a frozen notebook).
* :class:`Report` collects results, prints ``✓``/``✗`` lines and a score, and
  :meth:`Report.assert_passed` raises ``AssertionError`` when anything failed, so an autograded
  notebook cell fails (nbgrader gives it 0 points).
* :func:`grade_collective` runs a learner's collective on world sizes 1..4 and awkward sizes (empty,
  fewer elements than ranks, odd sizes), compares every rank's result with torch.distributed's own
  collective and says what was wrong: rank, index, expected, got.
  :func:`check_on_ranks` does the same for any per-rank check function (DDP, TP, PP exercises).

Example (a grading cell)::

    from minidist_course import grading
    grading.grade_collective(ring_all_reduce, "all_reduce").assert_passed()

:func:`compare` describes the first mismatch between two tensors; reuse it in your own checks.

Files: ``core.py`` (Result, Report, check, compare, check_on_ranks), ``collectives.py``
(grade_collective and its calling conventions, ``REFERENCES``), ``ddp.py`` (exercise 04's
bucket layout and DDP wrapper against torch's DDP), ``walls.py`` (exercise 00, against
``minidist_course.planner.calc``), ``composition.py`` (exercise 02: collectives from broadcast/reduce, busbw
factors), ``sampling.py`` (exercise 05: sampler and exact evaluation), ``launch_env.py``
(exercise 08: launch variables and broken launch logs, against ``minidist.env``), ``cost.py``
(exercise 13: GPUs for a deadline, spot wall time, Young's interval, against ``minidist_course.planner.cost``),
``context_parallel.py`` (exercise 14: the log-sum-exp merge, the zigzag split, and a ring
attention built from them, against full attention on one process), ``hybrid.py`` (exercise 12: the global gradient norm of a dp x tp x pp model, against
``torch.nn.utils.clip_grad_norm_`` on one process; names the counting rule a wrong norm breaks),
``zero.py`` (exercise 09), ``moe.py`` (exercise 15: capacity rule, aux loss, permute/un-permute,
against ``minidist.expert_parallel`` and the dense MoE; names the slip a wrong answer matches),
``spy.py`` (watches a learner's torch.distributed calls: bytes per rank, async or blocking, waited
or not), ``state.py`` (optimizer state measured over every optimizer an object holds), ``rules.py``
(``RULES``: what each exercise part checks, one rule per check, printed in the exercise's
introduction),
``generated.py`` (every part also compares on inputs hypothesis draws, seeded: the smallest
failing one is shown), ``zero_bubble.py`` (exercise 07 part C: ZB-H1 from 1F1B by placing W ops, by the simulator's
memory and bubble against ``minidist.pipeline_parallel.zb_h1``; names the misplaced op),
``checkpoints.py`` (exercise 16: the resume and retire rules of checkpoint generations, against
``minidist.resume_rule``), ``hierarchical.py`` (exercise 08b: the groups of a two-level cluster, then
a hierarchical all-reduce on them against torch's, with the bytes each rank sends across nodes
counted under a topology), ``bug_hunt.py`` (exercise 12b: zoo bugs named from their symptoms, checked by the answer's own
symptoms; the micro-batch weights fixed, on every small case and in a run).
"""

from .collectives import REFERENCES, grade_collective  # noqa: F401
from . import (composition, cost, hybrid, launch_env, expert_parallel, sampling, walls)  # noqa: F401  (exercises 02, 13, 12, 08, 15, 05, 00)
from . import context_parallel  # noqa: F401  (exercise 14)
from . import zero_bubble  # noqa: F401  (exercise 07, part C)
from . import bug_hunt  # noqa: F401  (exercise 12b)
from . import checkpoints  # noqa: F401  (exercise 16)
from . import hierarchical  # noqa: F401  (exercise 08b)
from .data_parallel import grade_bucket_layout, grade_ddp  # noqa: F401
from .core import (Report, Result, check, check_on_ranks, check_rules, compare,  # noqa: F401
                   describe_exception, rules_text)
from . import rules, spy, state, sharding  # noqa: F401,E402  (what each part checks; watchers)
from .generated import generated_check, generated_on_ranks, st  # noqa: F401  (generated inputs)

__all__ = ["Result", "Report", "check", "compare", "check_on_ranks", "grade_collective",
           "REFERENCES", "describe_exception", "grade_bucket_layout", "grade_ddp", "check_rules",
           "rules_text", "generated_check", "generated_on_ranks", "st"]
