"""Sharding under the variations people train with (each failed on the old code): parameters
frozen at wrap time and unfrozen later, frozen and trainable parameters in one unit, frozen units,
weight decay on ``p.dim() >= 2`` only, modules outside every unit, clipping with ``norm_type``,
bf16 units with frozen weights, recomputed blocks, and recomputed tensor-parallel dropout.

References: one process on the global batch (fp32: tolerance 1e-6, sums in another order) and
torch's FSDP2 ``fully_shard`` on the same inputs (bf16 cases: measured bit-identical, 0.0).
The setups are tests/_sharding_cases.py's; the differential test generates more of them.
"""

import pytest
import torch
import torch._dynamo  # noqa: F401  (forked ranks build optimizers, which import it)

import minidist
from _sharding_cases import case, max_diff, run_case

TOL = 1e-6
THAW = "blocks.0.fc1.weight"
BLOCK1 = ["blocks.1.fc1.weight", "blocks.1.fc1.bias", "blocks.1.fc2.weight", "blocks.1.fc2.bias",
          "blocks.1.gain"]
CASES = {   # name: (case, the ways that must equal one process)
    "unfrozen after wrap": (case(frozen=[THAW], changes=[(2, THAW, True)]),
                            ["fsdp", "zero1", "zero2"]),
    "frozen and trainable in one unit": (case(frozen=["blocks.0.fc2.weight", "blocks.1.gain"]),
                                         ["fsdp", "zero1", "zero2"]),
    "frozen unit, thawed at step 1": (case(frozen=BLOCK1, changes=[(1, n, True) for n in BLOCK1]),
                                      ["fsdp", "zero1", "zero2"]),
    "frozen later, a whole unit": (case(changes=[(2, n, False) for n in BLOCK1]),
                                   ["fsdp"]),
    "weight decay on dim >= 2 only": (case(groups="decay"), ["fsdp", "zero1", "zero2"]),
    "recomputed blocks, untied, accumulation, eval forwards":
        (case(recompute=True, tie=False, accum=2, eval=True, groups="decay"), ["fsdp", "zero2"]),
    # found by the differential test: torch's FSDP2 is 0.0167 off on this at W = 4 — a parameter
    # frozen after wrapping, with gradient accumulation (no sync on the first micro-batch) and a
    # no_grad eval forward between steps; without any one of the three FSDP2 is right
    "frozen after wrap, accumulation and eval forwards, root unit only":
        (case(units="root", hidden=[2], d=1, tie=False, buffer=False, steps=3,
              frozen=["blocks.0.fc1.weight"], groups="decay", accum=2, eval=True,
              changes=[(2, "blocks.0.gain", True), (2, "inp.bias", False)], recompute=True),
         ["fsdp"]),   # ZeRO-1/2 refuse a refreeze inside a flat buffer (tested below)
    "clip, L1": (case(clip=(0.1, 1.0)), ["fsdp"]),
    "clip, inf": (case(clip=(0.05, float("inf"))), ["fsdp"]),
    "clip, L2, binding": (case(clip=(0.05, 2.0), opt="sgd"), ["fsdp"]),
}
MP = {  # bf16 units with frozen weights (LoRA-style): equal torch's FSDP2
    "bf16, a frozen Linear in a unit": case(mp="bf16", buffer=False, frozen=["blocks.1.fc1.weight"]),
    "bf16, a frozen unit": case(mp="bf16", buffer=False, frozen=BLOCK1),
}


def _all(rank, world):
    out = {name: {h: run_case(c, h, rank, world) for h in hows} for name, (c, hows) in CASES.items()}
    for name, c in MP.items():
        out[name] = {h: run_case(c, h, rank, world) for h in ("fsdp", "torch-fsdp2")}
    thaw = CASES["unfrozen after wrap"][0]
    out["flat, unfrozen"] = run_case(thaw, "fsdp-flat", rank, world)
    out["flat, decay"] = run_case(CASES["weight decay on dim >= 2 only"][0], "fsdp-flat", rank, world)
    out["ddp, unfrozen"] = run_case(thaw, "torch-ddp", rank, world)
    out["outside"] = run_case(case(units="blocks", clip=(0.1, 2.0)), "fsdp", rank, world)
    refrozen = case(changes=[(2, "blocks.0.fc1.weight", False)])
    out["zero1 refrozen"] = run_case(refrozen, "zero1", rank, world)
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 3])
def test_variations_train_like_one_process_or_fail_clearly(world):
    single = {name: run_case(c, "single") for name, (c, _) in CASES.items()}
    res = minidist.run(_all, world, timeout=220)
    for r, out in enumerate(res):
        for name, (c, hows) in CASES.items():
            for h in hows:
                assert max_diff(out[name][h], single[name]) <= TOL, (world, r, name, h, out[name][h]
                                                                    if isinstance(out[name][h], str)
                                                                    else "")
        for name in MP:
            assert max_diff(out[name]["fsdp"], out[name]["torch-fsdp2"]) <= TOL, (name, out[name])
        # the flat design: a clear error when a frozen parameter thaws; silently no weight decay
        # under the dim >= 2 recipe (its one 1-D shard per unit has dim 1): why it was replaced
        assert "frozen at wrap time" in out["flat, unfrozen"] and THAW.split(".", 2)[2] in \
            out["flat, unfrozen"]
        assert max_diff(out["flat, decay"], single["weight decay on dim >= 2 only"]) > 1e-3
        # torch's DDP does not sync a parameter that was frozen at construction: wrong, silently
        assert max_diff(out["ddp, unfrozen"], single["unfrozen after wrap"]) > 1e-3
        assert "inp.weight" in out["outside"] and "head_bias" in out["outside"] \
            and "no fully_shard unit" in out["outside"]
        # ShardedOptimizer is given tensors, not names: it names the parameter as torch's
        # optimizers index it (blocks.0.fc1.weight is parameter 4 of the group, shape (3, 6))
        assert "group 0 param 4 (3, 6)" in out["zero1 refrozen"] and "frozen now" in \
            out["zero1 refrozen"], out["zero1 refrozen"]
    # the training moved the weights: the comparisons could fail
    assert max_diff(single["unfrozen after wrap"],
                    run_case(case(frozen=[THAW]), "single")) > 1e-3


