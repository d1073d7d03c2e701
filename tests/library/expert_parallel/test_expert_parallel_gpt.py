"""EP x DP training of the MoE GPT equals one process on the global batch (issue 24, step 3).

For each (dp, ep, E, k, capacity factor) — including ep = 4 with E = 2 (two ranks own no experts),
capacity factors that drop tokens, k = 1 and 2 — three AdamW steps (weight decay, clipping by the
global norm active) give, against :class:`MoEGPT` in one process on the global batch (with
``drop_chunks = W`` so it drops the same tokens):

* the loss (cross-entropy + aux + z-loss; mean over ranks) at every step within 1e-6;
* the first step's synchronised, clipped gradients and the final parameters within 1e-6 absolute
  (fp32), every expert checked on the rank that owns it. AdamW's eps is 1e-5, not 1e-8: the
  attention key bias's gradient is zero up to rounding (softmax is shift-invariant per query), and
  with eps 1e-8 Adam's normalisation turns a ±1e-9 rounding difference into a ±lr step (measured:
  1.4e-4 after 3 steps); with eps 1e-5 an element's step is at most lr·|g|/eps;
* expert replicas bitwise identical over their expert-DP group, non-expert parameters over the world.

Two wrong gradient averagings are built here and caught: expert gradients averaged over the whole
world (mixing different experts), and averaged over the expert-DP group only (the all-to-all has
already summed the ep ranks' contributions: ep times too large; Adam's scale invariance hides it
in the parameters, the gradients show it). And activation recomputation: the same gradients, while
the forward runs twice per step and the per-step statistics still count T·k per layer, once.
"""

import pytest
import torch

import minidist
from minidist.expert_parallel.gpt import (
    MoEGPT,
    clip_grad_norm_,
    global_grad_norm,
    is_expert,
    sync_grads,
)
from minidist.grid import ProcessGrid, grid_layout
from minidist.models.gpt import GPTConfig

CFG = GPTConfig(vocab_size=29, block_size=8, n_layer=2, n_head=2, n_embd=16)
B, STEPS, LR, EPS, MAX_NORM, TOL = 2, 3, 3e-3, 1e-5, 0.5, 1e-6
MOE = dict(aux_loss_coeff=0.01, z_loss_coeff=0.001)
# (replicas of each expert = expert-DP size, ep, E, k, capacity_factor): the grid is
# ProcessGrid(dp=replicas·ep, ep=ep), expert parallelism folded over the data-parallel ranks
CONFIGS = {4: [(1, 4, 2, 1, None), (2, 2, 4, 2, 1.0), (4, 1, 4, 1, 1.0), (1, 4, 8, 2, 1.25)],
           2: [(1, 2, 4, 2, None), (2, 1, 2, 1, 1.0), (1, 2, 8, 1, 0.5)]}


def batch(world, step):
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, CFG.vocab_size, (world * B, CFG.block_size), generator=g)
    return ids, torch.roll(ids, -1, dims=1)


def sync_world_avg(model, grid):       # wrong: expert gradients averaged like the dense ones
    from minidist.expert_parallel.gpt import _flat_all_reduce
    _flat_all_reduce([p.grad for p in model.parameters()], "avg", grid.dp_group)


def sync_dp_only(model, grid):         # wrong: expert gradients divided by dp/ep, not dp
    from minidist.expert_parallel.gpt import _flat_all_reduce
    _flat_all_reduce([p.grad for p in model.parameters() if not is_expert(p)], "avg",
                     grid.dp_group)
    if grid.expert_dp_size > 1:
        _flat_all_reduce([p.grad for p in model.parameters() if is_expert(p)], "avg",
                         grid.expert_dp_group)


SYNCS = {"right": sync_grads, "world_avg": sync_world_avg, "dp_only": sync_dp_only}


def named(model, grads=False):
    """Parameters by a name that is the same in one process and on the owning EP rank."""
    out = {}
    for name, p in model.named_parameters():
        t = p.grad if grads else p.detach()
        if is_expert(p):   # blocks.L.mlp.experts.i.rest -> expert id of local index i
            parts = name.split(".")
            layer = model.blocks[int(parts[1])].mlp
            parts[4] = str(layer.expert_ids[int(parts[4])])
            name = ".".join(parts)
        out[name] = t.clone()
    return out


def train(model, world, rank, grid, sync, steps=STEPS):
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=0.1)
    losses, first_grads, norms = [], None, []
    for step in range(steps):
        ids, targets = batch(world, step)
        lo = slice(rank * B, (rank + 1) * B) if grid is not None else slice(None)
        opt.zero_grad()
        _, loss = model(ids[lo], targets[lo])
        loss.backward()
        if grid is not None:
            SYNCS[sync](model, grid)
            norms.append(clip_grad_norm_(model, grid, MAX_NORM))
        else:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        if step == 0:
            first_grads = named(model, grads=True)
        opt.step()
        losses.append(float(loss.detach()))
    return losses, first_grads, norms


def _rank(rank, world, configs):
    out = []
    for dp, ep, E, k, cf in configs:
        grid = ProcessGrid(dp * ep, ep=ep)
        per_sync = {}
        for sync in (("right", "world_avg", "dp_only") if dp > 1 and ep > 1 else ("right",)):
            torch.manual_seed(0)
            model = MoEGPT(CFG, E, k, grid=grid, capacity_factor=cf, **MOE)
            losses, grads, norms = train(model, world, rank, grid, sync)
            per_sync[sync] = (losses, grads, norms, named(model))
        out.append(((grid.expert_dp_rank, grid.ep_rank), per_sync))
    return out


