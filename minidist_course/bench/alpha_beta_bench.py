"""``minidist bench alpha-beta``: measure a collective at many sizes, with repetitions scaled to the
message size, and fit link alpha and beta with their bootstrap spread (:mod:`.alpha_beta`).

Why the repetitions scale: a 1 KiB all-reduce takes tens of microseconds and its time on a shared
machine is mostly scheduling noise, so a few repetitions give a median that can be off by
milliseconds (an alpha that moves 3x between two runs); a 16 MiB one takes tens of milliseconds and
ten repetitions pin it. So each size first gets a short probe, then ``budget_s / (sizes ×
algorithms)`` seconds of repetitions (:func:`repetitions`: at least ``min_reps``, at most
``max_reps``; a larger size never gets more than a smaller one, whatever a noisy probe says).
The repetitions are spread over ``rounds`` passes through all sizes, and algorithms
alternate call by call, so a load spike lands on every size and algorithm alike instead of on one.

Each repetition: refill the input, barrier, time the call; a sample is the slowest rank's time
(all ranks' times are max-reduced at the end). Every result is checked against the known sum.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.distributed as dist

from minidist.launch import run
from .alpha_beta import (MODELS, compare_fits, fit_alpha_beta_samples, format_comparison, format_fit,
                         load_fits, machine_note, save_fits)
from .collectives import _one_op, parse_size

__all__ = ["repetitions", "measure_samples", "bench_alpha_beta", "write_machine_table", "main",
           "DEFAULT_SIZES"]

DEFAULT_SIZES = tuple(1 << k for k in range(10, 25, 2))  # 1 KiB .. 16 MiB, x4


def repetitions(probe_s: float, budget_s: float, min_reps: int = 10, max_reps: int = 2000) -> int:
    """How many repetitions fit ``budget_s`` seconds when one takes ``probe_s``: ``budget/probe``
    clipped to [min_reps, max_reps]. Small messages get many, large ones ``min_reps``.
    Raises ValueError unless 1 <= min_reps <= max_reps and budget_s >= 0."""
    if not 1 <= min_reps <= max_reps or budget_s < 0:
        raise ValueError(f"repetitions: need 1 <= min_reps <= max_reps and budget_s >= 0, got "
                         f"min_reps={min_reps}, max_reps={max_reps}, budget_s={budget_s}")
    if not probe_s > 0 or not math.isfinite(probe_s):
        return max_reps
    return int(min(max_reps, max(min_reps, math.floor(budget_s / probe_s + 1e-9))))


def _rank(rank, world, op, algorithms, sizes, budget_s, min_reps, max_reps, warmup, rounds):
    """Per (algorithm, size): the slowest rank's time of every repetition, and the worst error."""
    closures = {(a, s): _one_op(op, a, s, rank, world) for s in sizes for a in algorithms}

    def once(a, s):
        prep, call, _ = closures[(a, s)]
        prep()
        dist.barrier()
        t0 = time.perf_counter()
        call()
        return time.perf_counter() - t0

    per_size = budget_s / max(1, len(sizes) * len(algorithms))
    reps = {}
    for s in sizes:  # warm-up, then a probe of the wall time of one repetition (barrier included)
        for _ in range(warmup):
            for a in algorithms:
                once(a, s)
        t0 = time.perf_counter()
        for _ in range(3):
            for a in algorithms:
                once(a, s)
        probe = torch.tensor([(time.perf_counter() - t0) / 3 / len(algorithms)], dtype=torch.float64)
        dist.all_reduce(probe, op=dist.ReduceOp.MAX)  # every rank picks the same count
        reps[s] = repetitions(probe.item(), per_size, min_reps, max_reps)
    for small, large in zip(sizes, sizes[1:]):  # a noisy probe never gives a larger size more
        reps[large] = min(reps[large], reps[small])
    times = {k: [] for k in closures}
    for r in range(rounds):
        for s in sizes:
            share = reps[s] // rounds + (r < reps[s] % rounds)
            for _ in range(share):
                for a in algorithms:
                    times[(a, s)].append(once(a, s))
    out = {}
    for (a, s), ts in times.items():
        t = torch.tensor(ts + [closures[(a, s)][2]()], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # slowest rank per repetition; worst error
        out[(a, s)] = (t[:-1].tolist(), t[-1].item())
    return out


def measure_samples(world_size: int = 2, algorithms=("ring", "torch"), op: str = "all_reduce",
                    sizes=DEFAULT_SIZES, budget_s: float = 30.0, min_reps: int = 10,
                    max_reps: int = 2000, warmup: int = 3, rounds: int = 4,
                    timeout: float = 900.0) -> dict[str, dict[int, list[float]]]:
    """Time ``op`` for each algorithm and size (bytes, float32 buffers) on ``world_size`` ranks.

    Returns {algorithm: {bytes: [seconds, one per repetition (the slowest rank's)]}}. Raises
    RuntimeError if a result is wrong, ValueError for an algorithm without an alpha-beta model.
    """
    for a in algorithms:
        if (op, a) not in MODELS:
            raise ValueError(f"bench alpha-beta: no model for {op}/{a}; choose from "
                             f"{sorted(k[1] for k in MODELS if k[0] == op)}")
    out = run(_rank, world_size, op, tuple(algorithms), tuple(sorted(sizes)), budget_s, min_reps,
              max_reps, warmup, max(1, rounds), timeout=timeout)[0]
    res = {a: {} for a in algorithms}
    for (a, s), (ts, err) in out.items():
        if err > 1e-3 * max(1.0, world_size ** 2):
            raise RuntimeError(f"bench alpha-beta: {op}/{a} at W={world_size}, {s} bytes gave a "
                               f"wrong result (max error {err:g})")
        res[a][s] = ts
    return res


def bench_alpha_beta(world_size: int = 2, algorithms=("ring", "torch"), op: str = "all_reduce",
                     sizes=DEFAULT_SIZES, budget_s: float = 30.0, min_reps: int = 10,
                     max_reps: int = 2000, n_bootstrap: int = 1000, seed: int = 0,
                     note: str = "", **kw) -> list:
    """Measure (:func:`measure_samples`) and fit (:func:`fit_alpha_beta_samples`) each algorithm;
    returns a list of :class:`~minidist_course.bench.alpha_beta.AlphaBetaFit`, one per algorithm."""
    samples = measure_samples(world_size, algorithms, op, sizes, budget_s, min_reps, max_reps, **kw)
    machine = machine_note(note)
    machine["budget_s"] = budget_s
    return [fit_alpha_beta_samples(samples[a], op, a, world_size, n_bootstrap=n_bootstrap,
                                   seed=seed, machine=machine) for a in algorithms]


def write_machine_table(fits: list, path=None) -> str:
    """Merge ``fits`` into this machine's table (:func:`minidist.comm.tuner.machine_table_path`):
    a fit replaces the one of the same (op, algorithm, world size), the others stay. Written to a
    temporary file and renamed (a reader never sees half a table). Returns the path."""
    import os
    from pathlib import Path

    from minidist.comm import tuner

    path = Path(path) if path is not None else tuner.machine_table_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    keep = []
    if path.exists():
        try:
            keep = load_fits(path)
        except (OSError, ValueError, KeyError, TypeError):
            keep = []                                   # a corrupt table is replaced
    new = {(f.op, f.algorithm, f.world_size) for f in fits}
    merged = [f for f in keep if (f.op, f.algorithm, f.world_size) not in new] + list(fits)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    save_fits(tmp, merged)
    os.replace(tmp, path)
    tuner.reset_cache()
    return str(path)


def main(argv=None) -> int:
    """``minidist bench alpha-beta [--world-size W ...] [--algorithm ...] [--json [FILE]] ...``"""
    from minidist.comm import tuner

    p = argparse.ArgumentParser(prog="minidist bench alpha-beta", description="Fit link alpha "
                                "(latency, s) and beta (s/byte) of a collective from medians of "
                                "repetitions scaled to the message size, with bootstrap spreads. "
                                "--json without a file measures what algorithm='auto' chooses "
                                "from (every op and algorithm of the tuner, W = 2 and 4) and "
                                f"writes this machine's table ({tuner.machine_table_path()}).")
    p.add_argument("--world-size", type=int, nargs="+", default=None,
                   help="one or more (default 2; with --json and no file: 2 4)")
    p.add_argument("--op", nargs="+", default=None, choices=sorted({k[0] for k in MODELS}),
                   help="default all_reduce; with --json and no file: every op auto chooses for")
    p.add_argument("--algorithm", nargs="+", default=None, choices=sorted({k[1] for k in MODELS}),
                   help="one or more; several are timed in alternation in the same run (default "
                        "ring torch; with --json and no file: every algorithm auto chooses from)")
    p.add_argument("--min-bytes", default="1K")
    p.add_argument("--max-bytes", default=None,
                   help="default 16M; with --json and no file 64M (the largest size auto is "
                        "benchmarked at, so the choice there is measured, not extrapolated)")
    p.add_argument("--factor", type=int, default=4, help="size multiplier between sizes")
    p.add_argument("--budget-s", type=float, default=30.0,
                   help="seconds of repetitions per op and world size (split over sizes and "
                        "algorithms)")
    p.add_argument("--min-reps", type=int, default=10)
    p.add_argument("--max-reps", type=int, default=2000)
    p.add_argument("--bootstrap", type=int, default=1000, help="resamples for the spread")
    p.add_argument("--note", default="", help="free text stored with the result (e.g. 'loaded')")
    p.add_argument("--json", metavar="FILE", nargs="?", const="",
                   help="write the fits (format minidist-alpha-beta/1); without FILE: merge them "
                        "into this machine's table, which algorithm='auto' reads")
    p.add_argument("--compare", metavar="FILE", help="an earlier run's --json: do the spreads overlap?")
    p.add_argument("--reset", action="store_true",
                   help="delete this machine's table (auto goes back to the shipped default)")
    args = p.parse_args(argv)
    if args.reset:
        path = tuner.machine_table_path()
        if path.exists():
            path.unlink()
            print(f"removed {path}; algorithm='auto' uses the default table shipped with minidist")
        else:
            print(f"no machine table at {path}; algorithm='auto' uses the shipped default")
        return 0
    for_tuner = args.json == ""
    worlds = args.world_size or ([2, 4] if for_tuner else [2])
    ops = args.op or (list(tuner.CANDIDATES) if for_tuner else ["all_reduce"])
    if any(w < 2 for w in worlds):
        p.error("--world-size must be >= 2 (one rank sends nothing)")
    if args.factor < 2:
        p.error("--factor must be >= 2")
    max_bytes = args.max_bytes or ("64M" if for_tuner else "16M")
    sizes, s = [], parse_size(args.min_bytes)
    while s <= parse_size(max_bytes):
        sizes.append(s)
        s *= args.factor
    if len(sizes) < 2:
        p.error("need at least two sizes between --min-bytes and --max-bytes")
    start = time.perf_counter()
    fits = []
    for op in ops:
        algorithms = args.algorithm or (list(tuner.CANDIDATES[op]) if for_tuner else ["ring", "torch"])
        algorithms = [a for a in algorithms if (op, a) in MODELS]
        if not algorithms:
            p.error(f"no algorithm with a model for {op}: choose from "
                    f"{sorted(k[1] for k in MODELS if k[0] == op)}")
        for w in worlds:
            fits += bench_alpha_beta(w, algorithms, op, sizes, args.budget_s, args.min_reps,
                                     args.max_reps, args.bootstrap, note=args.note)
    for f in fits:
        print(format_fit(f) + "\n")
    m = fits[0].machine
    print(f"measured in {time.perf_counter() - start:.0f} s on {m['cpus']} CPUs, load average "
          f"{m['loadavg_1_5_15']} (a shared machine's load moves these numbers between runs; the "
          f"spread covers the noise within this run only)")
    if args.compare:
        print(f"against {args.compare}:\n" + format_comparison(compare_fits(load_fits(args.compare), fits)))
    if for_tuner:
        print(f"wrote this machine's table {write_machine_table(fits)} (algorithm='auto' reads it; "
              f"`minidist bench alpha-beta --reset` removes it)")
    elif args.json:
        save_fits(args.json, fits)
        print(f"wrote {args.json}")
    return 0