def _tp_dropout(rank, world, recompute):
    from minidist.sharding import checkpoint
    from minidist.tensor_parallel.random import dropout, model_parallel_seed
    torch.manual_seed(0)
    w = torch.randn(6, 8, requires_grad=True)      # this rank's column shard of a TP Linear
    x = torch.randn(4, 6, requires_grad=True)

    def block(x):
        h = dropout(torch.tanh(x @ w), 0.5, region="model-parallel")
        return dropout(h, 0.3, region="replicated")

    model_parallel_seed(1234)
    y = checkpoint(block, x) if recompute else block(x)
    (y * torch.arange(8.0)).sum().backward()
    return w.grad, x.grad


@pytest.mark.timeout(60)
def test_recomputation_replays_the_tensor_parallel_dropout_tracker():
    plain = minidist.run(_tp_dropout, 2, False, timeout=50)
    again = minidist.run(_tp_dropout, 2, True, timeout=50)
    for (w0, x0), (w1, x1) in zip(plain, again):
        assert torch.equal(w0, w1) and torch.equal(x0, x1)
    assert not torch.equal(plain[0][0], plain[1][0])   # the two TP ranks drew different masks


def _refusals(rank, world):
    from torch import nn
    from minidist.sharding import fsdp
    out = {}
    scalar = nn.Linear(3, 2)
    scalar.temperature = nn.Parameter(torch.tensor(1.0))
    mixed = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2).double())
    for what, m in (("0-d", scalar), ("dtypes", mixed)):
        try:
            fsdp.fully_shard(m)
            out[what] = "no error"
        except ValueError as e:
            out[what] = str(e)
    return out


@pytest.mark.timeout(60)
def test_per_parameter_refusals_name_the_parameter():
    out = minidist.run(_refusals, 1, timeout=50)[0]
    assert "temperature" in out["0-d"] and "0-d" in out["0-d"]
    assert "1.weight: torch.float64" in out["dtypes"] and "param_dtype" in out["dtypes"]


def _fsdp2_refreeze(rank, world):
    c = CASES["frozen after wrap, accumulation and eval forwards, root unit only"][0]
    return run_case(c, "fsdp", rank, world)


@pytest.mark.timeout(120)
def test_the_case_torch_fsdp2_gets_wrong_at_w4():
    c = CASES["frozen after wrap, accumulation and eval forwards, root unit only"][0]
    single = run_case(c, "single")
    # torch 2.14's FSDP2 ends 0.0167 from one process on this case (measured when it was found;
    # not asserted, so that a fixed torch does not fail this test): minidist must be right
    for ours in minidist.run(_fsdp2_refreeze, 4, timeout=100):
        assert max_diff(ours, single) <= TOL


class _TwoExperts(torch.nn.Module):
    """Rank 0's tokens choose expert ``a`` only; rank 1's both (data-dependent use, as MoE)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x, use_b: bool):
        return self.a(x) + (self.b(x) if use_b else 0)


def _used_on_one_rank(rank, world):
    from minidist.sharding import fully_shard
    torch.manual_seed(0)
    model = fully_shard(_TwoExperts())
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    model(x, use_b=rank == 1).sum().backward()
    grads = {n: p.grad.clone() if p.grad is not None else None for n, p in model.named_parameters()}
    return grads


@pytest.mark.timeout(60)
def test_a_parameter_one_rank_did_not_use_gets_the_average_on_every_rank():
    """Regression: each rank kept the averaged gradient only for the parameters *it* used, so a
    parameter another rank used (an expert none of this rank's tokens chose) lost its gradient on
    this rank and the replicas' shards parted. One process on both ranks' data: ``b`` gets
    (its gradient from rank 1's tokens) / 2 on each rank's rows."""
    res = minidist.run(_used_on_one_rank, 2, timeout=50)
    torch.manual_seed(0)
    one = _TwoExperts()
    loss = sum(one(torch.randn(3, 4, generator=torch.Generator().manual_seed(r)), use_b=r == 1).sum()
               for r in range(2)) / 2
    loss.backward()
    for name, p in one.named_parameters():
        full = torch.cat([res[r][name] for r in range(2)])[:p.shape[0]]   # rows, dim-0 shards
        assert torch.allclose(full, p.grad, rtol=1e-6, atol=1e-7), name
