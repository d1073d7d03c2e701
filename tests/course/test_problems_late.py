"""The worked problems of chapters 07b, 08b, 10, 11, 12, 14, 15 and 16 (``problems.bank_late``): every
answer equal to a hand computation written out here, accepted by ``check`` and rendered in its
chapter.

Importing ``bank_late`` registers its problems in the shared ``REGISTRY``. Until the package
imports it itself, the fixture below takes them out again afterwards, so that the other tests of
the registry see only what the package registers."""

from __future__ import annotations

import importlib
import math
import re

import pytest

from minidist_course import problems
from minidist_course.problems.core import REGISTRY

CHAPTERS = ("07b", "08b", "10", "11", "12", "14", "15", "16")


@pytest.fixture(scope="module")
def late():
    """{id: Problem} of ``bank_late``; the registry is left as it was found."""
    before = set(REGISTRY)
    importlib.import_module("minidist_course.problems.bank_late")
    chosen = {pid: p for pid, p in REGISTRY.items() if p.chapter in CHAPTERS}
    yield chosen
    for pid in set(REGISTRY) - before:
        del REGISTRY[pid]


# ---------------------------------------------------------------- hand computations
def _megatron_146b():
    """Problem 12.1-12.3 by hand: Narayanan et al. 2021's 146B row at (dp, tp, pp) = (24, 8, 8),
    micro-batch 1 (m = 96), full recomputation, 20 bytes per parameter (2 + 2 + 16), A100s at half
    of 312 TFLOP/s, NVLink 3 inside a node (5 µs, 300 GB/s), InfiniBand HDR between (10 µs, 25 GB/s)."""
    L, h, a, V, s = 80, 12288, 96, 51200, 2048
    d, t, p, m, b = 24, 8, 8, 96, 1
    rate = 0.5 * 312e12
    layer = 12 * h * h + 13 * h
    params = L * layer + V * h + s * h + 2 * h              # tied head
    lp = L // p                                             # 10 layers per stage
    first = lp * layer / t + V * h / t + s * h              # the busiest stage's parameters
    sbh = s * b * h
    acts = lp * (2 * sbh) * min(m, p) + sbh * (10 + 24 / t + 5 * a * s / (h * t))
    memory = 20 * first + acts

    f_layer = 24 * b * s * h * h + 4 * b * s * s * h
    fwd = (lp * f_layer + 2 * b * s * h * V) / t / rate
    bwd = (lp * (2 * f_layer + f_layer) + 4 * b * s * h * V) / t / rate
    compute = m * (fwd + bwd)
    bubble = (p - 1) / m * compute

    def ring(nbytes, w, alpha, bw, phases=2):               # ring all-reduce: 2 phases
        return phases * (w - 1) * alpha + phases * (w - 1) / w * nbytes / bw

    nvl, ib = (5e-6, 300e9), (1e-5, 25e9)
    tp_t = m * ((lp * 6 + 2) * ring(2 * sbh, t, *nvl) + 3 * ring(4 * s * b, t, *nvl))
    pp_t = 2 * (m + p - 1) * (ib[0] + 2 * sbh / ib[1]) + ring(2 * V * h / t, 2, *ib)
    dp_exposed = max(0.0, ring(2 * first, d, *ib) - bwd)
    step = compute + bubble + tp_t + pp_t + dp_exposed
    tokens_per_gpu = 2304 * s / step / 1536
    mfu = tokens_per_gpu * (6 * params + 12 * L * s * h) / 312e12
    return memory, step, mfu


def _ring_hidden_from():
    """Problem 14.2 by hand: x = S/8 tokens per block, h = 4096; forward a K/V block (2·x·h bf16
    values) must take at most the block's 2·h·x² FLOPs, backward K/V (bf16) + dK/dV (fp32) at most
    twice that: two quadratics A·x² − B·x − C >= 0; the larger root, rounded up to S = 8x a
    multiple of 1,024."""
    h, alpha, bw, rate = 4096, 5e-6, 300e9, 400e12

    def root(A, B_, C):
        return (B_ + math.sqrt(B_ * B_ + 4 * A * C)) / (2 * A)

    fwd = root(2 * h / rate, 2 * h * 2 / bw, alpha)
    bwd = root(4 * h / rate, 2 * h * (2 + 4) / bw, 2 * alpha)
    return math.ceil(8 * max(fwd, bwd) / 1024) * 1024


