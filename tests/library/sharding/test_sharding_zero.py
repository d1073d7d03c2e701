"""ZeRO-1 and ZeRO-2 (minidist.sharding.ShardedOptimizer) equal torch's ZeroRedundancyOptimizer and
one process on the global batch.

Tolerance 1e-6 in fp32: the ranks sum gradients in a different order than one process (and the
ring in a different order than torch), so results agree up to rounding; across ranks they are
bit-identical (every rank all-gathers the same slices). The model has tied weights, a frozen
parameter, a buffer and no parameter size divisible by W (minidist_course.references.sharding).
"""

import pytest
import torch
import torch._dynamo  # noqa: F401  (forked ranks build optimizers, which import it)
import torch.distributed as dist

import minidist
from minidist.sharding import ShardedOptimizer
from minidist_course.references.sharding import (OPTIMIZERS, as_groups, local_batch, loss_fn,
    make_model, max_abs_diff, named_state, param_groups, train_single)

TOL, STEPS = 1e-6, 5


def _train(rank, world, make_opt, averaged: bool, steps=STEPS):
    model = make_model()
    opt = make_opt(model)
    for step in range(steps):
        opt.zero_grad()
        x, y = local_batch(step, rank, world)
        loss_fn(model(x), y).backward()
        if averaged:  # what DDP would have done: the reference all-reduce from torch
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= world
        opt.step()
    return model, opt


def _zero1_vs_torch(rank, world, name, groups):
    cls, hyper = OPTIMIZERS[name]

    def params(m):
        return as_groups(param_groups(m), hyper) if groups else m.parameters()

    out = {}
    for mode in ("averaged", "local"):
        m, opt = _train(rank, world, lambda m: ShardedOptimizer(params(m), cls, grads=mode,
                                                                 **hyper), mode == "averaged")
        out[mode] = named_state(m)
        out[mode + " state"] = opt.state_dict()
    from torch.distributed.optim import ZeroRedundancyOptimizer
    m, _ = _train(rank, world, lambda m: ZeroRedundancyOptimizer(params(m), cls, **hyper), True)
    out["torch zero"] = named_state(m)
    return out


def _flat_state(sd):
    return {f"{i}/{k}": v for i, s in sd["state"].items() for k, v in s.items()
            if torch.is_tensor(v)}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_zero1_equals_torch_zero_and_single_process(world, name):
    cls, hyper = OPTIMIZERS[name]
    single, single_opt = train_single(cls, STEPS, with_optimizer=True, **hyper)
    res = minidist.run(_zero1_vs_torch, world, name, False, timeout=120)
    for r, out in enumerate(res):
        for mode in ("averaged", "local"):
            assert max_abs_diff(out[mode], res[0][mode]) == 0.0, f"rank {r} diverged ({mode})"
            assert max_abs_diff(out[mode], single) <= TOL, (r, mode, "vs one process")
            assert max_abs_diff(out[mode], out["torch zero"]) <= TOL, (r, mode, "vs torch ZeRO")
            # the consolidated optimizer state equals the single process's
            assert max_abs_diff(_flat_state(out[mode + " state"]), _flat_state(single_opt)) <= TOL
    # the check can fail: training moved the parameters
    assert max_abs_diff(res[0]["local"], train_single(cls, 0, **hyper)) > 1e-3


def test_zero1_param_groups():
    cls, hyper = OPTIMIZERS["adamw"]
    single = train_single(cls, STEPS, groups=True, **hyper)
    for out in minidist.run(_zero1_vs_torch, 3, "adamw", True, timeout=120):
        assert max_abs_diff(out["local"], single) <= TOL
        assert max_abs_diff(out["averaged"], out["torch zero"]) <= TOL
        assert [g["lr"] for g in out["local state"]["param_groups"]] == [1e-2, 5e-3]


class _WrongDivisor(ShardedOptimizer):
    """Broken on purpose: sums the gradients instead of averaging them."""

    def gradient_divisor(self):
        return 1


