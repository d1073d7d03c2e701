"""ZeRO-3 (minidist.sharding.fully_shard) equals one process, torch's DDP and torch's own FSDP2.

Tolerance 1e-6 in fp32: sums of the same gradients in a different order (ring vs torch vs one
process). The model (minidist_course.references.sharding) has tied weights, a frozen parameter,
a buffer and no parameter size divisible by W; units are its two blocks (auto-wrap) and the root.
"""


import pytest
import torch
import torch._dynamo  # noqa: F401  (forked ranks build optimizers, which import it)

import minidist
from minidist.sharding import fsdp, fsdp_state, fsdp_unit
from minidist.sharding.checkpoints import load_sharded_checkpoint, save_sharded_checkpoint
from minidist_course.references.sharding import (OPTIMIZERS, Block, global_batch, local_batch,
    loss_fn, make_model, max_abs_diff, named_state, train_single)

TOL, STEPS = 1e-6, 5


def _steps(model, opt, rank, world, steps, start=0, clip=None, accumulation=1):
    for step in range(start, start + steps):
        opt.zero_grad()
        x, y = local_batch(step, rank, world)
        for k, (xk, yk) in enumerate(zip(x.chunk(accumulation), y.chunk(accumulation))):
            last = k == accumulation - 1
            if not last:
                fsdp.set_requires_gradient_sync(model, False)
            (loss_fn(model(xk), yk) / accumulation).backward()
            fsdp.set_requires_gradient_sync(model, True)
        if clip is not None:
            fsdp_state.clip_grad_norm_(model, clip)
        opt.step()


def _ours(rank, world, name, collectives="hand-built", clip=None, accumulation=1, dp=None):
    cls, hyper = OPTIMIZERS[name]
    group, r, w = None, rank, world
    if dp is not None:
        from minidist.grid import ProcessGrid
        grid = ProcessGrid(dp=dp, pp=world // dp)
        group, r, w = grid.dp_group, grid.dp_rank, grid.dp_size
    model = fsdp.fully_shard(make_model(), auto_wrap=(Block,), group=group,
                             collectives=collectives)
    opt = cls(model.parameters(), **hyper)
    _steps(model, opt, r, w, STEPS, clip=clip, accumulation=accumulation)
    return fsdp_state.full_state_dict(model)


def _torch_ddp(rank, world, name):
    from torch.nn.parallel import DistributedDataParallel
    cls, hyper = OPTIMIZERS[name]
    model = make_model()
    ddp = DistributedDataParallel(model)
    opt = cls(ddp.parameters(), **hyper)
    _steps_plain(ddp, opt, rank, world)
    return named_state(model)


def _steps_plain(model, opt, rank, world):
    for step in range(STEPS):
        opt.zero_grad()
        x, y = local_batch(step, rank, world)
        loss_fn(model(x), y).backward()
        opt.step()


def _torch_fsdp2(rank, world, name):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    cls, hyper = OPTIMIZERS[name]
    mesh = init_device_mesh("cpu", (world,))
    model = make_model()
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = cls(model.parameters(), **hyper)
    _steps_plain(model, opt, rank, world)
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()}


def _three(rank, world, name):
    return _ours(rank, world, name), _torch_ddp(rank, world, name), _torch_fsdp2(rank, world, name)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_zero3_equals_single_process_torch_ddp_and_fsdp2(world, name):
    cls, hyper = OPTIMIZERS[name]
    single = train_single(cls, STEPS, **hyper)
    res = minidist.run(_three, world, name, timeout=180)
    for r, (ours, ddp, fsdp2) in enumerate(res):
        assert max_abs_diff(ours, res[0][0]) == 0.0, f"rank {r} diverged"
        assert max_abs_diff(ours, single) <= TOL, f"rank {r} vs one process"
        assert max_abs_diff(ours, ddp) <= TOL, f"rank {r} vs torch DDP"
        assert max_abs_diff(ours, fsdp2) <= TOL, f"rank {r} vs torch FSDP2"
    assert max_abs_diff(res[0][0], train_single(cls, 0, **hyper)) > 1e-3  # training moved them


