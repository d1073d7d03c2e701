"""DP=2 x PP=2 on a ProcessGrid: each stage's gradients averaged once over its DP replicas.

Gradients must be identical across the two replicas (bitwise: they come out of one all-reduce) and
equal to one process on the whole batch (1e-6, fp32). Each DP replica gets an equal shard.
"""

import pytest
import torch
from torch import nn

import minidist
from minidist.grid import ProcessGrid
from minidist.pipeline_parallel import make_schedule
from minidist.hybrid.dp_pipeline import dp_pipeline_step
from minidist.pipeline_parallel.engine import local_stages
from minidist.pipeline_parallel.partition import split_model

N, WIDTH = 12, 5


def make_model():
    torch.manual_seed(1)
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(WIDTH, WIDTH), nn.Tanh())])


def make_batch():
    g = torch.Generator().manual_seed(7)
    return torch.randn(N, WIDTH, generator=g), torch.randn(N, WIDTH, generator=g)


def _dp_pp(rank, world, name, M):
    grid = ProcessGrid(dp=2, pp=2)
    schedule = make_schedule(name, grid.pp_size, M, v=2)
    model = make_model()
    mods = local_stages(split_model(model, schedule.n_stages), schedule, grid.pp_rank)
    mine = {id(p) for m in mods.values() for p in m.parameters()}
    x, y = make_batch()
    x, y = x.tensor_split(2)[grid.dp_rank], y.tensor_split(2)[grid.dp_rank]
    res = dp_pipeline_step(schedule, mods, x, y, nn.functional.mse_loss, grid.pp_group,
                           grid.dp_group)
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if id(p) in mine}
    return grid.dp_rank, grid.pp_rank, res.loss, grads


@pytest.mark.parametrize("name,M", [("1f1b", 3), ("gpipe", 4), ("interleaved", 2)])
def test_dp2_pp2_matches_single_process(name, M):
    results = minidist.run(_dp_pp, 4, name, M, timeout=60)
    model = make_model()
    x, y = make_batch()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    ref = {k: p.grad for k, p in model.named_parameters()}
    by_coord = {(d, p): g for d, p, _, g in results}
    for pp_rank in range(2):
        g0, g1 = by_coord[(0, pp_rank)], by_coord[(1, pp_rank)]
        assert g0.keys() == g1.keys() and g0
        for k in g0:
            assert torch.equal(g0[k], g1[k]), f"DP replicas differ on {k}"
            torch.testing.assert_close(g0[k], ref[k], atol=1e-6, rtol=0)
    covered = set(by_coord[(0, 0)]) | set(by_coord[(0, 1)])
    assert covered == set(ref)
    # each replica's loss is its shard's mean; their average is the full-batch loss
    shard_losses = [l for _, _, l, _ in results if l is not None]
    assert sum(shard_losses) / 2 == pytest.approx(loss.item(), abs=1e-6)
