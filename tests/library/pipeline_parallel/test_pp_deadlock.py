"""A deliberately wrong ordering ends in a timeout error naming the stages
(two neighbours each waiting for the other)."""

import pytest
import torch
from torch import nn

import minidist
from minidist.pipeline_parallel import Op, PipelineDeadlock, Schedule, simulate, validate
from minidist.pipeline_parallel.engine import local_stages, pipeline_step
from minidist.pipeline_parallel.partition import split_model

# rank 0 runs B0 before F1; rank 1 insists on F1 before B0: each waits for the other
WRONG = Schedule("wrong", 2, 2, 1, (
    (Op("F", 0, 0), Op("B", 0, 0), Op("F", 1, 0), Op("B", 1, 0)),
    (Op("F", 0, 1), Op("F", 1, 1), Op("B", 0, 1), Op("B", 1, 1))))


def _run_wrong(rank, world):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    mods = local_stages(split_model(model, 2), WRONG, rank)
    x = torch.randn(4, 4)
    pipeline_step(WRONG, mods, x, x, nn.functional.mse_loss)


def test_wrong_ordering_times_out_naming_stages():
    validate(WRONG)  # every row is a legal list on its own
    with pytest.raises(PipelineDeadlock):  # the simulator sees the circular wait ahead of time
        simulate(WRONG)
    with pytest.raises(minidist.RankTimeoutError) as info:
        minidist.run(_run_wrong, 2, timeout=4)
    msg = str(info.value)
    assert "rank 0: pp/recv grad mb 0 stage 1->0" in msg, msg
    assert "rank 1: pp/recv act mb 1 stage 0->1" in msg, msg
