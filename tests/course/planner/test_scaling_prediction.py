"""Data-parallel strong and weak scaling predicted by the planner (minidist_course.planner.scaling),
checked against the alpha-beta formula computed here from minidist_course.planner.calc, and the
measured-scaling rows' shape on 1 and 2 ranks."""

from __future__ import annotations

import pytest

from minidist_course.planner import calc
from minidist_course.planner.published import LINKS
from minidist_course.planner.scaling import dp_scaling
from minidist_course.planner.search import Links, ModelSpec

GPT_MEDIUM = ModelSpec(layers=24, hidden=1024, heads=16, vocab=50257, seq_len=1024)
FLOPS = 312e12 * 0.5
SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256]


def _flops_per_sequence(m: ModelSpec) -> float:
    """Forward FLOPs of one sequence (Narayanan et al. 2021, §5.1), times 3 for forward + backward."""
    s, h, L, V = m.seq_len, m.hidden, m.layers, m.vocab
    return 3 * (L * (24 * s * h * h + 4 * s * s * h) + 2 * s * h * V)


@pytest.mark.parametrize("mode, kw", [("weak", {"batch_per_device": 8}),
                                      ("weak", {"batch_per_device": 1}),
                                      ("strong", {"global_batch": 256})])
def test_rows_follow_the_alpha_beta_formula(mode, kw):
    rows = dp_scaling(GPT_MEDIUM, SIZES, FLOPS, mode, **kw)
    t1 = rows[0]["step_s"]
    for r in rows:
        w, b = r["world_size"], r["batch_per_device"]
        assert b == (kw["batch_per_device"] if mode == "weak" else 256 // w)
        compute = b * _flops_per_sequence(GPT_MEDIUM) / FLOPS
        alpha, beta = LINKS["nvlink3"] if w <= 8 else LINKS["ib-hdr"]
        comm = calc.comm_time("all_reduce", 2 * GPT_MEDIUM.params, w, alpha, beta) if w > 1 else 0.0
        exposed = max(0.0, comm - 2 / 3 * compute)       # hidden behind the backward (2/3 of it)
        assert r["compute_s"] == pytest.approx(compute, rel=1e-12)
        assert r["comm_s"] == pytest.approx(comm, rel=1e-12, abs=1e-15)
        assert r["exposed_s"] == pytest.approx(exposed, rel=1e-9, abs=1e-15)
        assert r["step_s"] == pytest.approx(compute + exposed, rel=1e-12)
        assert r["ratio"] == pytest.approx(comm / compute)
        ideal = t1 if mode == "weak" else t1 / w
        assert r["efficiency"] == pytest.approx(ideal / r["step_s"], rel=1e-12)
        # calc's definition: W·T(1) of work (weak) or T(1) (strong) done in T(W) on W devices
        work_on_one = w * t1 if mode == "weak" else t1
        assert r["efficiency"] == pytest.approx(calc.scaling_efficiency(work_on_one, r["step_s"], w),
                                                rel=1e-12)


def test_near_linear_exactly_while_the_all_reduce_hides():
    weak = dp_scaling(GPT_MEDIUM, SIZES, FLOPS, "weak", batch_per_device=8)
    assert all(r["efficiency"] == 1.0 and r["ratio"] < 2 / 3 for r in weak)
    strong = dp_scaling(GPT_MEDIUM, SIZES, FLOPS, "strong", global_batch=256)
    for r in strong:
        assert (r["efficiency"] == 1.0) == (r["ratio"] <= 2 / 3)
    eff = {r["world_size"]: r["efficiency"] for r in strong}
    assert eff[32] == 1.0 and 0.8 < eff[64] < 0.82 and 0.45 < eff[128] < 0.47
    bound = dp_scaling(GPT_MEDIUM, SIZES, FLOPS, "weak", batch_per_device=1)
    assert [r["efficiency"] == 1.0 for r in bound] == [True] * 4 + [False] * 5   # leaves the node
    assert 0.26 < bound[4]["efficiency"] < 0.28


def test_ratio_is_independent_of_model_size():
    """r ≈ 2·(W-1)/W · 2N·β / (6N·T/F): N cancels (up to attention and logits FLOPs)."""
    small = ModelSpec(12, 768, 12, 50257, 1024)
    large = ModelSpec(48, 1600, 25, 50257, 1024)
    ratios = [dp_scaling(m, [1, 64], FLOPS, "weak", batch_per_device=4)[1]["ratio"]
              for m in (small, large)]
    alpha, beta = LINKS["ib-hdr"]
    approx = 2 * 63 / 64 * 2 * beta * FLOPS / (6 * 4 * 1024)
    assert all(abs(r / approx - 1) < 0.35 for r in ratios), (ratios, approx)
    assert abs(ratios[0] / ratios[1] - 1) < 0.35


def test_links_and_errors():
    fast = dp_scaling(GPT_MEDIUM, [1, 16], FLOPS, "weak", batch_per_device=1,
                      links=Links(inter=Links().intra))
    assert fast[1]["efficiency"] == 1.0                  # NVLink everywhere: hidden again
    with pytest.raises(ValueError, match="mode must be 'weak' or 'strong'"):
        dp_scaling(GPT_MEDIUM, [1, 2], FLOPS, "both", batch_per_device=1)
    with pytest.raises(ValueError, match="weak scaling needs batch_per_device"):
        dp_scaling(GPT_MEDIUM, [1, 2], FLOPS, "weak")
    with pytest.raises(ValueError, match=r"W = \[3\] do not divide it"):
        dp_scaling(GPT_MEDIUM, [1, 2, 3], FLOPS, "strong", global_batch=8)
    with pytest.raises(ValueError, match="starting at 1"):
        dp_scaling(GPT_MEDIUM, [2, 4], FLOPS, "weak", batch_per_device=1)


@pytest.mark.timeout(120)
def test_measured_rows():
    from minidist_course.lessons.scaling import measured_scaling

    rows = measured_scaling((1, 2), "strong", batch=32, steps=3, warmup=1, hidden=32, timeout=90)
    assert [r["batch_per_rank"] for r in rows] == [32, 16]
    assert rows[0]["speedup"] == 1.0 and rows[0]["efficiency"] == 1.0
    for r in rows:
        assert r["step_s"] > 0 and r["compute_s"] > 0 and r["exposed_s"] >= 0
        assert r["samples_per_s"] == pytest.approx(32 / r["step_s"])
        assert r["efficiency"] == pytest.approx(r["speedup"] / r["world_size"])
    with pytest.raises(ValueError, match=r"W = \[3\] do not divide it"):
        measured_scaling((1, 3), "strong", batch=32)
