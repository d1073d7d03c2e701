"""minidist.core.moe against the library's MoE (minidist.expert_parallel).

The router's pieces are compared in this process on generated logits; the layer (routing,
capacity, the count exchange, both all-to-alls, the local experts, the weighted combine) in one
launch of W = 3 ranks on every generated case, forward and backward, with the library layer's own
router and experts. Everything is compared with ``torch.equal``: the core moves the same rows
and adds them in the same order (an all-to-all only moves data), so the results are bit-identical,
also where E does not divide by W, a rank holds no expert, or the ranks hold different numbers of
tokens (dropless cases).
"""

import pytest
import torch
from hypothesis import strategies as st

import minidist
from _drawn import drawn
from minidist.core import moe as core
from minidist.expert_parallel import (MoE, expert_capacity, keep_mask, load_balancing_loss,
                                      local_experts, route)
from minidist.models.gpt import GPTConfig

W = 3


@st.composite
def _case(draw):
    E = draw(st.integers(1, 7))
    return dict(E=E, k=draw(st.integers(1, min(3, E))), h=draw(st.integers(2, 6)),
                T=draw(st.integers(1, 9)),
                factor=draw(st.sampled_from([None, 0.5, 1.0, 1.1, 1.25, 2.0])),
                seed=draw(st.integers(0, 2**16)))



CASES = drawn(_case(), 12)


def _one(rank, world, c):
    E, k, h = c["E"], c["k"], c["h"]
    T = c["T"] if c["factor"] else c["T"] + rank       # dropless: uneven tokens per rank
    torch.manual_seed(c["seed"])
    layer = MoE(GPTConfig(n_embd=h), E, k, capacity_factor=c["factor"], ep_group=None)
    g = torch.Generator().manual_seed(c["seed"] + rank)
    x, dy = torch.randn(1, T, h, generator=g), torch.randn(1, T, h, generator=g)
    results = []
    for forward in (layer, lambda a: core.moe(a.view(T, h), layer.router.weight,
                                               list(layer.experts), E, k, c["factor"]).view(1, T, h)):
        layer.zero_grad(set_to_none=True)
        a = x.clone().requires_grad_()
        y = forward(a)
        y.backward(dy)
        results.append([y.detach(), a.grad] + [p.grad for p in layer.parameters()])
    return results


def _rank(rank, world, cases):
    return [_one(rank, world, c) for c in cases]


@pytest.mark.timeout(120)
def test_core_moe_layer_is_the_library_s_bit_for_bit():
    results = minidist.run(_rank, W, CASES, timeout=100)
    for rank, per_rank in enumerate(results):
        for c, (lib, mine) in zip(CASES, per_rank):
            assert len(lib) == len(mine)
            for i, (x, y) in enumerate(zip(lib, mine)):
                assert (x is None and y is None) or torch.equal(x, y), (rank, c, i)


def test_core_router_pieces_are_the_library_s():
    for c in CASES:
        E, k, T = c["E"], c["k"], c["T"]
        g = torch.Generator().manual_seed(c["seed"])
        logits = torch.randn(T, E, generator=g).round(decimals=1)    # rounded: ties happen
        for normalize in (False, True):
            for a, b in zip(route(logits, k, normalize), core.route(logits, k, normalize)):
                assert torch.equal(a, b), (c, normalize)
        probs, experts, weights = route(logits, k)
        if c["factor"]:
            cap = expert_capacity(T, E, k, c["factor"])
            assert core.capacity(T, E, k, c["factor"]) == cap
            assert torch.equal(core.keep_mask(experts, E, cap),
                               keep_mask(experts, weights, E, cap, "position"))
        counts = torch.bincount(experts.reshape(-1), minlength=E)
        assert torch.equal(core.load_balancing_loss(probs, experts, 0.01),
                           load_balancing_loss(probs, counts, T * k, 0.01))
        for world in (1, 2, 3, 4, 8):
            for r in range(world):
                assert core.local_experts(E, world, r) == local_experts(E, world, r)
    assert core.capacity(100, 2, 1, 1.1) == 55          # exact, where floats give 56
