"""The console command: `minidist demo` (and its non-zero exit on a wrong result), bench, help."""

import subprocess
import sys

import pytest

from minidist_course import bench


def _minidist(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "minidist_course.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_demo_shows_every_collective_correct():
    res = _minidist("demo", "--sections", "collectives")
    assert res.returncode == 0, res.stdout + res.stderr
    for check in ("all_reduce/ring", "all_reduce/naive", "all_reduce/recursive_doubling",
                  "reduce_scatter/ring",
                  "all_gather/ring", "broadcast/tree", "broadcast/ring", "reduce/tree",
                  "all_to_all/naive"):
        line = next(ln for ln in res.stdout.splitlines() if ln.startswith(check + " "))
        assert line.endswith("✓"), line
    assert "13 of 13 checks correct" in res.stdout


def test_demo_device_flag_runs_through_the_cuda_staging_path_on_cpu():
    # `--device` is what the GPU check calls; on a CPU machine, forcing the staging of CUDA
    # tensors through pinned CPU buffers runs the same code path with CPU tensors
    import os
    env = {**os.environ, "MINIDIST_FORCE_STAGING": "1"}
    res = subprocess.run([sys.executable, "-m", "minidist_course.cli", "demo", "--sections",
                          "collectives", "--world-size", "3", "--device", "cpu"],
                         capture_output=True, text=True, timeout=240, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "13 of 13 checks correct" in res.stdout


# a deliberately wrong ring all-reduce (reduce-scatter only), patched into the library's table
# before the demo forks its ranks: proves the demo's checker can fail
_BROKEN_DEMO = """
import sys
from minidist import collectives as C
from minidist.comm import ring
from minidist_course.cli import main

def broken(flat, op, rank, world, group=None):
    ring.reduce_scatter_chunks(list(flat.tensor_split(world)), op, rank, world, group)

C.ALGORITHMS["all_reduce"]["ring"] = broken
sys.exit(main(["demo", "--sections", "collectives", "--world-size", "2"]))
"""


def test_demo_exits_non_zero_when_an_algorithm_is_wrong():
    res = subprocess.run([sys.executable, "-c", _BROKEN_DEMO], capture_output=True, text=True,
                         timeout=240)
    assert res.returncode == 1
    assert "✗ WRONG" in res.stdout and "WRONG: collectives:all_reduce/ring" in res.stderr


def test_bench_prints_the_nccl_tests_table_and_alpha_beta(tmp_path):
    plot = tmp_path / "busbw.png"
    res = _minidist("bench", "--ops", "all_reduce", "--world-sizes", "2", "--min-bytes", "1K",
                    "--max-bytes", "64K", "--iters", "2", "--plot", str(plot))
    assert res.returncode == 0, res.stderr
    assert "busbw GB/s" in res.stdout and "alpha-beta fit all_reduce/ring W=2" in res.stdout
    assert "of p2p" in res.stdout  # the point-to-point ceiling beside every row
    assert plot.stat().st_size > 1000


def test_usage():
    res = _minidist()
    assert res.returncode == 2 and "demo" in res.stderr


@pytest.mark.parametrize("op,w,factor", [("all_reduce", 4, 1.5), ("reduce_scatter", 4, 0.75),
                                         ("all_gather", 2, 0.5), ("broadcast", 8, 1.0)])
def test_busbw_factors_follow_nccl_tests(op, w, factor):
    assert bench.busbw_factor(op, w) == factor


def test_alpha_beta_fit_recovers_a_known_line():
    rows = [dict(bytes=b, time_s=5e-6 + b / 2e9) for b in (1024, 65536, 1 << 20, 1 << 24)]
    alpha, beta = bench.fit_alpha_beta(rows)
    assert abs(alpha - 5e-6) < 1e-9 and abs(1 / beta - 2e9) < 1e3


def test_parse_size():
    assert [bench.parse_size(s) for s in ("1K", "64M", "1G", "512", "4MiB")] == \
        [1024, 64 << 20, 1 << 30, 512, 4 << 20]


def test_bench_ddp_refuses_a_step_count_below_one(capsys):
    from minidist_course.cli import bench as bench_cli
    with pytest.raises(SystemExit) as exc:
        bench_cli(["ddp", "--steps", "0"])
    assert exc.value.code == 2 and "--steps must be >= 1 (got 0)" in capsys.readouterr().err
