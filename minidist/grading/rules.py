"""What each exercise part checks: the rules its text teaches, one grader check per rule.

``RULES[notebook][grade_id]`` is ``{rule id: rule text}``; every check of that part's grader is
tagged with one rule id (:attr:`minidist.grading.Result.rule`) and named by the rule's text, so a
failed check says which rule was broken. ``show(notebook)`` prints the list in the exercise's
introduction, so the learner knows what is checked. The test suite holds, for every rule, a
plausible wrong solution that the grader must reject by naming that rule
(``tests/test_exercise_rules.py``).
"""

from __future__ import annotations

from . import ddp, zero

__all__ = ["RULES", "show"]

RULES: dict[str, dict[str, dict[str, str]]] = {
    "04_bucketed_ddp": {"build_buckets_grade": ddp.LAYOUT_RULES, "my_ddp_grade": ddp.DDP_RULES},
    "09_zero": {"zero1_grade": zero.ZERO1_RULES, "zero2_grade": zero.ZERO2_RULES},
}


def show(notebook: str) -> None:
    """Print the rules each graded part of ``notebook`` (e.g. ``"09_zero"``) checks."""
    parts = RULES[notebook.removesuffix(".ipynb")]
    lines = ["What the graders check (each rule is one check; a broken rule is named in the report):"]
    for grade_id, rules in parts.items():
        lines.append(f"{grade_id}:")
        lines += [f"  [{key}] {text}" for key, text in rules.items()]
    print("\n".join(lines))