def reference(world, E, k, cf):
    torch.manual_seed(0)
    model = MoEGPT(CFG, E, k, capacity_factor=cf, drop_chunks=world, **MOE)
    losses, grads, norms = train(model, world, 0, None, "right")
    return losses, grads, norms, named(model)


def _err(got: dict, ref: dict) -> float:
    return max((got[n] - ref[n]).abs().max().item() for n in got)


@pytest.mark.timeout(280)
@pytest.mark.parametrize("world", [2, 4])
def test_ep_dp_adamw_steps_equal_one_process(world):
    results = minidist.run(_rank, world, CONFIGS[world], timeout=250)
    for i, (dp, ep, E, k, cf) in enumerate(CONFIGS[world]):
        where = f"dp={dp} ep={ep} E={E} k={k} cf={cf}"
        ref_losses, ref_grads, ref_norms, ref_params = reference(world, E, k, cf)
        ranks = [r[i] for r in results]
        covered = set()
        for (d, e), per_sync in ranks:
            losses, grads, norms, params = per_sync["right"]
            covered |= set(params)
            assert abs(norms[0] - ref_norms[0]) <= TOL * max(1.0, ref_norms[0]), where
            assert _err(grads, ref_grads) <= TOL, (where, d, e)
            assert _err(params, ref_params) <= TOL, (where, d, e)
        assert covered == set(ref_params), where     # every expert owned by some rank
        for step in range(STEPS):
            mean = sum(r[1]["right"][0][step] for r in ranks) / world
            assert abs(mean - ref_losses[step]) <= TOL, (where, step)
        # replicas: bitwise equal over the expert-DP group (same ep rank) and the world (dense)
        for (d, e), per_sync in ranks:
            for (d2, e2), other in ranks:
                a, b = per_sync["right"][3], other["right"][3]
                for name in set(a) & set(b):
                    assert torch.equal(a[name], b[name]), (where, name, (d, e), (d2, e2))
        if dp > 1 and ep > 1:    # the wrong averagings are caught
            for sync in ("world_avg", "dp_only"):
                worst = max(_err(per_sync[sync][1], ref_grads) for _, per_sync in ranks)
                assert worst > 1e3 * TOL, (where, sync, worst)
            worst = max(_err(per_sync["world_avg"][3], ref_params) for _, per_sync in ranks)
            assert worst > 1e2 * TOL, (where, "world_avg params", worst)


def _recompute_rank(rank, world, E, k):
    grid = ProcessGrid(world, ep=world)
    res = {}
    for recompute in (False, True):
        torch.manual_seed(0)
        model = MoEGPT(CFG, E, k, grid=grid, capacity_factor=1.0, recompute=recompute, **MOE)
        calls = [0]
        for m in model.moe_layers():
            m.register_forward_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
        total = torch.zeros(CFG.n_layer, E, dtype=torch.int64)
        for step in range(2):
            ids, targets = batch(world, step)
            model.zero_grad()
            _, loss = model(ids[rank * B:(rank + 1) * B], targets[rank * B:(rank + 1) * B])
            loss.backward()
            total += model.tokens_per_expert()
        res[recompute] = (named(model, grads=True), calls[0], total)
    return res, global_grad_norm(model, grid)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world,E,k", [(2, 4, 2), (3, 2, 1)])   # W=3, E=2: rank 2 owns no expert
def test_recomputation_gives_the_same_gradients_and_counts_tokens_once(world, E, k):
    for res, _ in minidist.run(_recompute_rank, world, E, k, timeout=100):
        (g0, calls0, total0), (g1, calls1, total1) = res[False], res[True]
        assert _err(g1, g0) == 0.0                       # same math, same order
        assert calls0 == 2 * CFG.n_layer and calls1 == 2 * calls0   # the forward did run twice
        assert torch.equal(total0, total1)
        assert (total1.sum(1) == 2 * B * CFG.block_size * k).all()  # steps x T x k, once


def test_ep_is_folded_over_dp_and_cp_and_bad_sizes_are_refused():
    lay = grid_layout(4, 4, ep=2)
    assert (lay["ep"], lay["expert_dp"], lay["dp"]) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]],
                                                       [[0, 1, 2, 3]])
    lay = grid_layout(8, 4, tp=2, ep=2)   # the grid module's docstring example
    assert [1, 3, 5, 7] in lay["dp"] and [5, 7] in lay["ep"] and [1, 5] in lay["expert_dp"]
    lay = grid_layout(8, 2, cp=2, tp=2, ep=4)   # folded over dp x cp: all four such ranks
    assert lay["ep"] == lay["dp_cp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    with pytest.raises(ValueError, match=r"ep=3 must divide dp x cp = 4 x 1 = 4"):
        grid_layout(4, 4, ep=3)


def _moe_on_a_tp_grid(rank, world):
    with pytest.raises(ValueError, match=r"MoEGPT \(rank \d\): .* not with tp=2"):
        MoEGPT(CFG, 4, 2, grid=ProcessGrid(2, tp=2, ep=2))
    return True


def test_moe_gpt_refuses_a_grid_it_cannot_use_naming_the_axis():
    assert minidist.run(_moe_on_a_tp_grid, 4, timeout=60) == [True] * 4
