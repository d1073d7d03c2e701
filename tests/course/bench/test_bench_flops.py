"""`minidist bench flops`: FLOP count, the rate's arithmetic, thread handling, JSON and the command.
Nothing asserts how fast this machine is."""

import json
import subprocess
import sys

import pytest
import torch

from minidist_course.bench.flops import (FlopsResult, bench_flops, format_flops, load_flops,
    matmul_flops, save_flops)


def test_matmul_flops_is_2n_cubed():
    # n^2 outputs, each n multiplications and n - 1 additions, counted 2n (Golub & Van Loan §1.1)
    assert [matmul_flops(n) for n in (0, 1, 3, 1024)] == [0, 2, 54, 2 * 1024 ** 3]
    with pytest.raises(ValueError, match="n must be >= 0"):
        matmul_flops(-1)


def test_rates_are_2n3_over_the_median_and_threads_are_restored():
    before = torch.get_num_threads()
    res = bench_flops(sizes=(8, 32), threads=1, budget_s=0.05, min_reps=3, max_reps=50)
    assert torch.get_num_threads() == before
    assert res.threads == 1 and res.machine["torch_threads"] == 1 and res.dtype == "float32"
    assert [p["n"] for p in res.points] == [8, 32]
    for p in res.points:
        assert 3 <= p["reps"] <= 50
        assert p["gflops"] == pytest.approx(2 * p["n"] ** 3 / p["median_s"] / 1e9)
        lo, hi = p["gflops_iqr"]
        assert lo <= p["gflops"] <= hi
    assert res.flops_per_s == pytest.approx(max(p["gflops"] for p in res.points) * 1e9)
    assert "torch threads = 1" in format_flops(res)
    rate = {p["n"]: p["gflops"] * 1e9 for p in res.points}
    assert res.rate_at(8) == rate[8] and res.rate_at(1) == rate[8] and res.rate_at(1000) == rate[32]
    assert res.rate_at(16) == rate[32]  # halfway in log scale: the larger size
    with pytest.raises(ValueError, match="n must be >= 1"):
        res.rate_at(0)


def test_bad_sizes_are_a_clear_error():
    with pytest.raises(ValueError, match="sizes must be positive"):
        bench_flops(sizes=(0, 8))
    with pytest.raises(ValueError, match="sizes must be positive"):
        bench_flops(sizes=())


def test_json_round_trip(tmp_path):
    res = bench_flops(sizes=(8,), threads=1, budget_s=0.01, min_reps=2, max_reps=5)
    path = tmp_path / "flops.json"
    save_flops(path, [res])
    d = json.loads(path.read_text())
    assert d["format"] == "minidist-flops/1" and d["flop_rate"] == res.flops_per_s and d["threads"] == 1
    back = load_flops(path)
    assert back == [res] and isinstance(back[0], FlopsResult)
    path.write_text(json.dumps({"format": "minidist-alpha-beta/1", "fits": []}))
    with pytest.raises(ValueError, match="expected 'minidist-flops/1'"):
        load_flops(path)


def test_cli_runs_quickly_with_tiny_settings(tmp_path):
    out = tmp_path / "flops.json"
    res = subprocess.run([sys.executable, "-m", "minidist_course.cli", "bench", "flops", "--sizes", "16",
                          "32", "--threads", "1", "--budget-s", "0.1", "--min-reps", "2",
                          "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "torch threads = 1" in res.stdout and "GFLOP/s" in res.stdout
    (r,) = load_flops(out)
    assert r.threads == 1 and [p["n"] for p in r.points] == [16, 32]
    bad = subprocess.run([sys.executable, "-m", "minidist_course.cli", "bench", "flops", "--threads", "0"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--threads must be >= 1" in bad.stderr
