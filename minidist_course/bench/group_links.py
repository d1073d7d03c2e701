"""Link alpha and beta of the groups of a 3-D grid, measured as they run: all at once.

A (2, 2, 1) grid on 4 ranks runs two tensor-parallel all-reduces of 2 ranks at the same time; on a
machine with fewer cores than ranks they are time-sliced on the same cores, so the latency one of
them sees is not that of a lone all-reduce over all W ranks (``minidist bench alpha-beta``). Here
every one of the W/n groups of n consecutive ranks runs minidist's ring all-reduce at once, at a
few message sizes (the tiny GPT's TP and PP messages are KiB), and the ring's alpha-beta model is
fitted to the medians (:func:`~minidist_course.bench.alpha_beta.fit_alpha_beta_samples`). The input of
:func:`minidist_course.planner.this_machine`'s ``group_links`` (used by ``minidist bench 3d``).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from minidist.launch import run

__all__ = ["GROUP_SIZES", "measure_group_links"]

GROUP_SIZES = tuple(1 << k for k in range(10, 19, 2))   # 1 KiB .. 256 KiB: the TP/PP messages' range


def _group_rank(rank, world, group_sizes, sizes, reps):
    from minidist import collectives as C
    out = {}
    for n in group_sizes:   # every rank creates every group (new_group is collective)
        groups = [dist.new_group(list(range(g, g + n))) for g in range(0, world, n)]
        mine = groups[rank // n]
        for nbytes in sizes:
            t = torch.ones(max(nbytes // 4 // n * n, n))
            ts = []
            for i in range(reps + 2):
                dist.barrier()
                t0 = time.perf_counter()
                C.all_reduce(t, algorithm="ring", group=mine)
                if i >= 2:
                    ts.append(time.perf_counter() - t0)
            m = torch.tensor(ts, dtype=torch.float64)
            dist.all_reduce(m, op=dist.ReduceOp.MAX)   # the slowest rank of all groups, per call
            out[(n, nbytes)] = m.tolist()
    return out


def measure_group_links(world_size: int, group_sizes=None, sizes=GROUP_SIZES, reps: int = 20,
                        timeout: float = 600.0) -> dict:
    """{n: (alpha, beta)}: minidist's ring all-reduce fitted (:func:`~.alpha_beta.fit_alpha_beta_samples`,
    median per size) while ALL ``world_size / n`` groups of n consecutive ranks all-reduce at the
    same time, as the groups of a 3-D grid do; a call's time is the slowest rank's. ``group_sizes``:
    default every divisor n >= 2 of ``world_size``. The input of the planner's ``group_links``."""
    from .alpha_beta import fit_alpha_beta_samples
    if group_sizes is None:
        group_sizes = [n for n in range(2, world_size + 1) if world_size % n == 0]
    if not group_sizes:
        return {}
    for n in group_sizes:
        if n < 2 or world_size % n:
            raise ValueError(f"bench 3d: group size {n} must be >= 2 and divide {world_size}")
    res = run(_group_rank, world_size, tuple(group_sizes), tuple(sizes), reps, timeout=timeout)[0]
    out = {}
    for n in group_sizes:
        fit = fit_alpha_beta_samples({b: res[(n, b)] for b in sizes}, "all_reduce", "ring", n,
                                     n_bootstrap=0)
        out[n] = (fit.alpha, fit.beta)
    return out
