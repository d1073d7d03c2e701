"""Mixture-of-experts blocks inside the pipeline stages (``HybridGPT(moe=...)``): expert parallelism
as the fifth axis of the training step, equal to one process with the other axes, refusals by name.

One launch per world size checks several configurations. The one process is
:func:`minidist_course.references.hybrid.moe_reference` (aux losses per micro-batch, the capacity
rule per replica's slice); fp32, one step, clipping active: relative 1e-6 as the composition
matrix. Each configuration also checks the routers' gradients alone (the aux losses reach only
them and the layers below: a dropped aux gradient would hide in the model-wide norm) and, with a
capacity, that tokens were really dropped.

Field reports made tests here: the aux loss's autoscaler whose output was discarded, so no aux
gradient flowed (NVIDIA-NeMo/Automodel#1408) — the routers' gradients are checked alone; aux
gradients scaled by the DP size or the token count (Automodel#1412), by the TP/CP size under a
per-token loss (NVIDIA/Megatron-LM PR #5047), not normalised over accumulated micro-batches
(Automodel PR #3359), a load-balancing loss that changes with the pipeline size
(databricks/megablocks#85) — every configuration below, per-token with TP and CP among them, is
compared with one process.
"""

import pytest
import torch

import minidist
from minidist.grid import ProcessGrid
from minidist.hybrid import HybridGPT, make_optimizer, train_step, wrap_stages
from minidist_course.references import hybrid as R

MOE = dict(num_experts=4, top_k=2, aux_loss_coeff=1e-2, z_loss_coeff=1e-3)
TOL = 1e-6
M, B = 4, 8


def _step(grid_sizes, schedule="1f1b", recompute="none", loss="per_token", dp_mode="flat",
          moe=MOE, cfg=R.CFG, sequence_parallel=False):
    dp, pp, tp, cp, ep = grid_sizes
    chunks = 2 if schedule in ("interleaved", "zb-v", "dualpipe-v") else 1
    grid = ProcessGrid(dp, pp, tp, cp=cp, ep=ep)
    model = HybridGPT(cfg, grid, chunks=chunks, recompute=recompute, moe=moe,
                      sequence_parallel=sequence_parallel,
                      placement="v" if schedule in ("zb-v", "dualpipe-v") else "loop")
    modules = wrap_stages(model, dp_mode)
    opt = make_optimizer(model, "zero1", torch.optim.SGD, lr=0.0) if dp_mode == "zero1" else None
    ids, targets = R.batch(B, cfg, 0.3 if loss == "per_token" else 0.0)
    out = train_step(model, opt, modules, ids, targets, M, schedule=schedule, dp_mode=dp_mode,
                     loss_reduction=loss, max_norm=R.MAX_NORM, step=False)
    if opt is not None:
        opt.full_gradients_()
    dropped = sum(m.stats.dropped_fraction for m in model.moe_layers)
    return {"coords": (grid.dp_rank * grid.cp_size + grid.cp_rank, grid.pp_rank, grid.tp_rank),
            "loss": out.loss, "aux": out.aux_loss, "grad_norm": out.grad_norm,
            "grads": model.gather(grads=True), "dropped": dropped}


def _refusal(grid_sizes, **kw):
    try:
        _step(grid_sizes, **kw)
    except ValueError as e:
        return str(e)
    return None


CASES_4 = {   # name: (dp, pp, tp, cp, ep), options
    "dp2 pp2 ep2, zb-v, minidist recompute, capacity": ((2, 2, 1, 1, 2), dict(
        schedule="zb-v", recompute="minidist", moe={**MOE, "capacity_factor": 1.0})),
    "dp2 pp2 ep2, dualpipe-v, torch recompute, sum": ((2, 2, 1, 1, 2), dict(
        schedule="dualpipe-v", recompute="torch", loss="sum")),
    "dp2 tp2 ep2 (EP with TP: experts replicated over TP), mean": ((2, 1, 2, 1, 2),
                                                                   dict(loss="mean")),
    "dp2 tp2+sp ep2 (each TP rank routes its own positions), mean": ((2, 1, 2, 1, 2), dict(
        loss="mean", sequence_parallel=True)),
    "cp2 (ring), ep2 folded over CP, zb-h1": ((1, 2, 1, 2, 2), dict(schedule="zb-h1")),
    "ep1, bucketed": ((2, 2, 1, 1, 1), dict(dp_mode="bucketed")),
    "ep2, bucketed (experts out of the buckets)": ((2, 2, 1, 1, 2), dict(dp_mode="bucketed")),
    "ep2, zero1 (experts' slices over expert-DP)": ((2, 2, 1, 1, 2), dict(dp_mode="zero1")),
    "ep2, zero3 (each expert a unit over expert-DP)": ((2, 2, 1, 1, 2), dict(dp_mode="zero3")),
    # a capacity where each rank holds scattered positions: one process drops among each rank's
    "cp2 ep2, capacity (each rank drops among its own positions)": ((1, 2, 1, 2, 2), dict(
        moe={**MOE, "capacity_factor": 1.0})),
    "dp2 tp2+sp ep2, capacity": ((2, 1, 2, 1, 2), dict(
        sequence_parallel=True, moe={**MOE, "capacity_factor": 1.0}, loss="mean")),
    "ep1, zero1, interleaved": ((2, 2, 1, 1, 1), dict(dp_mode="zero1", schedule="interleaved")),
}
REFUSALS_4 = {   # name: (grid, options, words every rank's ValueError must hold)
    "ep without experts": ((2, 2, 1, 1, 2), dict(moe=None), ("ep=2", "dense")),
    "hsdp x ep2": ((2, 2, 1, 1, 2), dict(dp_mode="hsdp"), ("'hsdp'", "expert")),
}


