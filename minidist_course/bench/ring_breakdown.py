"""Where a ring all-reduce's time goes, against the point-to-point ceiling (chapter 03).

Four things are timed per iteration, in alternation (so a load spike hits all alike), each the
slowest rank's time after a barrier, median over iterations:

* ``ceiling``: one ``isend`` to the right and one ``irecv`` from the left of 2(W-1)/W · N elements
  (:func:`minidist_course.bench.collectives.ceiling_elements`): the ring's traffic as one message;
* ``steps only``: the ring's 2(W-1) messages of N/W elements in the ring's order, no additions
  (two ring all-gathers: the same messages and dependencies as the all-reduce);
* ``additions only``: the (W-1) in-place additions of N/W elements the reduce-scatter does, no
  messages;
* ``ring``: the library's ring all-reduce (``minidist.collectives.all_reduce``).

Read: ``steps only - ceiling`` is what cutting the traffic into dependent steps costs (a wait and
a hand-off per step); ``additions only`` is CPU work the ceiling never does. On a CPU transport
(gloo over TCP on the same machine) moving bytes is itself CPU work, so when the cores are busy the
additions cannot hide behind the transfers: ``ring`` tends to ``steps only + additions only``.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from minidist import collectives as C
from minidist.comm import ring
from minidist.comm.ops import combine_
from minidist.launch import run
from .collectives import ceiling_elements

__all__ = ["ring_breakdown", "PARTS"]

PARTS = ("ceiling", "steps only", "additions only", "ring")


def _rank(rank, world, nbytes, iters, warmup):
    n = max(nbytes // 4 // world * world, world)
    m = ceiling_elements("all_reduce", n, world)
    send, recv = torch.ones(m), torch.empty(m)
    right, left = (rank + 1) % world, (rank - 1) % world
    t = torch.empty(n)
    chunks = list(t.tensor_split(world))
    other = torch.ones(n // world)

    def ceiling():
        for w in [dist.irecv(recv, left), dist.isend(send, right)]:
            w.wait()

    def steps_only():
        ring.all_gather_preposted(chunks, rank, world)
        ring.all_gather_preposted(chunks, rank, world)

    def additions_only():
        for step in range(world - 1):
            combine_(chunks[(rank - step - 2) % world], other, "sum")

    calls = dict(zip(PARTS, (ceiling, steps_only, additions_only, lambda: C.all_reduce(t))))
    times = {k: [] for k in PARTS}
    for i in range(warmup + iters):
        for k, call in calls.items():
            t.fill_(1.0)
            dist.barrier()
            t0 = time.perf_counter()
            call()
            if i >= warmup:
                times[k].append(time.perf_counter() - t0)
    out = torch.tensor([times[k] for k in PARTS], dtype=torch.float64)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)  # the slowest rank, per part and iteration
    ok = bool((t == world).all()) and bool((recv == 1).all())
    return out.tolist(), ok


def ring_breakdown(world_size: int, nbytes: int, iters: int = 7, warmup: int = 1,
                   timeout: float = 600.0) -> dict:
    """Median seconds (and min, max) of each part of :data:`PARTS` for an all-reduce of ``nbytes``
    bytes of float32 on ``world_size`` ranks; raises RuntimeError if the ring's result or the
    ceiling's data was wrong. Returns ``{part: {"median_s", "min_s", "max_s"}}``.
    """
    if world_size < 2:
        raise ValueError(f"ring_breakdown: world_size must be >= 2, got {world_size}")
    res = run(_rank, world_size, nbytes, iters, warmup, timeout=timeout)
    if not all(ok for _, ok in res):
        raise RuntimeError(f"ring_breakdown: wrong result at W={world_size}, {nbytes} bytes")
    times = res[0][0]
    return {k: {"median_s": statistics.median(v), "min_s": min(v), "max_s": max(v)}
            for k, v in zip(PARTS, times)}
