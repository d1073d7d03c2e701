"""Exercise 08b's grader (minidist_course/grading/hierarchical.py): the solution scores full marks,
and each wrong solution of ``MUTANTS`` fails exactly the rule it breaks — Part A in this process
(no ranks), Part B's mutants together in one launch of 4 ranks (every layout of 4: 1×4, 2×2, 4×1).
test_exercise_rules.py runs each mutant alone through the notebook's grading cell (the first of
each part in the default tier)."""

from __future__ import annotations

import pytest

import _solutions
from minidist_course.grading import hierarchical
from test_exercise_rules import MUTANTS, mutate

NB = "08b_hierarchical_allreduce"
CRASHES = "chunk gives fewer pieces (a crash)"   # ends its launch: graded alone below


def _mutants(grade_id):
    return [m for m in MUTANTS if m.notebook == NB and m.grade_id == grade_id]


def _fn(name, mutant=None):
    return _solutions.load(f"{NB}.ipynb", mutate(mutant) if mutant else None)[name]


def test_part_a_solution_full_marks_and_each_mutant_exactly_its_rule():
    report = hierarchical.grade_node_groups(_fn("node_groups"))
    assert report.passed and report.score == report.max_score == 2, str(report)
    chosen = _mutants("node_groups_grade")
    assert {m.rule for m in chosen} == set(hierarchical.GROUP_RULES)
    for m in chosen:
        report = hierarchical.grade_node_groups(_fn("node_groups", m))
        assert report.failed_rules == [m.rule], (m.what, str(report))
        assert report.score < report.max_score


def test_every_rank_names_the_first_group_that_differs():
    report = hierarchical.grade_node_groups(_fn("node_groups", next(
        m for m in _mutants("node_groups_grade") if m.rule == "every_rank")))
    text = str(report)
    assert ("1 node × 2 ranks (W = 2): [every_rank]" in text
            and "dist.new_group call 2: rank 0 asks for [0], rank 1 for [1]" in text), text


# mutants that break a second rule with the first, by the same mistake
ALSO = {"no phase across the nodes": ["inter_bytes"]}   # nothing crossed: [result] and the bytes


@pytest.mark.timeout(180)
def test_part_b_solution_and_mutants_in_one_launch():
    chosen = [m for m in _mutants("hierarchical_all_reduce_grade") if m.what != CRASHES]
    assert {m.rule for m in chosen} == set(hierarchical.ALL_REDUCE_RULES)
    fns = [_fn("hierarchical_all_reduce")] + [_fn("hierarchical_all_reduce", m) for m in chosen]
    reports = hierarchical.grade_all_reduce_many(fns, world_sizes=(4,))
    assert reports[0].passed and reports[0].score == 4, str(reports[0])
    for m, report in zip(chosen, reports[1:]):
        assert report.failed_rules == [m.rule] + ALSO.get(m.what, []), (m.what, str(report))
    by = {m.what: report for m, report in zip(chosen, reports[1:])}
    text = {what: str(report) for what, report in by.items()}

    def rule_line(what, key):
        return next(line for line in text[what].splitlines() if line.lstrip()[2:].startswith(f"[{key}]"))

    # a right result with the wrong bytes: half the points ([inter_bytes] is 3 of 6)
    assert "a flat ring's — its 2 ranks at a node boundary" in text["a flat ring over the world"]
    assert by["a flat ring over the world"].score == 2
    assert by["the whole tensor in the node, then across"].score == 2
    # torch's collective: nothing went through p2p, so nothing else is credited
    torch_ = by["torch's all_reduce"]
    assert torch_.score == 0, text["torch's all_reduce"]
    assert all(r.not_checked and r.message == hierarchical.NOT_P2P
               for r in torch_.results if r.rule != "inter_bytes"), text["torch's all_reduce"]
    # a wrong result: the rules it hides are not checked (no points, not ✓), and the sum decoded
    gather = text["no all-gather"]
    assert "the all-gather inside the node did not run" in gather, gather
    assert rule_line("no all-gather", "uneven").startswith("  – [uneven]"), gather
    assert "decoded: result[" in by["no all-gather"].first_failure().message
    across = text["no phase across the nodes"]
    assert "holds the sum of ranks {0, 1} only, its node's: the phase across the nodes did not run" \
        in across, across
    assert "nothing crossed the nodes — the phase across the nodes did not run" in across, across
    assert "this rank's own value: nothing was reduced" in text["skips tensors smaller than W"]
    assert "÷L: averaged over the node only" in text["averaged over the node only"]
    assert "the sum, not the max: pass op to every ring call" in text["always a sum"]
    # in place: the caller's tensor is judged, not only what comes back
    assert "the tensor you were given was not changed — reassigning `tensor = …` or `torch.cat`" \
        in text["cloned pieces joined by torch.cat"]
    assert "where you returned" in text["avg as tensor = tensor / W"]
    assert "the library caches lazily" in text["groups made in every call"]


def test_points_add_up_to_the_part():
    """[inter_bytes] is half of Part B; every rule is worth something."""
    points = hierarchical.ALL_REDUCE_POINTS
    assert set(points) == set(hierarchical.ALL_REDUCE_RULES) and min(points.values()) > 0
    assert points["inter_bytes"] == sum(points.values()) / 2


@pytest.mark.timeout(120)
def test_a_crash_on_an_awkward_size_is_uneven_and_the_other_rules_still_checked():
    crash = next(m for m in _mutants("hierarchical_all_reduce_grade") if m.what == CRASHES)
    (report,) = hierarchical.grade_all_reduce_many([_fn("hierarchical_all_reduce", crash)],
                                                   world_sizes=(2,))
    assert report.failed_rules == ["uneven"], str(report)
    assert "1 node × 2 ranks" in str(report) and "your code raised IndexError" in str(report)


def test_the_byte_formulas():
    """2(M-1)/M · n/L per rank, 2(M-1)·n in all (the chapter's 2 × 2 counts: 131,072 and 524,288
    bytes of a 256 KiB all-reduce)."""
    n = 1 << 16
    assert hierarchical.inter_bytes_per_rank(2, 2, n) == 131_072
    assert hierarchical.inter_bytes_total(2, 2, n) == 4 * 131_072
    assert hierarchical.inter_bytes_total(1, 4, n) == 0


def test_a_leader_scheme_is_named_and_explained():
    """One rank per node sends the whole tensor across (the textbook leader scheme): the same
    bytes in all, so the feedback must say why it still breaks [inter_bytes]."""
    n, M, L = 48, 2, 2
    leader = 2 * (M - 1) * n // M * hierarchical.ITEMSIZE
    text = hierarchical._inter_problem([leader, 0, leader, 0], M, L, n)
    assert text and "a leader scheme" in text and "its own rail" in text, text
    assert hierarchical._inter_problem([leader // L] * 4, M, L, n) is None
