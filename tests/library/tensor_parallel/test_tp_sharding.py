"""Sharding helpers (full state dict <-> shards), TP on a sub-group (as inside a DP x TP grid),
and empty batches."""

import pytest
import torch
import torch.distributed as dist

import minidist
from minidist.models.gpt import GPT, GPTConfig
from minidist.tensor_parallel.gpt import TPGPT
from minidist.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, gather_state_dict,
                                      regions as R, shard_state_dict)
from minidist_course.references.tensor_parallel import max_rel_error, rel_error

CFG = GPTConfig(vocab_size=50, block_size=8, n_layer=2, n_head=4, n_embd=16)


def _roundtrip_case(rank, world):
    torch.manual_seed(1)
    ref = GPT(CFG)                               # a "checkpoint" of the single-process model
    torch.manual_seed(0)
    model = TPGPT(CFG)                           # different weights until we load
    model.load_state_dict(shard_state_dict(ref.state_dict(), model), strict=True)
    back = gather_state_dict(model)
    exact = all(torch.equal(back[k], v) for k, v in ref.state_dict().items())
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(2))
    logits = R.gather_from_tensor_model_parallel_region(model(ids)[0].detach())[..., :50]
    return {"exact": exact, "keys": sorted(back) == sorted(ref.state_dict()),
            "out": rel_error(logits, ref(ids)[0]), "head_rows": model.head.weight.shape[0]}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_shard_then_gather_state_dict_round_trips(world):
    for r in minidist.run(_roundtrip_case, world, timeout=60):
        assert r["exact"] and r["keys"], "gather(shard(sd)) must give sd back exactly"
        assert r["out"] < 1e-6
        assert r["head_rows"] == -(-50 // world) * world // world   # padded vocabulary


def _subgroup_case(rank, world):
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]   # every rank creates every group
    group = groups[rank // 2]
    torch.manual_seed(0)
    ref = GPT(CFG)
    torch.manual_seed(0)
    model = TPGPT(CFG, group=group)
    g = torch.Generator().manual_seed(rank // 2)                 # each TP group its own data
    ids, tgt = torch.randint(0, 50, (2, 8), generator=g), torch.randint(0, 50, (2, 8), generator=g)
    loss_r = ref(ids, tgt)[1]
    loss_r.backward()
    loss = model(ids, tgt)[1]
    loss.backward()
    grads = gather_state_dict(model, group=group, grads=True)
    return {"loss": rel_error(loss, loss_r), "loss_value": loss.item(),
            "grads": max_rel_error(grads, {n: p.grad for n, p in ref.named_parameters()})[0],
            "local_heads": model.blocks[0].attn.local_heads}


def test_tp_on_a_subgroup_of_the_world():
    res = minidist.run(_subgroup_case, 4, timeout=60)
    for r in res:
        assert r["loss"] < 1e-6 and r["grads"] < 1e-6, r
        assert r["local_heads"] == 2, "TP size is the group's (2), not the world's (4)"
    assert res[0]["loss_value"] == res[1]["loss_value"] != res[2]["loss_value"] == res[3]["loss_value"]


def _empty_case(rank, world):
    col, row = ColumnParallelLinear(6, 8), RowParallelLinear(8, 6)
    x = torch.zeros(0, 6, requires_grad=True)
    y = row(col(x))
    y.sum().backward()
    return tuple(y.shape), tuple(x.grad.shape)


@pytest.mark.parametrize("world", [1, 2])
def test_empty_batch_goes_through_without_hanging(world):
    for out_shape, grad_shape in minidist.run(_empty_case, world, timeout=60):
        assert out_shape == (0, 6) and grad_shape == (0, 6)
