"""minidist_course.planner.calc against numbers published in the papers it cites (exact where the math is exact)."""

import math

import pytest

from minidist_course.planner import calc


def test_weights_of_100b_fp16_are_200gb():
    assert calc.weights_bytes(100e9, "fp16") == 200e9
    assert calc.weights_bytes(100e9, "fp32") == 400e9
    assert calc.weights_bytes(100e9, "fp16") > calc.GPUS["A100-80GB"]["memory"]


@pytest.mark.parametrize("dtype,optimizer,expected", [
    ("bf16", "adam", 16),   # ZeRO §3.1: 2 + 2 + 12
    ("fp16", "adam", 16),
    ("fp32", "adam", 16),   # 4 + 4 + 8, no separate master copy
    ("fp32", "sgd", 8),
    ("bf16", "sgd", 8),     # 2 + 2 + 4 (fp32 master)
    ("fp32", "momentum", 12),
])
def test_bytes_per_parameter_in_training(dtype, optimizer, expected):
    m = calc.training_memory(1e9, dtype, optimizer)
    assert m.per_param(1e9) == expected
    assert m.total == m.weights + m.grads + m.optimizer


def test_zero_stages_match_the_paper_figure_1():
    # Rajbhandari et al. 2020, Figure 1: psi = 7.5B, N = 64 -> 120 GB, 31.4 GB, 16.6 GB, 1.9 GB
    got = [calc.zero_memory(7.5e9, 64, s) / 1e9 for s in range(4)]
    assert got[0] == 120.0
    assert [round(g, 1) for g in got[1:]] == [31.4, 16.6, 1.9]
    assert calc.zero_memory(7.5e9, 1, 3) == calc.zero_memory(7.5e9, 1, 0)


def test_training_flops_gpt3():
    # Brown et al. 2020: GPT-3 175B on 300B tokens, 3.14e23 FLOPs reported
    assert calc.training_flops(175e9, 300e9) == pytest.approx(3.15e23)


def test_training_time_scales_inversely_with_gpus():
    f = calc.training_flops(1e9, 20e9)  # 1.2e20
    one = calc.training_time(f, 1, peak_flops=312e12, mfu=0.5)
    assert one == pytest.approx(1.2e20 / 156e12)
    assert calc.training_time(f, 8, peak_flops=312e12, mfu=0.5) == pytest.approx(one / 8)
    with pytest.raises(ValueError, match="mfu"):
        calc.training_time(f, 1, mfu=1.5)


def test_gpus_to_fit_and_speedup():
    assert calc.gpus_to_fit(200e9, 80e9) == 3
    assert calc.gpus_to_fit(160e9, 80e9) == 2
    assert calc.gpus_to_fit(1, 80e9) == 1
    assert calc.speedup(100.0, 30.0) == pytest.approx(10 / 3)
    assert calc.scaling_efficiency(100.0, 13.0, 8) == pytest.approx(100 / 13 / 8)


@pytest.mark.parametrize("w", [1, 2, 3, 4, 8])
def test_ring_traffic_formula(w):
    n = 1200.0
    assert calc.comm_bytes_per_rank("all_reduce", n, w) == pytest.approx(2 * (w - 1) / w * n)
    assert calc.comm_bytes_per_rank("all_gather", n, w) == pytest.approx((w - 1) / w * n)
    assert calc.comm_bytes_per_rank("all_reduce", n, w, "naive") == (w - 1) * n


def test_alpha_beta_model_recursive_doubling_wins_small_ring_wins_large():
    alpha, beta, w = 10e-6, 1 / 10e9, 8
    small, large = 1e3, 1e9
    assert calc.comm_time("all_reduce", small, w, alpha, beta, "recursive_doubling") < \
        calc.comm_time("all_reduce", small, w, alpha, beta, "ring")
    assert calc.comm_time("all_reduce", large, w, alpha, beta, "ring") < \
        calc.comm_time("all_reduce", large, w, alpha, beta, "recursive_doubling")
    ring = calc.comm_time("all_reduce", large, w, alpha, beta, "ring")
    assert ring == pytest.approx(2 * (w - 1) * alpha + 2 * (w - 1) / w * large * beta)
    assert calc.comm_time("all_reduce", large, 1, alpha, beta) == 0


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown dtype 'fp12'"):
        calc.bytes_per_param("fp12")
    with pytest.raises(ValueError, match="params must be a positive number"):
        calc.weights_bytes(-1)
    with pytest.raises(ValueError, match="stage"):
        calc.zero_memory(1e9, 8, 4)
    with pytest.raises(ValueError, match="no cost formula"):
        calc.comm_bytes_per_rank("all_gather", 10, 4, "tree")


def test_human_units():
    assert calc.human_bytes(200e9) == "200 GB"
    assert calc.human_bytes(512) == "512 B"
    assert calc.human_time(90000) == "1.04 days"
    assert calc.human_time(30) == "30 s"
    assert math.isclose(calc.GPUS["H100-80GB"]["memory"], 80e9)
