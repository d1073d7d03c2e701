"""minidist_course.grading: a correct collective scores full marks; each kind of wrong one fails, and says
what was wrong (rank, index, expected, got). A grader that cannot fail is a defect."""

import time

import pytest
import torch
import torch.distributed as dist

from minidist import collectives as C
from minidist_course import grading
from minidist.comm import p2p, ring


def ring_all_reduce(t, rank, world):
    C.all_reduce(t, algorithm="ring")


def torch_all_reduce(t, rank, world):
    dist.all_reduce(t)


def chunk_ring(t, rank, world):  # torch.chunk can return fewer than W chunks
    chunks = list(t.chunk(world)) if t.numel() else []
    if len(chunks) != world:
        raise IndexError(f"torch.chunk gave {len(chunks)} chunks for {world} ranks")
    ring.reduce_scatter_chunks(chunks, "sum", rank, world)
    ring.all_gather_chunks(chunks, rank, world)


def off_by_one(t, rank, world):
    C.all_reduce(t)
    if rank == world - 1 and t.numel() > 2:
        t[2] += 1


def todo(t, rank, world):
    raise NotImplementedError()


def deadlock(t, rank, world):
    if world > 1 and t.numel():
        p2p.recv(t, (rank + 1) % world)


def test_correct_ring_scores_full_marks_on_all_sizes():
    report = grading.grade_collective(ring_all_reduce, "all_reduce", traffic="ring")
    assert report.passed and report.score == report.max_score == 21, str(report)   # 20 named + drawn sizes
    assert "✓ world size 3, 1 element" in str(report)
    report.assert_passed(show=False)


@pytest.mark.parametrize("reference,fn", [
    ("reduce_scatter", lambda ch, r, w: ring.reduce_scatter_chunks(ch, "sum", r, w)),
    ("all_gather", lambda ch, r, w: ring.all_gather_chunks(ch, r, w)),
])
def test_chunk_collectives_pass(reference, fn):
    report = grading.grade_collective(fn, reference, world_sizes=(1, 3, 4), sizes=(0, 2, 11),
                                      traffic="ring")
    assert report.passed, str(report)


def test_wrong_value_names_rank_index_expected_got():
    report = grading.grade_collective(off_by_one, world_sizes=(3,), sizes=(1, 10))
    assert [r.passed for r in report.results] == [True, False]
    msg = report.results[1].message
    # "[sizes] <the rule's text>: rank 2: ...": the rule it breaks first (10 elements on 3 ranks)
    assert msg.startswith("[sizes] ") and report.results[1].rule == "sizes", msg
    msg = msg[msg.index("rank 2: "):]
    assert msg.startswith("rank 2: result[2]: expected ") and ", got " in msg
    assert "(1 of 10 elements wrong)" in msg
    with pytest.raises(AssertionError, match="1 of 2 checks failed"):
        report.assert_passed(show=False)


def test_fewer_elements_than_ranks_is_caught():
    report = grading.grade_collective(chunk_ring, world_sizes=(4,), sizes=(3, 8))
    assert [r.passed for r in report.results] == [False, True], str(report)
    assert "IndexError" in report.results[0].message


def test_all_gather_slot_never_received_is_caught():
    def lazy(chunks, rank, world):  # only talks to the right neighbour once
        pass
    report = grading.grade_collective(lazy, "all_gather", world_sizes=(2,), sizes=(4,))
    assert not report.passed and "expected" in report.results[0].message and "got nan" in \
        report.results[0].message


def test_not_implemented_and_score():
    report = grading.grade_collective(todo, world_sizes=(1, 2), sizes=(3,))
    assert report.score == 0 and report.max_score == 2
    assert "NotImplementedError" in report.results[1].message


def test_deadlock_becomes_a_failed_check_not_a_hang():
    t0 = time.monotonic()
    report = grading.grade_collective(deadlock, world_sizes=(2,), sizes=(5, 6), timeout=3)
    assert time.monotonic() - t0 < 15
    first, second = report.results
    assert not first.passed and "timed out" in first.message
    assert "rank 0" in first.message and "rank 1" in first.message
    assert second.message.startswith("not run:") and "timed out" in second.message


def test_traffic_check_rejects_torch_shortcut():
    report = grading.grade_collective(torch_all_reduce, world_sizes=(2,), sizes=(4,),
                                      traffic="ring")
    assert not report.passed and "minidist.comm.p2p" in report.results[0].message
    assert grading.grade_collective(torch_all_reduce, world_sizes=(2,), sizes=(4,)).passed


