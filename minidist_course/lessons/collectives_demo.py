"""The collectives section of ``minidist demo``: every hand-built collective of
:data:`minidist.collectives.ALGORITHMS` (and all-to-all) against torch's own on the same input, at
sizes that are empty, fewer than the ranks, uneven and large-ish; one call timed each.

    rows = demo_rows(4)            # [{"check": "all_reduce/ring", "max_error": ..., "ok": ...}, ...]

The reference always runs on the CPU through gloo, the hand-built one on the rank's device (the
CPU, or the GPU the ranks share with ``device="cuda"``); errors are the largest absolute
difference over all sizes and ranks (tolerance 1e-4, fp32 sums in a different order).
"""

from __future__ import annotations

import time

from ..bench.collectives import OPS, busbw_factor
from minidist.launch import run

__all__ = ["SIZES", "demo_ops", "demo_rows"]

SIZES = (0, 3, 10, 100_003)  # elements: empty, fewer than ranks, uneven, large-ish


def demo_ops(C) -> dict:
    """(op, algorithms) the demo checks against torch's built-in: every entry of the library's table."""
    return {**{op: tuple(algs) for op, algs in C.ALGORITHMS.items()}, "all_to_all": ("naive",)}


def demo_rank(rank, world):
    import torch
    import torch.distributed as dist

    from minidist import collectives as C, env

    dev = env.device()  # the CPU, or the GPU the ranks share with ``--device cuda``

    gen = torch.Generator().manual_seed(1234 + rank)
    rows = []
    for op, algs in demo_ops(C).items():
        for alg in algs:
            worst, timing_elems, t_ours, t_torch = 0.0, SIZES[-1], None, None
            for n in SIZES:
                x = torch.randn(n * world if op in ("reduce_scatter", "all_to_all") else n,
                                generator=gen)
                ours, ref, t_ours, t_torch = demo_pair(op, alg, x, rank, world, C, dist, dev)
                if ours.numel():
                    worst = max(worst, (ours.cpu() - ref).abs().max().item())
            bytes_ = timing_elems * 4 * (world if op in ("reduce_scatter", "all_to_all") else 1)
            factor = busbw_factor(op if op in OPS else "broadcast", world) \
                if op != "all_to_all" else (world - 1) / world
            t = torch.tensor([worst, t_ours, t_torch], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            rows.append(dict(section="collectives", check=f"{op}/{alg}", world_size=world,
                             max_error=t[0].item(), ok=t[0].item() <= 1e-4,
                             busbw=bytes_ / t[1].item() / 1e9 * factor,
                             ratio=t[2].item() / t[1].item(), size=timing_elems))
    return rows


def demo_pair(op, alg, x, rank, world, C, dist, dev=None):
    """Run ``op`` with minidist (algorithm ``alg``) on ``dev`` and with torch (gloo) on a CPU copy of
    the same input; time both."""
    import torch

    def mine(t):  # the hand-built collectives run on the rank's device; torch's reference on the CPU
        return t.to(dev) if dev is not None else t

    def timed(f):
        dist.barrier()
        t0 = time.perf_counter()
        out = f()
        return out, time.perf_counter() - t0

    if op == "all_reduce":
        ours, t1 = timed(lambda: C.all_reduce(mine(x.clone()), algorithm=alg))
        ref, t2 = timed(lambda: (lambda y: (dist.all_reduce(y), y)[1])(x.clone()))
    elif op == "reduce_scatter":
        n = x.numel() // world
        ours, t1 = timed(lambda: C.reduce_scatter(mine(torch.empty(n)), mine(x.clone()), algorithm=alg))
        ref = torch.empty(n)
        _, t2 = timed(lambda: dist.reduce_scatter(ref, list(x.clone().split(n))) if n else None)
        if n == 0:
            ref = ours.cpu()
    elif op == "all_gather":
        ours, t1 = timed(lambda: C.all_gather(mine(torch.empty(x.numel() * world)), mine(x), algorithm=alg))
        parts = [torch.empty_like(x) for _ in range(world)]
        _, t2 = timed(lambda: dist.all_gather(parts, x))
        ref = torch.cat(parts)
    elif op == "broadcast":
        ours, t1 = timed(lambda: C.broadcast(mine(x.clone()), src=world - 1, algorithm=alg))
        ref, t2 = timed(lambda: (lambda y: (dist.broadcast(y, world - 1), y)[1])(x.clone()))
    elif op == "reduce":
        ours, t1 = timed(lambda: C.reduce(mine(x.clone()), dst=0, algorithm=alg))
        ref, t2 = timed(lambda: (lambda y: (dist.reduce(y, 0), y)[1])(x.clone()))
        if rank != 0:  # only the destination's result is defined
            ours = ref
    else:  # all_to_all
        n = x.numel() // world
        outs = [mine(torch.empty(n)) for _ in range(world)]
        _, t1 = timed(lambda: C.all_to_all(outs, list(mine(x).tensor_split(world))))
        refs = [torch.empty(n) for _ in range(world)]
        _, t2 = timed(lambda: dist.all_to_all(refs, [p.clone() for p in x.tensor_split(world)]) if n else None)
        ours = torch.cat(outs).cpu()
        ref = torch.cat(refs) if n else ours
    return ours, ref, t1, t2


def demo_rows(world_size: int = 4, device: str | None = None, timeout: float = 300) -> list[dict]:
    """One row per (op, algorithm): max error over every size and rank, busbw (GB/s) and the ratio
    torch time / hand-built time at ``SIZES[-1]`` elements, ``ok`` when the error is <= 1e-4."""
    return run(demo_rank, world_size, timeout=timeout, device=device)[0]
