"""`minidist bench cp` and the context-parallel section of `minidist demo`, through the command.
Nothing asserts how fast this machine is: only that the figures exist and are consistent."""

import subprocess
import sys

import pytest

import torch

import minidist
from minidist_course.bench.context_parallel import bench_cp, format_cp
from minidist.context_parallel import ring_attention
from minidist.trace import Timeline


@pytest.mark.timeout(120)
def test_bench_cp_figures():
    r = bench_cp(world=2, seq_len=64, heads=2, head_dim=8, reps=1)
    for key in ("one_process_s", "ring_s", "ulysses_s", "comm_alone_s"):
        assert r[key] > 0, key
    assert 0.0 <= r["hidden_forward"] <= 1.0 and 0.0 <= r["hidden_backward"] <= 1.0
    text = format_cp([r])
    assert text.splitlines()[2].split()[:2] == ["2", "64"]
    with pytest.raises(ValueError, match="multiple of 2W = 8"):
        bench_cp(world=4, seq_len=20)
    with pytest.raises(ValueError, match="3 heads do not divide over W = 2"):
        bench_cp(world=2, seq_len=8, heads=3)


def test_spans_are_recorded_only_while_a_timeline_observes():
    """Ring attention's spans reach an observing Timeline, and nothing outside observe()."""
    def fn(rank, world):
        q = torch.randn(1, 2, 4, 8, requires_grad=True)
        tl = Timeline()
        ring_attention(q, q, q, split="zigzag", seq_len=4)[0].sum().backward()
        with tl.observe():
            ring_attention(q, q, q, split="zigzag", seq_len=4)[0].sum().backward()
        after = len(tl.events)
        ring_attention(q, q, q, split="zigzag", seq_len=4)[0].sum().backward()
        return [e.name for e in tl.events], after
    names, after = minidist.run(fn, 1, timeout=60)[0]
    assert names == ["fwd 0", "wait", "bwd 0", "wait"] and after == len(names)


@pytest.mark.timeout(200)
def test_demo_context_parallel_section_and_bench_through_the_cli():
    res = subprocess.run([sys.executable, "-m", "minidist_course.cli", "demo", "--sections",
                          "context_parallel"], capture_output=True, text=True, timeout=150)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "5 of 5 checks correct" in res.stdout
    assert "zigzag [132, 132, 132, 132], contiguous [36, 100, 164, 228]" in res.stdout
    res = subprocess.run([sys.executable, "-m", "minidist_course.cli", "bench", "cp", "--world-sizes",
                          "2", "--seq-lens", "32", "--reps", "1"], capture_output=True, text=True,
                         timeout=150)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "hidden fwd" in res.stdout and res.stdout.splitlines()[2].split()[:2] == ["2", "32"]
