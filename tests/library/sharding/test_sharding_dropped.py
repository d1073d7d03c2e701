"""A dropped ZeRO-3 model or ZeRO-2 optimizer lets its communication thread go.

A tensor keeps its hooks out of the garbage collector's sight, so a hook that held its owner (a
ZeRO-3 unit on its gathered buffer, the ZeRO-2 optimizer on its parameters) made a cycle no
collection frees: every model built and dropped in a loop (a sweep, the composition matrix) kept
its threads, and each step ran slower than the last. Both hooks now hold their owner weakly
(:func:`minidist.backward.weak_hook`)."""

import gc
import threading
import time

import torch
from torch import nn

import minidist
from minidist.sharding import ShardedOptimizer, fully_shard


def _threads() -> int:
    """The library's comm threads still alive after up to 5 s of collecting (a comm thread may
    still hold its last task's unit for a moment after the main thread has gone on)."""
    deadline = time.monotonic() + 5
    while True:
        gc.collect()
        alive = [t for t in threading.enumerate() if t.name.startswith(("fsdp-comm", "zero-comm"))]
        if not alive or time.monotonic() > deadline:
            return len(alive)
        alive[0].join(timeout=0.05)


def _build_and_drop(rank, world):
    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))

    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
    counts = []
    for _ in range(3):
        m = fully_shard(model(), auto_wrap=(nn.Linear,))
        m(x).sum().backward()
        del m
        counts.append(_threads())
    for _ in range(3):
        m = model()
        opt = ShardedOptimizer(m.parameters(), torch.optim.SGD, stage=2, lr=0.1)
        m(x).sum().backward()
        opt.step()
        del m, opt
        counts.append(_threads())
    return counts


def test_dropped_sharded_models_and_optimizers_leave_no_thread():
    for counts in minidist.run(_build_and_drop, 2, timeout=60):
        assert counts == [0] * 6, counts
