"""Dropout masks on a 3-D grid (dp x pp x tp), recorded with ``record_masks``:

* TP ranks of one stage: equal masks where activations are replicated (embedding, residual
  stream), different masks on the attention probabilities (each rank's own heads);
* pipeline stages: different masks (Megatron-LM's ``seed + 100·pp_rank``); without the offset the
  stages would repeat each other's masks, which the test shows too;
* DP replicas: the same masks (Megatron-LM's default), different ones with
  ``data_parallel_random_init``.

The seeding rules are checked on one-layer TPGPTs standing for stages (fed the same ids on every
stage of a replica: masks depend on the generator and the shape only), then on the real thing:
HybridGPT's stages in one pipelined train_step on a (2, 2, 2) grid.
"""

import dataclasses
import itertools

import pytest
import torch

import minidist
from minidist.grid import ProcessGrid
from minidist.hybrid import HybridGPT, make_optimizer, train_step, wrap_stages
from minidist.models.gpt import GPTConfig
from minidist.tensor_parallel.gpt import TPGPT
from minidist.tensor_parallel.random import (grid_seed, model_parallel_seed, record_masks,
                                             stage_seed)

P = 0.3
CFG = GPTConfig(vocab_size=50, block_size=8, n_layer=1, n_head=4, n_embd=16, dropout=P,
                attn_dropout=P)
SEED = 1234


def _masks_case(rank, world, dp, pp, tp):
    grid = ProcessGrid(dp=dp, pp=pp, tp=tp)
    torch.manual_seed(0)
    stage = TPGPT(CFG, group=grid.tp_group).train()
    g = torch.Generator().manual_seed(100 + grid.dp_rank)          # each replica its own data
    ids = torch.randint(0, CFG.vocab_size, (2, 8), generator=g)
    out = {"coords": (grid.dp_rank, grid.pp_rank, grid.tp_rank)}
    seedings = {"megatron": lambda: grid_seed(SEED, grid),
                "dp_random_init": lambda: grid_seed(SEED, grid, data_parallel_random_init=True),
                "no_pp_offset": lambda: model_parallel_seed(SEED, grid.tp_group)}
    for name, seed in seedings.items():
        seed()
        if rank % 2:
            torch.rand(7)            # rank-local use of torch's global generator changes nothing
        with record_masks() as log:
            stage(ids)
        out[name] = log
    return out


def _equal(a, b):
    return len(a) == len(b) and all(ra == rb and torch.equal(ma, mb)
                                    for (ra, ma), (rb, mb) in zip(a, b))


def _all_differ(a, b, region=None):
    """Every mask of ``a`` (in ``region``, if given) differs from ``b``'s at the same call."""
    pairs = [(ma, mb) for (ra, ma), (rb, mb) in zip(a, b) if region in (None, ra)]
    assert len(a) == len(b) and pairs
    return all(not torch.equal(ma, mb) for ma, mb in pairs)


def _region(log, region):
    return [(r, m) for r, m in log if r == region]


@pytest.mark.parametrize("dp,pp,tp", [(2, 2, 2), (1, 2, 2), (2, 2, 1)])
def test_dropout_masks_on_a_3d_grid(dp, pp, tp):
    res = {r["coords"]: r for r in minidist.run(_masks_case, dp * pp * tp, dp, pp, tp, timeout=180)}
    some = res[(0, 0, 0)]["megatron"]
    assert [r for r, _ in some] == ["replicated", "model-parallel", "replicated", "replicated"], \
        "embedding, attention probabilities, attention output, MLP output"
    for _, mask in some:
        assert 1 - P - 0.15 < mask.float().mean().item() < 1 - P + 0.15, "dropout must be on"
    for a, b in itertools.combinations(res, 2):
        (da, pa, ta), (db, pb, tb) = a, b
        A, B = res[a], res[b]
        if da == db and pa == pb:                      # TP ranks of one stage
            for name in ("megatron", "dp_random_init", "no_pp_offset"):
                assert _equal(_region(A[name], "replicated"), _region(B[name], "replicated")), \
                    (name, a, b, "replicated activations need the same mask on every TP rank")
                assert _all_differ(A[name], B[name], "model-parallel"), \
                    (name, a, b, "each TP rank's heads need their own mask")
        if pa != pb:                                   # different stages: different layers
            assert _all_differ(A["megatron"], B["megatron"]), (a, b, "stages must not repeat masks")
            if (da, ta) == (db, tb):
                assert _equal(A["no_pp_offset"], B["no_pp_offset"]), \
                    "without seed + 100·pp_rank the stages would draw the same masks"
        if da != db and (pa, ta) == (pb, tb):          # DP replicas of the same shard
            assert _equal(A["megatron"], B["megatron"]), (a, b, "Megatron default: seed reused")
            assert _all_differ(A["dp_random_init"], B["dp_random_init"]), \
                (a, b, "data_parallel_random_init: replicas draw their own masks")


