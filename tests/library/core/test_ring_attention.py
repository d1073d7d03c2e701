"""minidist.core.ring_attention against the library's ring attention (minidist.context_parallel).

One launch of W = 3 ranks runs every generated case through both, forward and backward, and
compares out, lse, dQ, dK, dV with ``torch.equal``: the core does the library's arithmetic in
the library's order (the same blocks, merged in the same order, the same backward), so they agree
bit for bit, in fp32 and fp64, under every split, causal or not, sequences not divisible by W.
"""

import pytest
import torch
from hypothesis import strategies as st

import minidist
from _drawn import drawn
from minidist.context_parallel import SPLITS, chunks, log_add_exp, ring_attention, shard
from minidist.core import ring_attention as core

W = 3


@st.composite
def _case(draw):
    return dict(split=draw(st.sampled_from(SPLITS)), causal=draw(st.booleans()),
                dtype=draw(st.sampled_from(["float32", "float64"])),
                b=draw(st.integers(1, 2)), h=draw(st.integers(1, 3)), d=draw(st.integers(1, 5)),
                seq_len=draw(st.integers(2 * W, 5 * W + 2)), seed=draw(st.integers(0, 2**16)))



CASES = drawn(_case(), 12)


def _one(rank, world, c):
    g = torch.Generator().manual_seed(c["seed"])
    dtype = getattr(torch, c["dtype"])
    full = [torch.randn(c["b"], c["h"], c["seq_len"], c["d"], generator=g, dtype=dtype)
            for _ in range(4)]
    q, k, v, do = (shard(t, c["split"], world, rank, dim=2) for t in full)
    results = []
    for attend in (lambda a, b, v_: ring_attention(a, b, v_, split=c["split"],
                                                   seq_len=c["seq_len"], causal=c["causal"]),
                   lambda a, b, v_: core.ring_attention(a, b, v_, c["seq_len"], c["split"],
                                                        causal=c["causal"])):
        a, b, v_ = (t.clone().requires_grad_() for t in (q, k, v))
        out, lse = attend(a, b, v_)
        out.backward(do)
        results.append((out.detach(), lse, a.grad, b.grad, v_.grad))
    return results


def _rank(rank, world, cases):
    return [_one(rank, world, c) for c in cases]


@pytest.mark.timeout(120)
def test_core_ring_attention_is_the_library_bit_for_bit():
    results = minidist.run(_rank, W, CASES, timeout=100)
    for rank, per_rank in enumerate(results):
        for c, (lib, mine) in zip(CASES, per_rank):
            for name, x, y in zip(("out", "lse", "dq", "dk", "dv"), lib, mine):
                assert torch.equal(x, y), (rank, c, name, (x - y).abs().max())


def test_core_runs_and_log_add_exp_are_the_library_s():
    for world in (1, 2, 3, 4):
        for seq_len in (2 * world, 2 * world + 1, 7 * world - 1):
            for split in SPLITS:
                for r in range(world):
                    assert [p.tolist() for p in core.runs(split, seq_len, world, r)] == \
                        [p.tolist() for p in chunks(split, seq_len, world, r)]
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        a, b = (torch.randn(4096, generator=g, dtype=dtype) * 30 for _ in range(2))
        a[:8], b[4:12] = float("-inf"), float("-inf")
        assert torch.equal(core.log_add_exp(a, b), log_add_exp(a, b))