def _two_level_speedup():
    """Problem 08b.2 by hand: 2 nodes x 8 GPUs, 1 GiB. Flat ring of 16 at NDR (10 us, 50 GB/s):
    30 alpha + 2·15/16 · n/bw; hierarchical: reduce-scatter and all-gather of 8 on NVLink 4 (5 us,
    450 GB/s), 7 alpha + 7/8 · n/bw each, then a ring of 2 at NDR on n/8: 2 alpha + n/8 / bw."""
    n = 2.0 ** 30
    flat = 30 * 1e-5 + 2 * 15 / 16 * n / 50e9
    hier = 2 * (7 * 5e-6 + 7 / 8 * n / 450e9) + (2 * 1e-5 + n / 8 / 50e9)
    return flat / hier


PER_TOKEN_7B = 32 * 2 * 4096 + 34 * 4096 + 4 * 32000      # layer inputs + one full layer + logits
MTBF = 54 * 86400 / 419                                    # Llama 3: 16,384 GPUs

HAND = {
    "07b.1": 7 / 103,                                      # (P-1)/(3M+P-1)
    "07b.2": (3 * 32 + 7 / 2) * 10,                        # 3M + (P-1)/2 units of 10 ms
    "07b.3": (8 - 1) * 2e9,                                # last stage: min(P, M) = 8 against 1
    "08b.1": (2 * 31 / 32) / (2 * 3 / 4 / 8),             # (W-1)/(M-1) on 4 nodes of 8
    "08b.2": _two_level_speedup(),
    "08b.3": 2 * (2 - 1) / 2 * 14e9 / 8,                   # the 1/8 bf16 gradient shard, ring of 2
    "10.1": 8 * math.log(10),
    "10.2": 0.5 * 1 / (2.5 + 1e-6),
    "10.3": 0.4 / 16,
    "11.1": 80e9 / 3,                                      # ceil(8/3) = 3 ranks per GPU
    "11.2": 4 * 287e6,
    "11.3": 4 * (2 * 3 / 4 * 2.6e9) / 64e9,
    "12.1": _megatron_146b()[0],
    "12.2": _megatron_146b()[1],
    "12.3": _megatron_146b()[2],
    "14.1": PER_TOKEN_7B * 131072 / 8,
    "14.2": _ring_hidden_from(),
    "14.3": (80e9 - 6.7e9 * (2 + 2 + 12 / 8)) * 8 // PER_TOKEN_7B // 1024 * 1024,
    "15.1": math.ceil(4096 * 2 * 1.25 / 8),
    "15.2": (1600 - 1280) + (1400 - 1280),
    "15.3": 32 * (4 * 7 / 8 * 4096 * 2 * 4096 * 2 + 8 * 8 * 7 / 8),
    "16.1": math.sqrt(2 * 60 * MTBF / 8),
    "16.2": (math.sqrt(2 * 60 * MTBF) / 2 + 600) * 16384 / 3600,
    "16.3": math.ceil(2 * 7 / 8 * 4 * 1.3e9 / 1.25e9 / (0.1 * 0.5)),
}


def test_three_problems_in_each_chapter(late):
    assert sorted(late) == sorted(HAND)
    for chapter in CHAPTERS:
        assert sorted(pid for pid in late if pid.split(".")[0] == chapter) == \
            [f"{chapter}.{i}" for i in (1, 2, 3)]


@pytest.mark.parametrize("pid", sorted(HAND))
def test_answer_equals_the_hand_computation(late, pid):
    assert late[pid].answer() == pytest.approx(HAND[pid], rel=1e-9), pid


def test_hand_computations_hold_the_numbers_the_texts_quote():
    assert HAND["14.2"] == 32768 and HAND["16.3"] == 146 and HAND["15.2"] == 440
    assert HAND["08b.1"] == pytest.approx(31 / 3) and HAND["08b.2"] == pytest.approx(5.837, rel=1e-3)
    assert HAND["12.1"] == pytest.approx(51.98e9, rel=1e-3) and HAND["14.3"] == 651_264


def test_every_answer_is_checked_and_worked(late, tmp_path, monkeypatch):
    monkeypatch.setenv("MINIDIST_LEDGER", str(tmp_path / "ledger.json"))
    for pid, p in late.items():
        monkeypatch.setitem(REGISTRY, pid, p)
        a = p.answer()
        assert isinstance(a, (int, float)) and math.isfinite(a) and a > 0, pid
        assert problems.check(pid, a) and not problems.check(pid, a * 1.5), pid
        text = p.question + p.worked(a) + p.source
        assert not re.search(r"(^|[\s(])/(home|tmp|work|usr|Users)\b", text), pid   # no machine paths
        assert p.source, pid


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_render_shows_each_chapter(late, monkeypatch, chapter):
    for pid, p in late.items():
        monkeypatch.setitem(REGISTRY, pid, p)
    text = problems.render(chapter)
    assert text.count("<details>") == 3
    assert all(f"**Problem {chapter}.{i}.**" in text for i in (1, 2, 3))
    assert "*Source: " in text
