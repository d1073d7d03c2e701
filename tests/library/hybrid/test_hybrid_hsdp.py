"""``dp_mode="hsdp"``: each pipeline stage one HSDP unit, sharded over the CP group and replicated
over the DP group (torchtitan's ``("dp_replicate", "dp_shard_cp")`` mesh), equal to one process.

One launch of 8 ranks, two grids:

* dp 2 x cp 2 x pp 2 (ring attention, zigzag): every stage's parameters are halves (1/cp rows),
  replicated on the two DP ranks; one step with a tied embedding, a per-token loss over ignored
  targets, 4 ragged micro-batches (gradient accumulation: one reduce-scatter and one all-reduce
  per stage) and clipping — loss, norm and clipped gradients within 1e-6 of one process (the
  matrix's fp32 tolerance), DP replicas and the tied copies bitwise equal; after an SGD step the
  two replicas of each shard are still bitwise equal. The norm counts each shard once: summed
  over DP×CP, as ZeRO-3's, it would be √2 times one process's;
* dp 2 x pp 2 x tp 2 with cp = 1: the shard group is the rank alone (HSDP degenerates to whole
  parameters all-reduced over DP by the units' hooks), the same checks.

On the first grid, the refusals, every rank, before any communication: a zero-bubble schedule
(its weight pass runs outside the units' hooks), and stages wrapped for ``"zero3"`` stepped as
``"hsdp"`` (or the other way round): the norm would count the shards over the wrong group.
"""

import pytest
import torch
import torch.distributed as dist

import minidist
from minidist.grid import ProcessGrid
from minidist.hybrid import HybridGPT, make_optimizer, train_step, wrap_stages
from minidist_course.references import hybrid as R

TOL, B, M = 1e-6, 14, 4        # 7 samples per replica in 4 micro-batches: 2, 2, 2, 1


def _refusal(fn) -> str | None:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def _ranks(comm):
    return None if comm is None else sorted(dist.get_process_group_ranks(comm.group))


def _grid(dp, pp, tp, cp):
    grid = ProcessGrid(dp, pp, tp, cp=cp)
    model = HybridGPT(R.CFG, grid, seed=0)          # tied embedding
    whole = [tuple(p.shape) for p in model.parameters()]
    modules = wrap_stages(model, "hsdp")
    out = {"shapes": list(zip(whole, [tuple(p.shape) for p in model.parameters()])),
           "groups": [(_ranks(s._fsdp.comm), _ranks(s._fsdp.rep)) for s in model.stages.values()],
           "dp_ranks": grid.dp_ranks, "cp_ranks": grid.cp_ranks}
    if cp > 1:
        ids, targets = R.batch(B, R.CFG, 0.3)
        zb = train_step(model, None, modules, ids, targets, M, schedule="zb-h1", dp_mode="hsdp",
                        loss_reduction="per_token", max_norm=R.MAX_NORM, step=False)
        out["zb"] = dict(coords=(grid.dp_rank * grid.cp_size + grid.cp_rank, grid.pp_rank,
                                 grid.tp_rank), loss=zb.loss, grad_norm=zb.grad_norm,
                         grads=model.gather(grads=True))
        out["as_zero3"] = _refusal(lambda: train_step(model, None, modules, ids, targets, M,
                                                      dp_mode="zero3", step=False))
    opt = make_optimizer(model, "hsdp", torch.optim.SGD, lr=0.1)
    ids, targets = R.batch(B, R.CFG, 0.3)
    step = train_step(model, opt, modules, ids, targets, M, dp_mode="hsdp",
                      loss_reduction="per_token", max_norm=R.MAX_NORM, step=False)
    out.update(coords=(grid.dp_rank * grid.cp_size + grid.cp_rank, grid.pp_rank, grid.tp_rank),
               place=(grid.cp_rank, grid.pp_rank, grid.tp_rank), loss=step.loss,
               grad_norm=step.grad_norm, grads=model.gather(grads=True))
    opt.step()
    out["shards"] = [p.detach().clone() for p in model.parameters()]
    grid.close()
    return out


def _rank(rank, world):
    return [_grid(2, 2, 1, 2), _grid(2, 2, 2, 1)]


@pytest.mark.timeout(120)
def test_hsdp_per_stage_equals_one_process_with_cp_and_without():
    per_rank = minidist.run(_rank, 8, timeout=90)
    ref = R.reference(R.MAX_NORM, R.CFG, B, 0.3, "mean")
    assert ref["grad_norm"] > R.MAX_NORM                  # clipping is active
    for g, (cp, tp) in enumerate(((2, 1), (1, 2))):
        results = [r[g] for r in per_rank]
        for r in results:                                   # sharded over CP, replicated over DP
            assert all(pair == (sorted(r["cp_ranks"]), sorted(r["dp_ranks"])) for pair in r["groups"])
            # each parameter keeps ceil(d0 / cp) of its rows (cp = 1: all of them)
            assert all(after == (-(-before[0] // cp),) + before[1:]
                       for before, after in r["shapes"]), r["shapes"]
            if cp > 1:
                assert "dp_mode='zero3'" in r["as_zero3"] and "wrap_stages" in r["as_zero3"]
        if cp > 1:   # ZB-H1's weight pass W, a backward of its own: gathered before, reduced after
            zb = R.compare([r["zb"] for r in results], ref)
            assert max(zb["loss"], zb["grad_norm"], zb["grads"]) <= TOL and not zb["missing"], zb
        err = R.compare(results, ref)
        assert not err["missing"], err
        assert max(err["loss"], err["grad_norm"], err["grads"]) <= TOL, (cp, tp, err)
        assert err["replicas"] == 0 and err["tied"] == 0, (cp, tp, err)
        by_place = {}
        for r in results:      # after the step: each shard's DP replicas bitwise equal
            other = by_place.setdefault(r["place"], r["shards"])
            assert all(torch.equal(a, b) for a, b in zip(other, r["shards"]))
        assert len(by_place) == len(results) // 2
