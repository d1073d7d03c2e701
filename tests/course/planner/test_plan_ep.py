"""The planner's expert-parallel terms: expert memory per rank and the all-to-all α-β time.

Checked against the parameters of a real MoEGPT (counted on each EP rank) and against the bytes the
comm layer counts for a perfectly balanced routing, at E = 4, k = 2, ep = 2 and 4.
"""

import math

import pytest
import torch
import torch.distributed as dist

import minidist
from minidist.expert_parallel import MoEGPT
from minidist.expert_parallel.gpt import is_expert
from minidist.models.gpt import GPTConfig
from minidist_course.planner import PRECISIONS, Link, Links, ModelSpec, MoESpec, predict_ep

CFG = GPTConfig(vocab_size=29, block_size=8, n_layer=2, n_head=2, n_embd=16)


def _count(rank, world):
    from minidist.grid import ProcessGrid
    grid = ProcessGrid(world, ep=world)
    model = MoEGPT(CFG, 4, 2, grid=grid)
    return (sum(p.numel() for p in model.parameters() if is_expert(p)),
            sum(p.numel() for p in model.parameters() if not is_expert(p)))


@pytest.mark.timeout(60)
def test_expert_memory_matches_a_real_moe_gpt_per_rank():
    spec, moe = ModelSpec.from_gpt_config(CFG), MoESpec(4, 2)
    for ep in (1, 2, 4):
        got = minidist.run(_count, ep, timeout=50)
        pred = predict_ep(spec, moe, ep, tokens_per_rank=16)
        assert {g[0] for g in got} == {pred["expert_params"]}, (ep, got, pred)
        assert {g[1] for g in got} == {pred["dense_params"]}, (ep, got, pred)
        assert pred["expert_memory"] == pred["expert_params"] * sum(PRECISIONS["mixed"])


def test_all_to_all_time_is_the_alpha_beta_formula():
    spec, link = ModelSpec(layers=2, hidden=16, heads=2, vocab=29, seq_len=8, tied=False), Link(1e-5, 1e-9)
    links = Links(intra=link, inter=Link(1e-4, 1e-8))
    for ep, cf in ((2, 1.0), (4, 0.5), (16, 2.0)):
        T, E, k = 64, 8, 2
        p = predict_ep(spec, MoESpec(E, k, cf), ep, T, links=links, act_bytes=4)
        lk = link if ep <= 8 else links.inter
        rows = T * k * min(1.0, cf)
        data = (ep - 1) / ep * rows * 16 * 4
        want = 2 * (4 * ((ep - 1) * lk.alpha + data * lk.beta)
                    + (ep - 1) * lk.alpha + 8 * E * (ep - 1) / ep * lk.beta)
        assert math.isclose(p["a2a_s"], want, rel_tol=1e-12), (ep, cf)
        assert math.isclose(p["a2a_bytes"], 2 * (4 * data + 8 * E * (ep - 1) / ep))
    assert predict_ep(spec, MoESpec(8), 1, 64)["a2a_s"] == 0.0
    with pytest.raises(ValueError, match="ep must be an int >= 1"):
        predict_ep(spec, MoESpec(8), 0, 64)


def _balanced(rank, world):
    """A routing where every rank sends T·k/E rows to each expert; forward and backward bytes."""
    from minidist.comm import p2p
    from minidist.expert_parallel.dispatch import dispatch_combine, local_experts
    T, E, k, h = 16, 4, 2, 16
    experts = torch.stack([torch.arange(T) % E, (torch.arange(T) + 1) % E], 1)
    kept = torch.ones(T, k, dtype=torch.bool)
    mods = [torch.nn.Linear(h, h) for _ in local_experts(E, world, rank)]
    before = p2p.traffic("all_to_all/naive").bytes_sent
    out, _ = dispatch_combine(torch.randn(T, h, requires_grad=True), experts, torch.ones(T, k), kept, E, mods,
                              dist.group.WORLD, rank, world)
    out.sum().backward()
    return p2p.traffic("all_to_all/naive").bytes_sent - before


@pytest.mark.timeout(60)
def test_planned_bytes_equal_the_counted_bytes_for_balanced_routing():
    spec = ModelSpec(layers=1, hidden=16, heads=2, vocab=29, seq_len=8, tied=False)
    for ep in (2, 4):
        counted = minidist.run(_balanced, ep, timeout=50)
        pred = predict_ep(spec, MoESpec(4, 2), ep, 16, act_bytes=4)
        assert counted == [pred["a2a_bytes"]] * ep, (ep, counted, pred["a2a_bytes"])