def test_stage_seed_is_megatrons_formula():
    assert stage_seed(1234) == 1234
    assert stage_seed(1234, pp_rank=3) == 1234 + 300
    assert stage_seed(1234, pp_rank=3, dp_rank=2) == 1234 + 300 + 20
    assert stage_seed(1234, pp_rank=1, dp_rank=0) == 1334


def test_tracker_states_round_trip():
    """state_dict / load_state_dict: a restored tracker draws exactly the masks the saved one would."""
    from minidist.tensor_parallel.random import RNGTracker, dropout
    tracker = model_parallel_seed(5, tracker=RNGTracker(), pp_rank=1)
    x = torch.ones(4, 16)
    dropout(x, P, tracker=tracker, region="model-parallel")
    saved = tracker.state_dict()
    expected = [dropout(x, P, tracker=tracker, region=r) for r in ("replicated", "model-parallel")]
    fresh = RNGTracker()
    fresh.load_state_dict(saved)
    again = [dropout(x, P, tracker=fresh, region=r) for r in ("replicated", "model-parallel")]
    assert all(torch.equal(a, b) for a, b in zip(expected, again))
    assert fresh.seeds == {"replicated": 105, "model-parallel": 105 + 2718}


def _train_step_masks_case(rank, world):
    grid = ProcessGrid(dp=2, pp=2, tp=2)
    model = HybridGPT(dataclasses.replace(CFG, n_layer=2), grid, seed=0)
    modules = wrap_stages(model, "flat")
    opt = make_optimizer(model, "flat", torch.optim.SGD, lr=0.1)
    grid_seed(SEED, grid)
    ids = torch.randint(0, CFG.vocab_size, (4, 8), generator=torch.Generator().manual_seed(0))
    with record_masks() as log:
        train_step(model, opt, modules, ids, torch.roll(ids, -1, 1), microbatches=2)
    return (grid.dp_rank, grid.pp_rank, grid.tp_rank), log


def test_masks_in_a_pipelined_3d_train_step():
    """HybridGPT, 1F1B, 2 micro-batches per replica: stage 0 draws embedding + block 0 masks per
    micro-batch, stage 1 block 1's; the rules above hold in the real step."""
    res = dict(minidist.run(_train_step_masks_case, 8, timeout=180))
    block = ["model-parallel", "replicated", "replicated"]       # attention probs, attn out, MLP
    assert [r for r, _ in res[(0, 0, 0)]] == (["replicated"] + block) * 2   # + embedding
    assert [r for r, _ in res[(0, 1, 0)]] == block * 2
    for (d, p, t), log in res.items():
        assert _all_differ(log[:len(log) // 2], log[len(log) // 2:]), "micro-batches differ"
        assert _equal(log, res[(1 - d, p, t)]), "DP replicas: the same masks (Megatron default)"
        assert _equal(_region(log, "replicated"), _region(res[(d, p, 1 - t)], "replicated"))
        assert _all_differ(log, res[(d, p, 1 - t)], "model-parallel")
    s0 = [m for i, m in enumerate(res[(0, 0, 0)]) if i % 4]           # stage 0 without embedding
    assert _all_differ(s0, res[(0, 1, 0)]), "stages draw their own masks"


def _recompute_case(rank, world, moe):
    """One step's gradients with dropout on, per recomputation mode (the tracker reseeded first)."""
    cfg = dataclasses.replace(CFG, n_layer=4)
    grid = ProcessGrid(dp=2, pp=2, tp=1, ep=2 if moe else 1)
    out = {}
    for recompute in ("none", "minidist", "torch"):
        model = HybridGPT(cfg, grid, seed=0, recompute=recompute, chunks=2, placement="v",
                          moe=dict(num_experts=4, top_k=2, aux_loss_coeff=1e-2) if moe else None)
        for s in model.stages.values():
            s.train()
        grid_seed(SEED, grid)
        torch.manual_seed(7)
        ids = torch.randint(0, cfg.vocab_size, (8, 8), generator=torch.Generator().manual_seed(5))
        train_step(model, None, wrap_stages(model, "flat"), ids, ids.roll(-1, 1), 4,
                   schedule="zb-v", loss_reduction="per_token", step=False)
        out[recompute] = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return out


@pytest.mark.timeout(180)
def test_recomputation_replays_the_dropout_tracker_under_a_split_backward():
    """Regression: torch's checkpoint replays torch's generators, not the TP dropout tracker's, so
    the recomputed masks differed (silently: different gradients; with experts the routing changed
    and the recomputation failed on a shape). Both recomputations must give the gradients of no
    recomputation bit for bit, under the zero-bubble split (recomputed twice), dense and MoE."""
    for moe in (False, True):
        for r in minidist.run(_recompute_case, 4, moe, timeout=150):
            for mode in ("minidist", "torch"):
                assert len(r[mode]) == len(r["none"]) and all(
                    torch.equal(a, b) for a, b in zip(r[mode], r["none"])), (moe, mode)
