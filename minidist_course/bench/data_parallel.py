"""``minidist bench ddp`` — minidist's bucketed DDP against torch's DDP, measured in the same run.

Every rank builds identical models: one wrapped in :class:`BucketedDDP`, one in
``torch.nn.parallel.DistributedDataParallel`` (same bucket cap, so the same buckets), by default
a second torch DDP (the control, ``torch-again``: torch against itself, the run's noise) and
optionally a :class:`FlatDDP` (all communication after backward: the no-overlap baseline). Steps
alternate between them (in a balanced order: each in every position and after every other alike),
so machine noise hits all alike; the median step time (forward, backward, synchronisation,
optimizer) is reported, and the ratio to torch as the median of per-step ratios. The share of
communication hidden behind backward is read
from minidist's timeline: 1 − (time the step waited for buckets after backward) / (time the
buckets' all-reduces took).

With ``profile=True`` a third DDP joins the alternation — the same :class:`BucketedDDP` with
``collectives="torch"`` (gloo's C++ ring underneath) — and every variant reports, besides its step
time, its **CPU time per step** (``time.process_time``: all threads of the rank: backward, the
communication thread, gloo's I/O threads) and, for the bucketed ones, the **wait** after backward
(communication not hidden) and the communication thread's time per step. A step can never be
shorter than the ranks' CPU work divided by the cores they get, so on a machine whose cores are all
busy extra CPU work (Python ring steps, additions, copies) shows up as extra step time even when it
is "hidden" behind backward; on idle cores only the wait does.
"""

from __future__ import annotations

import contextlib

import statistics
import time

import torch
import torch.nn.functional as F

from .collectives import CONTROL

__all__ = ["bench_ddp"]


def _minor_faults() -> int:
    """Minor page faults of this process so far (0 where the OS does not count them): a
    page the allocator gave back to the kernel costs one fault per 4 KiB when touched again."""
    try:
        import resource
    except ImportError:   # not a Unix
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _model(name: str):
    torch.manual_seed(0)
    if name == "resnet18":
        import torchvision
        return torchvision.models.resnet18(num_classes=10), (3, 32, 32)
    if name == "mlp":
        from minidist.models import MLP
        return MLP(1024, (1024, 1024, 1024), 10), (1024,)
    raise ValueError(f"bench_ddp: model must be 'resnet18' or 'mlp', got {name!r}")