def test_traffic_check_rejects_naive_all_reduce():
    def naive(t, rank, world):
        C.all_reduce(t, algorithm="naive")
    report = grading.grade_collective(naive, world_sizes=(4,), sizes=(8,), traffic="ring")
    assert not report.passed and "not a ring's" in report.results[0].message


def test_check_and_report_generic():
    rep = grading.Report("demo")
    rep.check("fine", lambda: None)
    rep.check("true", lambda: True, points=2)
    rep.check("message", lambda: "rank 1: wrong")
    rep.check("false", lambda: False)
    rep.check("assert", lambda: (_ for _ in ()).throw(AssertionError("x != y")))
    rep.check("todo", lambda: (_ for _ in ()).throw(NotImplementedError()))
    assert rep.score == 3 and rep.max_score == 7
    text = str(rep)
    assert "✓ fine" in text and "✗ message: rank 1: wrong" in text and "✗ assert: x != y" in text
    assert "not written yet" in text and text.endswith("score: 3/7")
    with pytest.raises(AssertionError, match="no checks ran"):
        grading.Report("empty").assert_passed(show=False)


def test_compare():
    a = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    assert grading.compare(a.clone(), a) is None
    b = a.clone()
    b[1, 0] = 5
    assert grading.compare(b, a, rank=3) == \
        "rank 3: result[(1, 0)]: expected 3, got 5 (1 of 4 elements wrong)"
    assert "shape (4,)" in grading.compare(a.view(-1), a)
    assert grading.compare(a + 1e-7, a, atol=1e-6) is None
    assert grading.compare(torch.tensor([float("nan")]), torch.tensor([1.0])) is not None


def _rank_check(rank, world, bad_rank):
    return "values differ" if rank == bad_rank else None


def test_check_on_ranks():
    rep = grading.check_on_ranks("demo", _rank_check, (1, 2, 3), 2, timeout=20)
    assert [r.passed for r in rep.results] == [True, True, False]
    assert rep.results[2].message == "rank 2: values differ"


def test_unknown_reference():
    with pytest.raises(ValueError, match="reference must be one of"):
        grading.grade_collective(todo, "all_to_some")


def test_op_max_against_torch():
    def lib_max(t, rank, world):
        C.all_reduce(t, op="max")

    def lib_sum(t, rank, world):
        C.all_reduce(t, op="sum")
    assert grading.grade_collective(lib_max, op="max", world_sizes=(3,), sizes=(1, 10)).passed
    report = grading.grade_collective(lib_sum, op="max", world_sizes=(3,), sizes=(10,))
    assert not report.passed and "expected" in report.results[0].message


# --------------------------------------------------------------------------- feedback that names the bug
def rs_one_step_short(chunks, rank, world):
    """A ring reduce-scatter that stops one step early."""
    right, left = (rank + 1) % world, (rank - 1) % world
    for step in range(world - 2):
        incoming = torch.empty_like(chunks[(rank - step - 2) % world])
        p2p.exchange(chunks[(rank - step - 1) % world], right, incoming, left)
        chunks[(rank - step - 2) % world] += incoming


def rs_wrong_chunk(chunks, rank, world):
    """Sends the chunk it is about to receive into (the all-gather's index): nothing accumulates."""
    right, left = (rank + 1) % world, (rank - 1) % world
    for step in range(world - 1):
        incoming = torch.empty_like(chunks[(rank - step - 1) % world])
        p2p.exchange(chunks[(rank - step) % world], right, incoming, left)
        chunks[(rank - step - 1) % world] += incoming


def test_wrong_reduce_scatter_is_decoded_into_missing_ranks_on_every_rank():
    report = grading.grade_collective(rs_one_step_short, "reduce_scatter", world_sizes=(3,),
                                      sizes=(10,), total=4, traffic="ring")
    msg = report.results[0].message
    for r in range(3):  # every failing rank is shown, not rank 0 only
        assert msg.count(f"rank {r}: result") == 1, msg
    assert "rank 0: chunk 0 holds ranks {0}, missing {1, 2}" in msg, msg
    assert "at reduce-scatter step 2 (s = 1 in the loop) rank 0 sent nothing" in msg, msg
    assert str(report).endswith("score: 0/4")


def test_first_diverging_ring_step_is_named():
    report = grading.grade_collective(rs_wrong_chunk, "reduce_scatter", world_sizes=(3,),
                                      sizes=(6,), traffic="ring")
    msg = report.results[0].message
    assert "rank 1: chunk 1 holds ranks {1}, missing {0, 2}" in msg, msg
    assert ("at reduce-scatter step 1 (s = 0 in the loop) rank 0 sent chunk 0, which holds ranks {0}; the ring sends "
            "chunk 2") in msg, msg