def test_torch_collectives_and_a_grid_subgroup():
    cls, hyper = OPTIMIZERS["adamw"]
    single = train_single(cls, STEPS, **hyper)
    for out in minidist.run(_ours, 2, "adamw", "torch", timeout=120):
        assert max_abs_diff(out, single) <= TOL
    for out in minidist.run(_ours, 4, "adamw", "hand-built", None, 1, 2, timeout=120):
        assert max_abs_diff(out, single) <= TOL


def _single_clip_accumulate(name, clip):
    cls, hyper = OPTIMIZERS[name]
    model = make_model()
    opt = cls(model.parameters(), **hyper)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = global_batch(step)
        loss_fn(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return named_state(model)


def test_no_sync_accumulation_and_global_norm_clipping():
    # 2 micro-batches per rank, the first without communication; clip at a norm that binds
    single = _single_clip_accumulate("sgd", 0.05)
    for out in minidist.run(_ours, 3, "sgd", "hand-built", 0.05, 2, timeout=120):
        assert max_abs_diff(out, single) <= TOL
    assert max_abs_diff(single, train_single(*OPTIMIZERS["sgd"][:1], **OPTIMIZERS["sgd"][1])) > 1e-3


class _FreesBeforeBackward(fsdp_unit.ShardUnit):
    """Broken on purpose: does not all-gather again before the unit's backward."""

    def pre_backward(self):
        ctx = self.ctx
        if not ctx.in_backward:
            ctx.in_backward, ctx.recording = True, False
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)


def _broken(rank, world):
    fsdp.ShardUnit = _FreesBeforeBackward  # the name fully_shard uses; this rank's copy only
    try:
        return _ours(rank, world, "sgd")
    except RuntimeError as e:
        return f"failed: {e}"


def test_freeing_before_backward_is_caught():
    single = train_single(*OPTIMIZERS["sgd"][:1], **OPTIMIZERS["sgd"][1])
    for out in minidist.run(_broken, 2, timeout=120):
        assert isinstance(out, str) or max_abs_diff(out, single) > 1e-3, "not caught"


def _save_w2(rank, world, path, name):
    cls, hyper = OPTIMIZERS[name]
    model = fsdp.fully_shard(make_model(), auto_wrap=(Block,))
    opt = cls(model.parameters(), **hyper)
    _steps(model, opt, rank, world, 3)
    sd, osd = fsdp_state.full_state_dict(model), fsdp_state.full_optim_state_dict(model, opt)
    only0 = fsdp_state.full_state_dict(model, rank0_only=True)
    assert (max_abs_diff(only0, sd) == 0.0) if rank == 0 else only0 == {}
    if rank == 0:
        torch.save((sd, osd), path)
    save_sharded_checkpoint(path + ".sharded", model, opt)
    _steps(model, opt, rank, world, 1, start=3)
    return fsdp_state.full_state_dict(model)


def _load(rank, world, path, name, sharded):
    cls, hyper = OPTIMIZERS[name]
    model = fsdp.fully_shard(make_model(seed=1), auto_wrap=(Block,))
    opt = cls(model.parameters(), **hyper)
    if sharded:
        load_sharded_checkpoint(path + ".sharded", model, opt, restore_rng=False)
    else:
        sd, osd = torch.load(path, weights_only=False)
        fsdp_state.load_full_state_dict(model, sd)
        fsdp_state.load_full_optim_state_dict(model, opt, osd)
    _steps(model, opt, rank, world, 1, start=3)
    return fsdp_state.full_state_dict(model)


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_state_dict_saved_at_w2_loads_at_w1_and_gives_the_same_next_step(tmp_path, name):
    path = str(tmp_path / "ckpt.pt")
    w2 = minidist.run(_save_w2, 2, path, name, timeout=120)[0]
    w1 = minidist.run(_load, 1, path, name, False, timeout=120)[0]
    assert max_abs_diff(w1, w2) <= TOL
    again = minidist.run(_load, 2, path, name, True, timeout=120)  # sharded, same W
    assert max_abs_diff(again[0], w2) <= TOL
    with pytest.raises(minidist.RankError, match="written by 2 ranks"):
        minidist.run(_load, 1, path, name, True, timeout=120)