def _rank_bench(rank, world, model_name, steps, warmup, batch_size, bucket_cap_mb, collectives,
                with_flat, first_bucket_cap_mb, profile=False, algorithm="auto", control=True):
    from .collectives import balanced_order
    from minidist.trace import Timeline
    from minidist.data_parallel.bucketed import BucketedDDP
    from minidist.data_parallel.flat import FlatDDP

    tls = {"minidist": Timeline()}
    variants = {}
    m, shape = _model(model_name)
    variants["minidist"] = BucketedDDP(m, bucket_cap_mb=bucket_cap_mb, collectives=collectives,
                                       first_bucket_cap_mb=first_bucket_cap_mb, algorithm=algorithm)
    if profile:
        m, _ = _model(model_name)
        tls["bucketed+torch"] = Timeline()
        variants["bucketed+torch"] = BucketedDDP(m, bucket_cap_mb=bucket_cap_mb,
                                                 collectives="torch",
                                                 first_bucket_cap_mb=first_bucket_cap_mb)
    m, _ = _model(model_name)
    variants["torch"] = torch.nn.parallel.DistributedDataParallel(m, bucket_cap_mb=bucket_cap_mb)
    if control:   # torch's DDP a second time: its ratio to the first is the run's noise
        m, _ = _model(model_name)
        variants[CONTROL] = torch.nn.parallel.DistributedDataParallel(m, bucket_cap_mb=bucket_cap_mb)
    if with_flat:
        m, _ = _model(model_name)
        variants["flat"] = FlatDDP(m, collectives=collectives, algorithm=algorithm)
    opts = {k: torch.optim.SGD(v.parameters(), lr=0.01) for k, v in variants.items()}
    times = {k: [] for k in variants}
    cpu = {k: [] for k in variants}
    faults = {k: [] for k in variants}
    waits = {k: [] for k in tls}
    comms = {k: [] for k in tls}
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(batch_size, *shape, generator=g)
    y = torch.randint(0, 10, (batch_size,), generator=g)
    hidden = []
    names = list(variants)
    for step in range(warmup + steps):
        # a balanced order: each variant in every position and after every other alike
        for name in balanced_order(names, step):
            model = variants[name]
            tl = tls.get(name)
            if tl is not None:
                tl.clear()
            f0 = _minor_faults()
            c0 = time.process_time()
            t0 = time.perf_counter()
            with tl.observe() if tl is not None else contextlib.nullcontext():
                opts[name].zero_grad()
                F.cross_entropy(model(x), y).backward()
                if hasattr(model, "sync_gradients"):
                    model.sync_gradients()
                opts[name].step()
            dt = time.perf_counter() - t0
            dc = time.process_time() - c0
            if step >= warmup:
                times[name].append(dt)
                cpu[name].append(dc)
                faults[name].append(_minor_faults() - f0)
                if tl is not None:
                    comm_s = tl.total("all-reduce", lane="comm")
                    wait_s = tl.total("wait", lane="main")
                    waits[name].append(wait_s)
                    comms[name].append(comm_s)
                    if name == "minidist":
                        hidden.append(max(0.0, 1.0 - wait_s / comm_s) if comm_s > 0 else 0.0)
    n_buckets = len(variants["minidist"].buckets)
    from minidist.comm import tuner
    chosen = [algorithm if algorithm != "auto" else
              tuner.agreed_table(None).choose("all_reduce", world, b.numel * b.buffer.element_size())
              for b in variants["minidist"].buckets]
    for name in tls:
        variants[name].close()
    med = statistics.median
    pair_ratio = {k: med(a / b for a, b in zip(times[k], times["torch"])) for k in times}
    prof = {k: {"step_s": med(times[k]), "cpu_s": med(cpu[k]), "minor_faults": med(faults[k]),
                "ratio": pair_ratio[k],
                "step_spread_s": (min(times[k]), max(times[k])),
                **({"wait_s": med(waits[k]), "comm_s": med(comms[k])} if k in tls else {})}
            for k in variants}
    return ({k: med(v) for k, v in times.items()}, med(hidden), n_buckets, pair_ratio, prof, chosen)