def test_part_that_fails_because_an_earlier_part_fails_says_so():
    def all_reduce_from_parts(t, rank, world):
        chunks = list(t.view(-1).tensor_split(world))
        rs_one_step_short(chunks, rank, world)
        ring.all_gather_chunks(chunks, rank, world)
    report = grading.grade_collective(
        all_reduce_from_parts, world_sizes=(3,), sizes=(10,), total=3,
        requires={"reduce_scatter": rs_one_step_short, "all_gather": ring.all_gather_chunks})
    assert report.notes and report.notes[0].startswith("fails because rs_one_step_short fails")
    assert len(report.notes) == 1  # the all-gather is fine: not blamed
    with pytest.raises(AssertionError, match="fails because rs_one_step_short fails"):
        report.assert_passed(show=False)


def send_then_recv_shift(rank, world, n):
    """Issue 14's first wrong attempt: shift_right as a blocking send, then a receive."""
    x, got = torch.full((n,), float(rank)), torch.empty(n)
    if world > 1:
        p2p.send(x, (rank + 1) % world)
        p2p.recv(got, (rank - 1) % world)
    return None


def test_after_a_deadlock_the_remaining_checks_are_skipped_in_one_timeout():
    t0 = time.monotonic()
    report = grading.Report("shift_right", total=3)
    for n in (1, 1000):
        grading.check_on_ranks(f"shift_right, {n} floats", send_then_recv_shift, (1, 2, 3, 4), n,
                               timeout=4, report=report)
    elapsed = time.monotonic() - t0
    assert [r.passed for r in report.results[:2]] == [True, False]
    assert "timed out" in report.results[1].message
    assert all(r.message.startswith("not run") for r in report.results[2:]), str(report)
    assert "timed out" in report.results[2].message  # the first skip says why
    assert elapsed < 4 + 20, f"{elapsed:.0f} s: more than one timeout"
    assert str(report).endswith("score: 0.38/3")  # 1 of 8 checks, out of the text's 3 points


def test_same_message_on_every_rank_is_shown_once():
    rep = grading.check_on_ranks("demo", _same_everywhere, (3,), timeout=20)
    assert rep.results[0].message == "ranks 0, 1, 2: sum is not divided by W"


def _same_everywhere(rank, world):
    return "sum is not divided by W"


def test_busbw_factors_agree_with_the_benchmark():
    from minidist_course import bench
    from minidist_course.grading.composition import BUSBW_FACTOR
    for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce"):
        for w in (1, 2, 3, 8):
            assert BUSBW_FACTOR[op](w) == bench.busbw_factor(op, w), (op, w)


def test_report_total_scales_the_printed_score():
    rep = grading.Report("part", total=4)
    rep.check("a", lambda: None)
    rep.check("b", lambda: "wrong")
    assert (rep.score, rep.max_score) == (2, 4) and str(rep).endswith("score: 2/4")


def test_a_rule_failed_again_with_a_per_rank_message_prints_one_line_pointing_to_the_first():
    from minidist_course.grading.core import Report, Result
    wait = "[wait] every isend/irecv is waited: rank 0: isend never waited\nrank 1: irecv never waited"
    rep = Report("g", brief_repeats=True)
    rep.add(Result("world size 2, 1 element", False, 0, 1, wait, rule="wait"))
    rep.add(Result("world size 2, 3 elements", False, 0, 1, wait, rule="wait"))
    rep.add(Result("world size 3, 1 element", False, 0, 1, "[equal] result[0]: expected 1, got 2",
                   rule="equal"))
    rep.add(Result("world size 3, 3 elements", False, 0, 1, "[equal] result[1]: expected 3, got 4",
                   rule="equal"))
    text = str(rep)
    assert text.count("rank 1: irecv never waited") == 1
    assert ("✗ world size 2, 3 elements: [wait] broken again (in full at world size 2, 1 element "
            "above)") in text
    assert "expected 1, got 2" in text and "expected 3, got 4" in text   # one-line messages stay
    # a one-line failure of a rule is not "in full" for a later per-rank message of it
    rep.add(Result("world size 4, 1 element", False, 0, 1, "[equal] rank 0: a\nrank 1: b", rule="equal"))
    assert "rank 1: b" in str(rep)
    rep.brief_repeats = False
    assert str(rep).count("rank 1: irecv never waited") == 2