def _rank_4(rank, world):
    out = {name: _step(g, **kw) for name, (g, kw) in CASES_4.items()}
    out.update({name: _refusal(g, **kw) for name, (g, kw, _) in REFUSALS_4.items()})
    return out


def _check(name, results, moe, dp, loss, groups=None):
    reduction = "sum" if loss == "sum" else "mean"
    ref = R.moe_reference(moe, dp, M, R.MAX_NORM, R.CFG, B, 0.3 if loss == "per_token" else 0.0,
                          reduction, groups=groups)
    err = R.compare(results, ref)
    assert not err["missing"], (name, err["missing"])
    worst = max(err["loss"], err["grad_norm"], err["grads"])
    assert worst < TOL and err["replicas"] == 0 and err["tied"] == 0, (name, err)
    for r in results:
        assert abs(r["aux"] - ref["aux_loss"]) <= TOL * ref["aux_loss"], (name, r["aux"])
        for k, g in r["grads"].items():
            if "router" in k:   # the aux losses' gradient, checked on its own
                assert (g - ref["grads"][k]).norm() <= 1e-5 * ref["grads"][k].norm(), (name, k)
    return ref


@pytest.mark.timeout(240)
def test_experts_in_pipeline_stages_equal_one_process_with_every_other_axis():
    results = minidist.run(_rank_4, 4, timeout=200)
    for name, (g, kw) in CASES_4.items():
        moe = kw.get("moe", MOE)
        sp = g[2] if kw.get("sequence_parallel") else 1
        groups = (R.token_groups(g[0], g[3], "zigzag", sp)
                  if moe.get("capacity_factor") and g[3] * sp > 1 else None)
        _check(name, [r[name] for r in results], moe, g[0], kw.get("loss", "per_token"), groups)
        if moe.get("capacity_factor"):
            assert all(r[name]["dropped"] > 0 for r in results), name   # the rule was exercised
    for name, (_, _, words) in REFUSALS_4.items():
        got = [r[name] for r in results]
        assert all(m is not None and all(w in m for w in words) for m in got), (name, got)


def test_the_aux_loss_weight_follows_the_loss_reduction():
    """Every reduction leaves the aux part of the gradient at ``Σ_m w_m ∇aux(m)`` (unit check of
    the arithmetic the launch above checks end to end)."""
    from minidist.hybrid.moe import aux_weight
    # "mean": the DP x CP average divides by 4 already; "sum": summed over 4 ranks;
    # "per_token": summed, then divided by the 50 counted tokens
    assert aux_weight("mean", 4, 4, 50)(1) == 0.25
    assert aux_weight("sum", 4, 4, 50)(1) == 0.25 / 4
    assert aux_weight("per_token", 4, 4, 50)(2) == 0.5 * 50 / 4


@pytest.mark.timeout(240)
def test_five_axes_at_eight_ranks_every_axis_but_one_above_one():
    """(dp, pp, tp, ep) = (2, 2, 2, 2) at W = 8, cp = 1 — and (dp, pp, cp, ep) = (2, 2, 2, 2)
    would be the other W = 8 run; the W = 16 run with all five is in the integration tier."""
    results = minidist.run(_rank_8, 8, timeout=200)
    _check("dp2 pp2 tp2 ep2", results, MOE, 2, "per_token")


def _rank_8(rank, world):
    return _step((2, 2, 2, 1, 2), schedule="zb-v", recompute="minidist")


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_five_axes_at_sixteen_ranks_equal_one_process():
    """(dp, pp, cp, tp, ep) = (2, 2, 2, 2, 2 folded over dp x cp) at W = 16: the tiny MoE GPT, one
    step of the V-shaped zero-bubble schedule with recomputation, against one process."""
    results = minidist.run(_rank_16, 16, timeout=540)
    _check("all five axes", results, MOE, 2, "per_token")


def _rank_16(rank, world):
    return _step((2, 2, 2, 2, 2), schedule="zb-v", recompute="minidist")


def _router_after_steps(rank, world):
    """Two SGD steps with experts under sequence parallelism; each rank's router weights."""
    grid = ProcessGrid(2, 1, 2, ep=2)
    model = HybridGPT(R.CFG, grid, moe=MOE, sequence_parallel=True)
    modules = wrap_stages(model, "flat")
    opt = make_optimizer(model, "flat", torch.optim.SGD, lr=0.1)
    ids, targets = R.batch(B, R.CFG, 0.0)
    for _ in range(2):
        train_step(model, opt, modules, ids, targets, M, loss_reduction="mean")
    routers = [layer.router.weight.detach().clone() for layer in model.moe_layers]
    return grid.tp_rank, grid.dp_rank, routers


@pytest.mark.timeout(120)
def test_the_router_stays_identical_on_the_tp_ranks_under_sequence_parallelism():
    """Field report torchtitan#2387 (fixed in #2416): with the MoE layer on sequence shards, the
    router's gradient is partial on each TP rank; without a sum over TP the TP ranks' routers
    drift apart. After two steps they are bitwise equal here."""
    out = minidist.run(_router_after_steps, 4, timeout=100)
    by_dp: dict = {}
    for tp_rank, dp_rank, routers in out:
        by_dp.setdefault(dp_rank, []).append(routers)
    for copies in by_dp.values():
        assert len(copies) == 2 and all(torch.equal(a, b) for a, b in zip(*copies))