def bench_ddp(world_size: int = 2, steps: int = 10, bucket_cap_mb: float = 25.0,
              model: str = "resnet18", batch_size: int = 16, warmup: int = 2,
              collectives: str = "hand-built", with_flat: bool = True, timeout: float = 600,
              verbose: bool = True, first_bucket_cap_mb: float | None = None,
              profile: bool = False, algorithm: str = "auto", control: bool = True) -> dict:
    """Median step time of minidist's BucketedDDP vs torch's DDP (same run, same model).

    Returns ``{"minidist_s", "torch_s", "ratio", "hidden_share", "flat_s" (if with_flat),
    "n_buckets", "world_size", "model", ...}``; ``ratio`` = minidist / torch (goal ≤ 1.05): the
    median over steps of the ratio of the two step times measured back to back (robust to a
    machine whose load changes during the run), the slowest rank's. ``control=True`` (default)
    times torch's DDP a second time as one more variant (an A/A test) and returns
    ``out["control_ratio"]``, its ratio to the first by the same rule: the run's noise, against
    which ``ratio`` is read (a ratio as far from 1 as the control's does not tell the two apart).
    Times are seconds per step, the slowest rank's median. Both DDPs use ``bucket_cap_mb`` and
    cut buckets by the same rule, so they have the same buckets: torch's DDP, given a
    ``bucket_cap_mb``, uses it for its first bucket too (its 1 MiB first bucket applies only when
    the cap is left at its default), and so does minidist's unless ``first_bucket_cap_mb`` (MiB,
    bucket 0 only) is given. ``algorithm``: minidist's all-reduce (default ``"auto"``, the
    tuner's choice per
    bucket, listed in ``out["chosen"]``; or ``"ring"``, ...). ``profile=True`` adds ``out["profile"]``: per rank, per variant ("torch",
    "minidist", "bucketed+torch" = BucketedDDP over torch's collectives, "flat"), the medians
    ``step_s``, ``cpu_s`` (CPU seconds of the rank's threads per step), ``minor_faults`` (page
    faults per step: memory the allocator had returned to the kernel), ``ratio`` (to torch, per
    step), ``step_spread_s`` (min, max) and, for the bucketed ones, ``wait_s`` (after backward)
    and ``comm_s`` (communication thread per step); it prints them as a table.
    """
    from minidist.launch import run
    import torch._dynamo  # noqa: F401  (optimizers import it; do it once before forking)

    results = run(_rank_bench, world_size, model, steps, warmup, batch_size, bucket_cap_mb,
                  collectives, with_flat, first_bucket_cap_mb, profile, algorithm, control,
                  timeout=timeout)
    med = {k: max(r[0][k] for r in results) for k in results[0][0]}
    hidden = min(r[1] for r in results)
    out = {"world_size": world_size, "model": model, "batch_size": batch_size, "steps": steps,
           "bucket_cap_mb": bucket_cap_mb, "collectives": collectives, "minidist_s": med["minidist"],
           "torch_s": med["torch"], "ratio": max(r[3]["minidist"] for r in results),
           "hidden_share": hidden, "n_buckets": results[0][2], "algorithm": algorithm,
           "chosen": results[0][5]}
    if with_flat:
        out["flat_s"] = med["flat"]
    if control:   # the same rule as ratio's: the slowest rank's median of per-step ratios
        out["control_ratio"] = max(r[3][CONTROL] for r in results)
    if profile:
        out["profile"] = [r[4] for r in results]
    if verbose:
        print(f"DDP step time, {model}, world size {world_size}, batch {batch_size}/rank, "
              f"bucket cap {bucket_cap_mb} MiB ({out['n_buckets']} buckets), "
              f"collectives={collectives}, algorithm={algorithm} ("
              + ", ".join(f"b{i}: {a}" for i, a in enumerate(out["chosen"]))
              + f"), median of {steps} steps")
        print(f"  {'variant':<28}{'step (ms)':>10}{'vs torch':>10}")
        print(f"  {'torch DDP':<28}{1e3 * out['torch_s']:>10.1f}{1.0:>10.2f}")
        print(f"  {'minidist BucketedDDP':<28}{1e3 * out['minidist_s']:>10.1f}{out['ratio']:>10.2f}")
        if control:
            print(f"  {'torch DDP again (control)':<28}{1e3 * med[CONTROL]:>10.1f}"
                  f"{out['control_ratio']:>10.2f}")
        if with_flat:
            print(f"  {'minidist FlatDDP (no overlap)':<28}{1e3 * out['flat_s']:>10.1f}"
                  f"{out['flat_s'] / out['torch_s']:>10.2f}")
        print(f"  communication hidden behind backward (minidist): {100 * hidden:.0f}%")
        print(f"  ratio minidist/torch = {out['ratio']:.3f} (goal <= 1.05)")
        if control:
            print(f"  noise: torch DDP against itself = {out['control_ratio']:.3f} (the same rule;"
                  " a ratio no further from 1 does not tell minidist from torch)")
        if profile:
            _print_profile(out["profile"], algorithm)
    return out


def _print_profile(per_rank: list[dict], algorithm: str = "auto") -> None:
    names = {"torch": "torch DDP", "minidist": f"BucketedDDP, hand-built {algorithm}",
             "bucketed+torch": "BucketedDDP, torch's ring", "flat": f"FlatDDP, hand-built {algorithm}",
             "torch-again": "torch DDP again (control)"}
    print("  per step, medians (faults: minor page faults; wait: after backward, not hidden; "
          "comm: communication thread busy)")
    print(f"  {'rank':<5}{'variant':<31}{'step ms':>9}{'spread':>13}{'vs torch':>9}{'CPU ms':>8}"
          f"{'faults':>8}{'comm ms':>9}{'wait ms':>9}")
    for rank, prof in enumerate(per_rank):
        for k, p in prof.items():
            lo, hi = p["step_spread_s"]
            extra = (f"{1e3 * p['comm_s']:>9.1f}{1e3 * p['wait_s']:>9.1f}" if "wait_s" in p
                     else f"{'':>9}{'':>9}")
            print(f"  {rank:<5}{names.get(k, k):<31}{1e3 * p['step_s']:>9.1f}"
                  f"{f'{1e3 * lo:.0f}-{1e3 * hi:.0f}':>13}{p['ratio']:>9.2f}{1e3 * p['cpu_s']:>8.1f}"
                  f"{p['minor_faults']:>8.0f}" + extra)