def _prefetch_and_free(rank, world, prefetch, per_parameter=True):
    model = fsdp.fully_shard(make_model(), auto_wrap=(Block,), prefetch=prefetch,
                             per_parameter=per_parameter)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _steps(model, opt, rank, world, 3)
    us = fsdp.units(model)
    return {"prefetched": us[0].ctx.prefetched, "units": len(us),
            "gathered bytes after step": sum(u.full.untyped_storage().size() for u in us),
            "shard sizes": [u.layout.shard_numel for u in us],
            "params": {n: tuple(p.shape) for n, p in model.named_parameters()}}


@pytest.mark.parametrize("per_parameter", [True, False])
def test_prefetch_happens_and_everything_is_freed_after_a_step(per_parameter):
    on, off = minidist.run(_prefetch_and_free, 2, True, per_parameter, timeout=120)[0], \
        minidist.run(_prefetch_and_free, 2, False, per_parameter, timeout=120)[0]
    assert on["units"] == 3 and on["gathered bytes after step"] == 0
    # steps 2 and 3: each unit is prefetched before its forward and (but one) before its backward
    assert on["prefetched"] >= 2 * 2 * 2 and off["prefetched"] == 0
    if not per_parameter:
        # units: blocks.0 (91+13+91+7 = 202 → 101), blocks.1, root (77 + 11 = 88 → 44); frozen kept
        assert on["shard sizes"] == [101, 101, 44]
        assert sorted(on["params"]) == ["blocks.0.flat_shard", "blocks.1.flat_shard",
                                        "flat_shard", "frozen"]
        return
    # per parameter, dim 0 cut in ceil(d0/2) rows: fc1.weight [13, 7] → [7, 7] = 49, fc1.bias
    # [13] → 7, fc2.weight [7, 13] → [4, 13] = 52, fc2.bias → 4: 112; root: emb (= head) [11, 7]
    # → 42, head.bias → 6, frozen [7] → 4 (frozen parameters are sharded too): 52
    assert on["shard sizes"] == [112, 112, 52]
    assert on["params"] == {"emb.weight": (6, 7), "frozen": (4,),
                            **{f"blocks.{i}.{n}": s for i in (0, 1) for n, s in
                               [("fc1.weight", (7, 7)), ("fc1.bias", (7,)),
                                ("fc2.weight", (4, 13)), ("fc2.bias", (4,))]},
                            "head.bias": (6,)}


def _errors(rank, world):
    out = {}
    model = fsdp.fully_shard(make_model(), auto_wrap=(Block,))
    for what, fn in {
        "twice": lambda: fsdp.fully_shard(model),
        "tied across units": lambda: _tie_blocks(),
        "stage": lambda: __import__("minidist.sharding", fromlist=["x"]).ShardedOptimizer(
            make_model().parameters(), torch.optim.SGD, stage=3, lr=0.1),
    }.items():
        try:
            fn()
            out[what] = "no error"
        except ValueError as e:
            out[what] = str(e)
    return out


def _tie_blocks():
    model = make_model()
    model.blocks[1].fc1.weight = model.blocks[0].fc1.weight  # one weight used in two units
    fsdp.fully_shard(model, auto_wrap=(Block,))


def test_bad_input_is_a_clear_error():
    out = minidist.run(_errors, 1, timeout=60)[0]
    assert "already a unit" in out["twice"]
    assert "fc1.weight" in out["tied across units"] and "tied" in out["tied across units"]
    assert "stage must be 1 or 2" in out["stage"]
