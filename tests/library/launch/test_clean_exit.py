"""Clean exits: every background thread the library starts is stopped and joined at the end.

A rank that returns while a ``fully_shard`` model (several units: a communication thread with
prefetched all-gathers), a ZeRO-2 optimizer and a ``BucketedDDP`` are still alive used to leave
their threads running while the process group and the interpreter went away; 2 of 10 such runs
ended in ``terminate called without an active exception`` (SIGABRT). Now the launcher stops and
joins every registered thread (:mod:`minidist.comm.threads`) before destroying the group.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import minidist
from minidist.comm import threads
from minidist.data_parallel import BucketedDDP
from minidist.sharding import ShardedOptimizer, fsdp


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.lin(x))


def _owners_alive_at_the_end(rank, world, check_threads):
    torch.manual_seed(0)
    sharded = fsdp.fully_shard(nn.Sequential(*[Block() for _ in range(4)], nn.Linear(8, 2)),
                               auto_wrap=(Block,))
    zero2 = nn.Linear(8, 2)
    ddp = BucketedDDP(nn.Linear(8, 2), bucket_cap_mb=1e-4)
    opts = [torch.optim.SGD(sharded.parameters(), lr=0.1),
            ShardedOptimizer(zero2.parameters(), torch.optim.SGD, stage=2, lr=0.1),
            torch.optim.SGD(ddp.parameters(), lr=0.1)]
    x, y = torch.randn(4, 8), torch.zeros(4, dtype=torch.long)
    for _ in range(2):
        for model, opt in zip((sharded, zero2, ddp), opts):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    with torch.no_grad():
        sharded(x)                                # the last op prefetches on the comm thread
    if not check_threads:
        return True                               # nothing closed: the launcher must stop them
    before = sorted(threads.live())
    stuck = threads.stop_all()
    after = [t.name for t in threading.enumerate() if t.name in ("comm", "fsdp-comm", "zero-comm")]
    return before, stuck, after


@pytest.mark.timeout(60)
def test_stop_all_stops_and_joins_every_library_thread():
    for before, stuck, after in minidist.run(_owners_alive_at_the_end, 2, True, timeout=40):
        assert before == ["comm", "fsdp-comm", "zero-comm"], before
        assert stuck == [] and after == [], (stuck, after)


# A race hunt: 5 exits in the default tier (3 s), 20 in the integration tier (12 s)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("times", [5, pytest.param(20, marks=pytest.mark.exhaustive)])
def test_exit_with_live_communication_threads_repeatedly(times):
    for i in range(times):
        assert minidist.run(_owners_alive_at_the_end, 2, False, timeout=40) == [True, True], i


def _scaled_zero(rank, world, stage):
    """Rank 1's gradient of ``b`` is inf in step 0: only the rank owning b's slice would see it."""
    a, b = nn.Parameter(torch.zeros(8)), nn.Parameter(torch.zeros(8))
    opt = ShardedOptimizer([a, b], torch.optim.SGD, stage=stage, grads="local", lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)
    out = []
    for step in range(2):
        cb = torch.ones(8)
        if rank == 1 and step == 0:
            cb[3] = float("inf")
        opt.zero_grad()
        scaler.scale(a.sum() + (b * cb).sum()).backward()
        scaler.step(opt)
        scaler.update()
        out.append((torch.cat([a, b]).detach().clone(), scaler.get_scale()))
    opt.close()
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stage", [1, 2])
def test_grad_scaler_inf_on_one_rank_skips_the_zero_step_on_every_rank(stage):
    """As torch's GradScaler does for DDP: skip on every rank, halve the scale, then step."""
    for rank, ((p0, s0), (p1, s1)) in enumerate(minidist.run(_scaled_zero, 2, stage, timeout=30)):
        assert torch.equal(p0, torch.zeros(16)) and s0 == 8.0, (rank, p0, s0)
        assert torch.equal(p1, torch.full((16,), -0.1)) and s1 == 8.0, (rank, p1, s1)