def _zero2(rank, world, name, cap, broken=False, dp=None):
    cls, hyper = OPTIMIZERS[name]
    group, dp_rank, dp_size = None, rank, world
    if dp is not None:
        from minidist.grid import ProcessGrid
        grid = ProcessGrid(dp=dp, pp=world // dp)
        group, dp_rank, dp_size = grid.dp_group, grid.dp_rank, grid.dp_size
    kind = _WrongDivisor if broken else ShardedOptimizer
    opt_ref = []

    def make(m):
        opt_ref.append(kind(m.parameters(), cls, group, stage=2, bucket_cap_mb=cap, **hyper))
        return opt_ref[0]

    m, opt = _train(dp_rank, dp_size, make, False)
    grads_kept = [p.grad for p in m.parameters() if p.grad is not None]
    shard = sum(b.shard.grad.numel() for b in opt.buckets)
    out = {"params": named_state(m), "full grads kept": len(grads_kept), "grad numel": shard,
           "buckets": len(opt.buckets), "state": opt.state_dict()}
    opt.close()
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_zero2_equals_single_process(world, name):
    cls, hyper = OPTIMIZERS[name]
    single, single_opt = train_single(cls, STEPS, with_optimizer=True, **hyper)
    res = minidist.run(_zero2, world, name, 0.0005, timeout=120)
    for r, out in enumerate(res):
        assert out["buckets"] >= 3  # several buckets, reduce-scattered during backward
        assert out["full grads kept"] == 0  # only the slices of the averaged gradient remain
        n = 499 - 7  # trainable elements (the frozen vector has none)
        assert out["grad numel"] <= -(-n // world) + out["buckets"], "more than 1/W kept"
        assert max_abs_diff(out["params"], res[0]["params"]) == 0.0, f"rank {r} diverged"
        assert max_abs_diff(out["params"], single) <= TOL, f"rank {r} vs one process"
        assert max_abs_diff(_flat_state(out["state"]), _flat_state(single_opt)) <= TOL


def test_zero2_wrong_divisor_is_caught():
    cls, hyper = OPTIMIZERS["sgd"]
    single = train_single(cls, STEPS, **hyper)
    good = minidist.run(_zero2, 2, "sgd", 0.0005, timeout=120)
    bad = minidist.run(_zero2, 2, "sgd", 0.0005, True, timeout=120)
    assert max_abs_diff(good[0]["params"], single) <= TOL
    assert max_abs_diff(bad[0]["params"], single) > 1e-3  # the equality check rejects it


def test_zero2_on_the_data_parallel_group_of_a_grid():
    cls, hyper = OPTIMIZERS["adamw"]
    single = train_single(cls, STEPS, **hyper)
    for r, out in enumerate(minidist.run(_zero2, 4, "adamw", 0.0005, False, 2, timeout=120)):
        assert max_abs_diff(out["params"], single) <= TOL, f"rank {r}"


def _resume(rank, world, name, model_state, optim_state):
    cls, hyper = OPTIMIZERS[name]
    model = make_model(seed=1)
    model.load_state_dict(model_state)
    opt = ShardedOptimizer(model.parameters(), cls, grads="local", **hyper)
    if optim_state is not None:
        opt.load_state_dict(optim_state)
    opt.zero_grad()
    x, y = local_batch(3, rank, world)
    loss_fn(model(x), y).backward()
    opt.step()
    return named_state(model), opt.state_dict()


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_load_state_dict_from_a_plain_optimizer_at_another_world_size(name):
    cls, hyper = OPTIMIZERS[name]
    state3, optim3 = train_single(cls, 3, with_optimizer=True, **hyper)
    state4, optim4 = train_single(cls, 4, with_optimizer=True, **hyper)
    for out, osd in minidist.run(_resume, 3, name, state3, optim3, timeout=120):
        assert max_abs_diff(out, state4) <= TOL  # the same next step as uninterrupted training
        assert max_abs_diff(_flat_state(osd), _flat_state(optim4)) <= TOL
    # the check can fail: without the optimizer state the next step differs
    fresh = minidist.run(_resume, 3, name, state3, None, timeout=120)[0][0]
    assert max_abs_diff(fresh, state4) > 1e-4
