"""The worked problems of chapters 01, 02, 05, 06 and 08 (minidist_course.problems.bank_early):
every answer equal to a computation written out by hand here, every chapter rendered."""

from __future__ import annotations

import math

import pytest

import minidist_course.problems.bank_early as bank_early
from minidist_course import problems
from minidist_course.problems.core import render

IDS = [f"{c}.{i}" for c in ("01", "02", "05", "06", "08") for i in (1, 2, 3)]

H100_PEAK, A100_PEAK = 989e12, 312e12
GPT3_LAYER_FLOPS = 72 * 2048 * 12288 ** 2 + 12 * 2048 ** 2 * 12288   # Narayanan §5.1, b = 1, ×3
GPT3_ACT = 2048 * 12288 * 2                                           # b·s·h bf16 bytes


def _hand_05_1() -> int:
    """Smallest k with comm/compute < 2/3, the planner's model written out: a ring all-reduce of
    the 16-bit gradients over HDR (64 GPUs leave the node), the forward 24bsh² + 4bs²h per layer
    plus the 2bshV logits, backward twice that, at 50 % of the A100's peak."""
    L, h, V, s = 24, 2048, 50257, 512
    params = L * (12 * h * h + 13 * h) + V * h + s * h + 2 * h      # tied embedding
    comm = 2 * 63 * 1e-5 + 2 * 63 / 64 * 2 * params / 25e9
    per_sequence = 3 * (L * (24 * s * h * h + 4 * s * s * h) + 2 * s * h * V) / (A100_PEAK * 0.5)
    return next(k for k in range(1, 1000) if comm / (k * per_sequence) < 2 / 3)


def _hand_05_3() -> float:
    t = 6 * 1.3e9 * 8 * 2048 / (H100_PEAK * 0.4)
    return 0.4 * t / (t + 0.1)


HAND = {
    "01.1": 13 // 4,                                   # cyclic over 4 nodes: local rank r div 4
    "01.2": 80e9 / 2 / 16,                             # 2 ranks per GPU, 16 bytes per parameter
    "01.3": 1024 * 10 / 60 * 4.00,
    "02.1": 450 / (2 * 7 / 8),
    "02.2": (2 * 63 - 6) * 10e-6 * 50e9 / (6 - 2 * 63 / 64),
    "02.3": 63 * 10e-6 + 63 / 64 * 14e9 / 50e9,
    "05.1": _hand_05_1(),
    "05.2": 2 * 63 / 64 * (5.2e9 - 2.6e9) / 25e9,      # the latency terms cancel
    "05.3": _hand_05_3(),
    "06.1": 2 * (2 * 7 / 8) * GPT3_ACT,
    "06.2": 96 * 2048 * 12288 * 10 * (1 - 1 / 8),
    "06.3": 4 * (14 * 5e-6 + 2 * 7 / 8 * GPT3_ACT / 450e9) / (GPT3_LAYER_FLOPS / 8 / (H100_PEAK * 0.4)),
    "08.1": 4 * 8 + 3,                                 # node1, node10, node11, node12, node2
    "08.2": 4 * (30 * 1e-5 + 2 * 15 / 16 * GPT3_ACT / 50e9) / (GPT3_LAYER_FLOPS / 16 / (H100_PEAK * 0.4)),
    "08.3": 30 * 1e-5 + 2 * 15 / 16 * 14e9 / 8 / 50e9,
}


def test_the_module_registers_three_problems_per_chapter():
    assert set(IDS) <= set(problems.REGISTRY)
    assert set(HAND) == set(IDS)
    for pid in IDS:
        assert problems.REGISTRY[pid].answer.__module__ == bank_early.__name__, pid
        assert problems.REGISTRY[pid].source, pid


@pytest.mark.parametrize("pid", IDS)
def test_answers_equal_the_hand_computation(pid):
    assert problems.REGISTRY[pid].answer() == pytest.approx(HAND[pid], rel=1e-6)


def test_the_hand_answers_behind_the_worded_ones():
    assert HAND["05.1"] == 12 and HAND["08.1"] == 35 and HAND["01.1"] == 3
    assert 0.1 < HAND["06.3"] < 0.2 and 2 < HAND["08.2"] < 3   # TP: in a node cheap, across costly


@pytest.mark.parametrize("pid", IDS)
def test_every_answer_is_finite_and_checked(pid, tmp_path, monkeypatch):
    monkeypatch.setenv("MINIDIST_LEDGER", str(tmp_path / "ledger.json"))
    p = problems.REGISTRY[pid]
    a = p.answer()
    assert isinstance(a, (int, float)) and math.isfinite(a) and a > 0
    assert problems.check(pid, a) and not problems.check(pid, a * 1.5)
    assert p.worked(a) and "/work" not in p.question + p.worked(a)


@pytest.mark.parametrize("chapter", ["01", "02", "05", "06", "08"])
def test_each_chapter_renders(chapter):
    text = render(chapter)
    assert text.count("<details>") == 3
    for i in (1, 2, 3):
        assert f"**Problem {chapter}.{i}.**" in text


def test_the_stated_nccl_timeout_is_torchs():
    from torch.distributed.constants import default_pg_nccl_timeout
    if default_pg_nccl_timeout is not None:       # None: a torch built without NCCL
        assert bank_early.NCCL_TIMEOUT == default_pg_nccl_timeout.total_seconds()
