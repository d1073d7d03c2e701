"""``minidist bench flops``: the matrix-multiply rate of this machine, in GFLOP/s.

A product of two n × n matrices costs ``2 n³`` floating-point operations: each of the n² outputs
is n multiplications and n - 1 additions, counted as 2n (Golub & Van Loan, *Matrix Computations*,
4th ed., §1.1: C = AB with A m × r and B r × n takes 2mnr flops). The rate at size n is
``2 n³ / t`` with ``t`` the **median** of the repetitions (its IQR is reported beside it);
repetitions scale with the size under a time budget, as for the alpha-beta fit.

The rate depends on the number of threads torch uses (``torch.get_num_threads()``), which every
result states: ranks started by :func:`minidist.run` use one intra-op thread each, so a planner
that models one rank per core wants the 1-thread rate. A GPU is timed with
``torch.cuda.synchronize`` around each call (``device="cuda"``); nothing here touches CUDA otherwise.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass, field

import torch

from .alpha_beta import machine_note
from .alpha_beta_bench import repetitions

__all__ = ["matmul_flops", "FlopsResult", "bench_flops", "format_flops", "save_flops",
           "load_flops", "main", "FORMAT", "DEFAULT_SIZES"]

FORMAT = "minidist-flops/1"
DEFAULT_SIZES = (128, 256, 512, 1024, 2048)


def matmul_flops(n: int) -> int:
    """Floating-point operations of an [n × n] @ [n × n] product: 2 n³ (Golub & Van Loan §1.1)."""
    if n < 0:
        raise ValueError(f"matmul_flops: n must be >= 0, got {n}")
    return 2 * n ** 3


@dataclass
class FlopsResult:
    """Matmul rates at ``threads`` torch threads. ``points``: one dict per n: n, reps, median_s,
    q25_s, q75_s, gflops (2n³ / median), gflops_iqr ((2n³/q75, 2n³/q25)). ``flops_per_s``: the best
    per-size median rate (what large matmuls sustain), in FLOP/s."""

    flops_per_s: float
    threads: int
    dtype: str = "float32"
    device: str = "cpu"
    points: list[dict] = field(default_factory=list)
    machine: dict = field(default_factory=dict)

    def rate_at(self, n: int) -> float:
        """FLOP/s measured at the size nearest to ``n`` (in log scale): small matrices that fit in
        cache run faster than large ones, so a model of n-sized matmuls wants this, not the best."""
        if n < 1:
            raise ValueError(f"rate_at: n must be >= 1, got {n}")
        p = min(self.points, key=lambda p: (abs(math.log(p["n"] / n)), -p["n"]))
        return p["gflops"] * 1e9

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "FlopsResult":
        return cls(**d)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def bench_flops(sizes=DEFAULT_SIZES, threads: int | None = None, budget_s: float = 10.0,
                min_reps: int = 5, max_reps: int = 1000, warmup: int = 2,
                dtype: torch.dtype = torch.float32, device: str = "cpu",
                note: str = "") -> FlopsResult:
    """Time ``[n × n] @ [n × n]`` for each n in ``sizes`` and return the rates.

    ``threads``: torch intra-op threads during the measurement (restored after; default: as set).
    ``budget_s`` is split evenly over the sizes (at least ``min_reps`` each).
    Raises ValueError for an empty ``sizes`` or a size < 1.
    """
    if not sizes or min(sizes) < 1:
        raise ValueError(f"bench_flops: sizes must be positive integers, got {sizes!r}")
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(0)
        points = []
        for n in sizes:
            a = torch.randn(n, n, generator=gen, dtype=dtype).to(device)
            b = torch.randn(n, n, generator=gen, dtype=dtype).to(device)
            c = torch.empty(n, n, dtype=dtype, device=device)

            def once(a=a, b=b, c=c):   # this iteration's matrices
                _sync(device)
                t0 = time.perf_counter()
                torch.matmul(a, b, out=c)
                _sync(device)
                return time.perf_counter() - t0

            for _ in range(warmup):
                once()
            probe = sorted(once() for _ in range(3))[1]
            reps = repetitions(probe, budget_s / len(sizes), min_reps, max_reps)
            t = torch.tensor([once() for _ in range(reps)], dtype=torch.float64)
            med, q25, q75 = (t.quantile(q).item() for q in (0.5, 0.25, 0.75))
            f = matmul_flops(n)
            points.append(dict(n=n, reps=reps, median_s=med, q25_s=q25, q75_s=q75,
                               gflops=f / med / 1e9, gflops_iqr=(f / q75 / 1e9, f / q25 / 1e9)))
        used = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    machine = machine_note(note)
    machine["torch_threads"] = used
    return FlopsResult(flops_per_s=max(p["gflops"] for p in points) * 1e9, threads=used,
                       dtype=str(dtype).replace("torch.", ""), device=device, points=points,
                       machine=machine)


def format_flops(res: FlopsResult) -> str:
    """One line per size (reps, median ms, GFLOP/s and its IQR) and the best rate."""
    lines = [f"[n x n] @ [n x n], {res.dtype} on {res.device}, torch threads = {res.threads}; "
             f"FLOPs = 2 n^3",
             f"{'n':>6}{'reps':>7}{'median ms':>12}{'GFLOP/s':>10}{'IQR GFLOP/s':>20}"]
    for p in res.points:
        lo, hi = p["gflops_iqr"]
        lines.append(f"{p['n']:>6}{p['reps']:>7}{p['median_s'] * 1e3:>12.3f}{p['gflops']:>10.2f}"
                     f"{f'[{lo:.2f}, {hi:.2f}]':>20}")
    lines.append(f"best median rate: {res.flops_per_s / 1e9:.2f} GFLOP/s at {res.threads} thread(s)")
    return "\n".join(lines)


def save_flops(path, results: list[FlopsResult]) -> None:
    """Write ``{"format": FORMAT, "flop_rate": ..., "threads": ..., "results": [FlopsResult.to_dict(),
    ...]}`` as JSON. ``flop_rate`` (FLOP/s) is the fewest-threads result's rate: one rank's rate
    under :func:`minidist.run` (one thread per rank), what ``minidist plan --flop-rate FILE`` reads."""
    if not results:
        raise ValueError("save_flops: no results to write")
    single = min(results, key=lambda r: r.threads)
    with open(path, "w") as f:
        json.dump({"format": FORMAT, "flop_rate": single.flops_per_s, "threads": single.threads,
                   "results": [r.to_dict() for r in results]}, f, indent=1)


def load_flops(path) -> list[FlopsResult]:
    """Read a file written by :func:`save_flops`; ValueError if its ``format`` is not FORMAT."""
    with open(path) as f:
        d = json.load(f)
    if d.get("format") != FORMAT:
        raise ValueError(f"{path}: format {d.get('format')!r}, expected {FORMAT!r}")
    out = []
    for r in d["results"]:
        for p in r["points"]:
            p["gflops_iqr"] = tuple(p["gflops_iqr"])
        out.append(FlopsResult.from_dict(r))
    return out


def main(argv=None) -> int:
    """``minidist bench flops [--sizes N ...] [--threads T ...] [--json FILE]``"""
    p = argparse.ArgumentParser(prog="minidist bench flops", description="fp32 matmul rate "
                                "(GFLOP/s, FLOPs = 2 n^3) at a few sizes: median of repetitions.")
    p.add_argument("--sizes", nargs="+", type=int, default=list(DEFAULT_SIZES))
    p.add_argument("--threads", nargs="+", type=int, default=None,
                   help="torch thread counts to measure (default: 1 and torch's default)")
    p.add_argument("--budget-s", type=float, default=10.0, help="seconds per thread count")
    p.add_argument("--min-reps", type=int, default=5)
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    p.add_argument("--note", default="")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    if min(args.sizes) < 1:
        p.error("--sizes must be positive")
    threads = args.threads or sorted({1, torch.get_num_threads()})
    if min(threads) < 1:
        p.error("--threads must be >= 1")
    results = []
    for t in threads:
        results.append(bench_flops(args.sizes, t, args.budget_s, args.min_reps,
                                   device=args.device, note=args.note))
        print(format_flops(results[-1]) + "\n")
    m = results[0].machine
    print(f"{m['cpus']} CPUs, load average {m['loadavg_1_5_15']} (a shared machine: rates vary "
          f"between runs)")
    if args.json:
        save_flops(args.json, results)
        print(f"wrote {args.json}")
    return 0
