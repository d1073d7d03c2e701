"""The CPU planner's contention terms (minidist_course.planner.machine): concurrent-group links, cores freed
in the pipeline bubble, the optimizer step. Deterministic: numbers in, numbers out, no timing."""

import pytest

from minidist_course import planner as P
from minidist_course.planner.machine import busy_ranks, optimizer_fraction

SPEC = P.ModelSpec(layers=8, hidden=32, heads=4, vocab=93, seq_len=16)
LINK = P.Link(1e-3, 1e-9)
SLOW = P.Link(5e-3, 4e-9)


def by_config(preds):
    return {(q.config.dp, q.config.tp, q.config.pp, q.config.microbatches): q for q in preds
            if q.config.zero == 0 and q.config.recompute == "none"}


def machine(n, **kw):
    return by_config(P.this_machine(SPEC, 16, n, 1e10, LINK, cores=2, memory=1e12,
                                    recompute=("none",), zero_stages=(0,), layer_overhead=1e-4, **kw))


def test_busy_ranks_and_optimizer_fraction():
    assert busy_ranks(8, 1, 4) == 8                      # no pipeline: every rank busy
    assert busy_ranks(8, 8, 4) == pytest.approx(8 * 4 / 11)
    assert busy_ranks(8, 4, 4, v=3) == pytest.approx(8 * 4 / 5)
    assert optimizer_fraction(8, 1) == 1.0
    assert optimizer_fraction(8, 4) == pytest.approx(3 / 9)
    assert optimizer_fraction(8, 8) == pytest.approx(2 / 9)
    assert optimizer_fraction(7, 2) == pytest.approx(5 / 8)  # the busiest stage holds ceil(7/2)


def test_default_is_the_plain_model():
    plain, also = machine(4), machine(4, group_links={}, bubble_frees_cores=False, optimizer_s=0.0)
    assert {k: q.step_s for k, q in plain.items()} == {k: q.step_s for k, q in also.items()}


def test_group_links_feed_each_term_its_group_size():
    base, slow2 = machine(4, group_links={4: LINK}), machine(4, group_links={2: SLOW})
    plain = machine(4)
    for k, q in base.items():     # {4: LINK} is the single link: nothing changes
        assert q.step_s == pytest.approx(plain[k].step_s)
    q, b = slow2[(2, 2, 1, 4)], plain[(2, 2, 1, 4)]
    ref = by_config(P.this_machine(SPEC, 16, 4, 1e10, SLOW, cores=2, memory=1e12, recompute=("none",),
                                   zero_stages=(0,), layer_overhead=1e-4))[(2, 2, 1, 4)]
    assert q.time["tp"] == pytest.approx(ref.time["tp"]) and ref.time["tp"] > b.time["tp"]  # t=2: n=2
    assert q.time["dp"] == pytest.approx(ref.time["dp"]) and ref.time["dp"] > b.time["dp"]  # d=2: n=2
    q, b = slow2[(1, 4, 1, 4)], plain[(1, 4, 1, 4)]
    assert q.time["tp"] == pytest.approx(b.time["tp"])                    # t = 4: no n = 4 given
    q, b = slow2[(1, 1, 4, 4)], plain[(1, 1, 4, 4)]
    assert q.time["pp"] == pytest.approx(ref_pp := by_config(P.this_machine(
        SPEC, 16, 4, 1e10, SLOW, cores=2, memory=1e12, recompute=("none",), zero_stages=(0,),
        layer_overhead=1e-4))[(1, 1, 4, 4)].time["pp"]) and ref_pp > b.time["pp"]  # PP: pairs
    assert q.step_s == pytest.approx(q.time["compute"] + q.time["bubble"] + q.time["exposed"])


def test_bubble_frees_cores_only_for_pipelines_with_more_ranks_than_cores():
    plain, freed = machine(8), machine(8, bubble_frees_cores=True)
    for k in plain:
        if k[2] == 1:
            assert freed[k].time["compute"] == pytest.approx(plain[k].time["compute"])
    k = (1, 1, 8, 4)   # 8 ranks, busy 8·4/11 ≈ 2.9 on average: share 2/2.9 instead of 2/8
    assert freed[k].time["compute"] == pytest.approx(plain[k].time["compute"] * (2 / 8) / (2 / (8 * 4 / 11)))
    two = by_config(P.this_machine(SPEC, 16, 2, 1e10, LINK, cores=2, memory=1e12, recompute=("none",),
                                   zero_stages=(0,), bubble_frees_cores=True))
    plain2 = by_config(P.this_machine(SPEC, 16, 2, 1e10, LINK, cores=2, memory=1e12,
                                      recompute=("none",), zero_stages=(0,)))
    assert two[(1, 1, 2, 4)].step_s == pytest.approx(plain2[(1, 1, 2, 4)].step_s)  # cores enough


def test_optimizer_term_and_calibration_round_trip():
    plain, opt = machine(8), machine(8, optimizer_s=0.02)
    for k, q in opt.items():       # 8 ranks on 2 cores: stretched 4x; a stage's layers + 1 of 9
        want = 0.02 * optimizer_fraction(8, k[2]) * 4
        assert q.time["optimizer"] == pytest.approx(want)
        assert q.step_s == pytest.approx(plain[k].step_s + want)
    measured, o = 0.25, 0.03       # one rank's step and its optimizer: the fit reproduces the step
    oh = P.calibrate_overhead(SPEC, 16, measured, 1e10, microbatches=4, optimizer_s=o)
    assert oh == pytest.approx(P.calibrate_overhead(SPEC, 16, measured - o, 1e10, microbatches=4))
    one = by_config(P.this_machine(SPEC, 16, 1, 1e10, LINK, cores=2, memory=1e12, recompute=("none",),
                                   zero_stages=(0,), layer_overhead=oh, optimizer_s=o,
                                   bubble_frees_cores=True))
    assert one[(1, 1, 1, 4)].step_s == pytest.approx(measured)


def test_bad_optimizer_seconds():
    with pytest.raises(ValueError, match="optimizer_s"):
        machine(4, optimizer_s=-1.0)
    with pytest.raises(ValueError, match="optimizer_s"):
        P.calibrate_overhead(SPEC, 16, 0.1, 1e10, optimizer_s=0.2)
