"""What each exercise part checks: the rules its text teaches, one grader check per rule.

``RULES[notebook][grade_id]`` is ``{rule id: rule text}``; every check of that part's grader is
tagged with one rule id (:attr:`minidist.grading.Result.rule`) and named by the rule's text, so a
failed check says which rule was broken. ``show(notebook)`` prints the list in the exercise's
introduction, so the learner knows what is checked. The test suite holds, for every rule, a
plausible wrong solution that the grader must reject by naming that rule
(``tests/test_exercise_rules.py``).
"""

from __future__ import annotations

from . import composition, cost, ddp, hybrid, walls, zero
from .collectives import collective_rules

__all__ = ["RULES", "show"]

RULES: dict[str, dict[str, dict[str, str]]] = {
    "00_memory_and_time": {"bytes_per_param_grade": walls.BYTES_RULES,
                           "training_memory_grade": walls.MEMORY_RULES,
                           "flops_and_days_grade": walls.FLOPS_RULES},
    "01_token_ring": {"ring_sum_grade": collective_rules()},
    "02_collectives_by_composition": {
        "all_gather_by_broadcast_grade": composition.composed_rules("all_gather"),
        "reduce_scatter_by_reduce_grade": composition.composed_rules("reduce_scatter"),
        "busbw_factor_grade": composition.BUSBW_RULES},
    "03_ring_allreduce": {"ring_reduce_scatter_grade": collective_rules("ring", pairing=True),
                          "ring_all_gather_grade": collective_rules("ring"),
                          "ring_all_reduce_grade": collective_rules("ring")},
    "04_bucketed_ddp": {"build_buckets_grade": ddp.LAYOUT_RULES, "my_ddp_grade": ddp.DDP_RULES},
    "09_zero": {"zero1_grade": zero.ZERO1_RULES, "zero2_grade": zero.ZERO2_RULES},
    "12_global_grad_norm": {"global_grad_norm_grade": hybrid.NORM_RULES},
    "13_cost": {"gpus_for_deadline_grade": cost.DEADLINE_RULES,
                "spot_wall_time_grade": cost.SPOT_RULES, "young_interval_grade": cost.YOUNG_RULES},
}


def show(notebook: str) -> None:
    """Print the rules each graded part of ``notebook`` (e.g. ``"09_zero"``) checks."""
    parts = RULES[notebook.removesuffix(".ipynb")]
    lines = ["What the graders check (each rule is one check; a broken rule is named in the report):"]
    for grade_id, rules in parts.items():
        lines.append(f"{grade_id}:")
        lines += [f"  [{key}] {text}" for key, text in rules.items()]
    print("\n".join(lines))
