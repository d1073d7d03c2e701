"""``minidist bench ddp`` — minidist's bucketed DDP against torch's DDP, measured in the same run.

Every rank builds two identical models: one wrapped in :class:`BucketedDDP`, one in
``torch.nn.parallel.DistributedDataParallel`` (same bucket cap), and optionally a :class:`FlatDDP`
(all communication after backward: the no-overlap baseline). Steps alternate between them (the order
flips every step), so machine noise hits all alike; the median step time (forward, backward,
synchronisation, optimizer) is reported, and the ratio to torch as the median of per-step ratios. The share of communication hidden behind backward is read
from minidist's timeline: 1 − (time the step waited for buckets after backward) / (time the
buckets' all-reduces took).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

__all__ = ["bench_ddp"]


def _model(name: str):
    torch.manual_seed(0)
    if name == "resnet18":
        import torchvision
        return torchvision.models.resnet18(num_classes=10), (3, 32, 32)
    if name == "mlp":
        from ..models import MLP
        return MLP(1024, (1024, 1024, 1024), 10), (1024,)
    raise ValueError(f"bench_ddp: model must be 'resnet18' or 'mlp', got {name!r}")


def _rank_bench(rank, world, model_name, steps, warmup, batch_size, bucket_cap_mb, collectives,
                with_flat, first_bucket_cap_mb):
    from ..trace import Timeline
    from ..data_parallel.bucketed import BucketedDDP
    from ..data_parallel.flat import FlatDDP

    tl = Timeline()
    variants = {}
    m, shape = _model(model_name)
    variants["minidist"] = BucketedDDP(m, bucket_cap_mb=bucket_cap_mb, collectives=collectives,
                                       timeline=tl, first_bucket_cap_mb=first_bucket_cap_mb)
    m, _ = _model(model_name)
    variants["torch"] = torch.nn.parallel.DistributedDataParallel(m, bucket_cap_mb=bucket_cap_mb)
    if with_flat:
        m, _ = _model(model_name)
        variants["flat"] = FlatDDP(m, collectives=collectives)
    opts = {k: torch.optim.SGD(v.parameters(), lr=0.01) for k, v in variants.items()}
    times = {k: [] for k in variants}
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(batch_size, *shape, generator=g)
    y = torch.randint(0, 10, (batch_size,), generator=g)
    hidden = []
    names = list(variants)
    for step in range(warmup + steps):
        # alternate the order every step, so neither variant always runs right after the other
        for name in (names if step % 2 == 0 else names[::-1]):
            model = variants[name]
            tl.clear()
            t0 = time.perf_counter()
            opts[name].zero_grad()
            F.cross_entropy(model(x), y).backward()
            if hasattr(model, "sync_gradients"):
                model.sync_gradients()
            opts[name].step()
            dt = time.perf_counter() - t0
            if step >= warmup:
                times[name].append(dt)
                if name == "minidist":
                    comm_s = tl.total("all-reduce", lane="comm")
                    wait_s = tl.total("wait", lane="main")
                    hidden.append(max(0.0, 1.0 - wait_s / comm_s) if comm_s > 0 else 0.0)
    n_buckets = len(variants["minidist"].buckets)
    variants["minidist"].close()
    pair_ratio = statistics.median(a / b for a, b in zip(times["minidist"], times["torch"]))
    return ({k: statistics.median(v) for k, v in times.items()}, statistics.median(hidden),
            n_buckets, pair_ratio)


def bench_ddp(world_size: int = 2, steps: int = 10, bucket_cap_mb: float = 25.0,
              model: str = "resnet18", batch_size: int = 16, warmup: int = 2,
              collectives: str = "hand-built", with_flat: bool = True, timeout: float = 600,
              verbose: bool = True, first_bucket_cap_mb: float | None = 1.0) -> dict:
    """Median step time of minidist's BucketedDDP vs torch's DDP (same run, same model).

    Returns ``{"minidist_s", "torch_s", "ratio", "hidden_share", "flat_s" (if with_flat),
    "n_buckets", "world_size", "model", ...}``; ``ratio`` = minidist / torch (goal ≤ 1.05): the
    median over steps of the ratio of the two step times measured back to back (robust to a
    machine whose load changes during the run), the slowest rank's.
    Times are seconds per step, the slowest rank's median. Both DDPs use ``bucket_cap_mb``;
    ``first_bucket_cap_mb`` (default 1 MiB, as torch's DDP does internally) caps minidist's
    bucket 0.
    """
    from ..launch import run
    import torch._dynamo  # noqa: F401  (optimizers import it; do it once before forking)

    results = run(_rank_bench, world_size, model, steps, warmup, batch_size, bucket_cap_mb,
                  collectives, with_flat, first_bucket_cap_mb, timeout=timeout)
    med = {k: max(r[0][k] for r in results) for k in results[0][0]}
    hidden = min(r[1] for r in results)
    out = {"world_size": world_size, "model": model, "batch_size": batch_size, "steps": steps,
           "bucket_cap_mb": bucket_cap_mb, "collectives": collectives, "minidist_s": med["minidist"],
           "torch_s": med["torch"], "ratio": max(r[3] for r in results),
           "hidden_share": hidden, "n_buckets": results[0][2]}
    if with_flat:
        out["flat_s"] = med["flat"]
    if verbose:
        print(f"DDP step time, {model}, world size {world_size}, batch {batch_size}/rank, "
              f"bucket cap {bucket_cap_mb} MiB ({out['n_buckets']} buckets), "
              f"collectives={collectives}, "
              f"median of {steps} steps")
        print(f"  {'variant':<28}{'step (ms)':>10}{'vs torch':>10}")
        print(f"  {'torch DDP':<28}{1e3 * out['torch_s']:>10.1f}{1.0:>10.2f}")
        print(f"  {'minidist BucketedDDP':<28}{1e3 * out['minidist_s']:>10.1f}{out['ratio']:>10.2f}")
        if with_flat:
            print(f"  {'minidist FlatDDP (no overlap)':<28}{1e3 * out['flat_s']:>10.1f}"
                  f"{out['flat_s'] / out['torch_s']:>10.2f}")
        print(f"  communication hidden behind backward (minidist): {100 * hidden:.0f}%")
        print(f"  ratio minidist/torch = {out['ratio']:.3f} (goal <= 1.05)")
    return out
