"""``minidist bench report`` — every side-by-side benchmark against torch in one run, one table.

Rows: bucketed DDP against torch's DDP (:func:`.data_parallel.bench_ddp`), ZeRO-3 against FSDP2
(:func:`.sharding.bench_zero`), tensor parallelism with and without sequence parallelism against
``parallelize_module`` (:func:`.tensor_parallel.bench_tp`, W = 2 and 4), and every pipeline
schedule both have against torch.distributed.pipelining (:func:`.pipeline_torch.bench_pp_torch`),
with each engine's pipeline idle time over the communication-aware simulator's (goal ≤ 1.10 too).
Each row: minidist's and torch's median step time, the ratio (median of per-step ratios), the
**control** — torch against itself in the same run, where the benchmark has one — and the goal:
ratio ≤ 1.10. The verdict is ✓ or ✗ when the control's distance from 1 is small beside the
ratio's, ``noise`` when the control moves as much as the ratio does (this run cannot tell), and
``—`` without a control. The machine's load average is printed with the table, and ``--json``
writes the rows for ``--compare`` with a later run.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os

__all__ = ["GOAL", "verdict", "run_report", "format_report", "compare", "main"]

GOAL = 1.10


def verdict(ratio: float, control: float | None) -> str:
    """✓ / ✗ against :data:`GOAL`, or ``noise`` when the control strays as far from 1 as the
    distance between the ratio and the goal (this run cannot tell), ``—`` without a control."""
    if control is None:
        return "—"
    if abs(control - 1) >= abs(ratio - GOAL):
        return "noise"
    return "✓" if ratio <= GOAL else "✗"


def run_report(steps: int = 6, quick: bool = False) -> list[dict]:
    """Run every benchmark at a small fixed size; rows ``{dimension, minidist_ms, torch_ms, ratio,
    control, verdict}``. ``quick``: the smallest sizes (a test's budget)."""
    from .data_parallel import bench_ddp
    from .pipeline_torch import bench_pp_torch
    from .sharding import bench_zero
    from .tensor_parallel import bench_tp
    rows = []

    def add(dimension, ours_ms, torch_ms, ratio, control, **extra):
        rows.append({"dimension": dimension, "minidist_ms": ours_ms, "torch_ms": torch_ms,
                     "ratio": ratio, "control": control, "verdict": verdict(ratio, control), **extra})

    with contextlib.redirect_stdout(io.StringIO()):
        d = bench_ddp(2, steps=steps, model="mlp", batch_size=4 if quick else 16, warmup=1,
                      with_flat=False, verbose=False)
        add("DDP (bucketed), W=2", 1e3 * d["minidist_s"], 1e3 * d["torch_s"], d["ratio"],
            d.get("control_ratio"))
        z = {r["variant"]: r for r in bench_zero(2, steps=steps, warmup=1,
                                                 variants=["zero3", "fsdp2", "fsdp2-again"],
                                                 **(dict(dim=16, hidden=32, blocks=2, vocab=32)
                                                    if quick else {}))}
        add("ZeRO-3 vs FSDP2, W=2", z["zero3"]["step_ms"], z["fsdp2"]["step_ms"],
            z["zero3"]["ratio_to_fsdp2"], z["fsdp2-again"]["ratio_to_fsdp2"])
        size = dict(batch=2, seq=8, hidden=32, heads=4) if quick else {}
        for w in ((2,) if quick else (2, 4)):
            t = {r["variant"]: r for r in bench_tp(w, steps=steps, warmup=1, quiet=True, **size)}
            add(f"TP, W={w}", t["minidist"]["step_ms"], t["torch"]["step_ms"], t["minidist"]["ratio"],
                t["torch-again"]["ratio"])
            add(f"TP + SP, W={w}", t["minidist+sp"]["step_ms"], t["torch+sp"]["step_ms"],
                t["minidist+sp"]["ratio"], t["torch-again"]["ratio"])
        pp = bench_pp_torch(2 if quick else 4, 4 if quick else 8, steps=max(2, steps - 1),
                            warmup=1, quiet=True, **(dict(t_f=0.002, t_b=0.004) if quick else {}))
        for r in pp:
            add(f"PP {r['schedule']} (bubble {r['bubble_minidist']:.2f} vs torch "
                f"{r['bubble_torch']:.2f}, predicted {r['bubble_predicted']:.2f})",
                r["minidist_ms"], r["torch_ms"], r["ratio"], None,
                idle_ratio_minidist=r["idle_ratio_minidist"], idle_ratio_torch=r["idle_ratio_torch"])
    return rows


def format_report(rows: list[dict]) -> str:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    width = max([len("dimension")] + [len(r["dimension"]) for r in rows])
    lines = [f"minidist bench report: minidist against torch in one run (goal: ratio <= {GOAL:.2f}); "
             f"load average {load:.2f} on {os.cpu_count()} cores",
             f"{'dimension':<{width}} {'minidist ms':>11} {'torch ms':>9} {'ratio':>6} {'control':>8}  "]
    for r in rows:
        control = f"{r['control']:.2f}" if r["control"] is not None else "—"
        lines.append(f"{r['dimension']:<{width}} {r['minidist_ms']:11.1f} {r['torch_ms']:9.1f} "
                     f"{r['ratio']:6.2f} {control:>8}  {r['verdict']}")
    lines.append("(control: torch against itself in the same run; 'noise': it strays as far as the "
                 "ratio from the goal, so this run cannot tell; '—': no control in that benchmark)")
    pp = [r for r in rows if "idle_ratio_minidist" in r]
    if pp:
        lines.append(f"pipeline idle time / the communication-aware simulator's (goal <= {GOAL:.2f}): "
                     "measured op times and overhead, alpha + bytes·beta per message, the closing "
                     "barrier; each step against its own prediction, the median")
        for r in pp:
            a, b = r["idle_ratio_minidist"], r["idle_ratio_torch"]
            lines.append(f"  {r['dimension'].split(' (')[0]:<22} minidist {a:5.3f} "
                         f"{'✓' if a <= GOAL else '✗'}   torch {b:5.3f} {'✓' if b <= GOAL else '✗'}")
    return "\n".join(lines)


def compare(before: list[dict], after: list[dict]) -> str:
    """The ratios of two reports side by side, by dimension."""
    old = {r["dimension"].split(" (")[0]: r for r in before}
    lines = [f"{'dimension':<30} {'before':>7} {'after':>7}"]
    for r in after:
        key = r["dimension"].split(" (")[0]
        if key in old:
            lines.append(f"{key:<30} {old[key]['ratio']:7.2f} {r['ratio']:7.2f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="minidist bench report", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--json", metavar="FILE", help="write the rows")
    p.add_argument("--compare", metavar="FILE", help="a previous --json: ratios side by side")
    a = p.parse_args(argv)
    rows = run_report(a.steps)
    print(format_report(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    if a.compare:
        with open(a.compare) as f:
            print(compare(json.load(f), rows))
    return 0
