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
    after = [t.name for t in threading.enumerate() if t.name in ("comm", "sharding-comm")]
    return before, stuck, after


@pytest.mark.timeout(60)
def test_stop_all_stops_and_joins_every_library_thread():
    for before, stuck, after in minidist.run(_owners_alive_at_the_end, 2, True, timeout=40):
        assert before == ["comm", "sharding-comm", "sharding-comm"], before
        assert stuck == [] and after == [], (stuck, after)


@pytest.mark.timeout(240)
def test_exit_with_live_communication_threads_20_times():
    for i in range(20):
        assert minidist.run(_owners_alive_at_the_end, 2, False, timeout=40) == [True, True], i
