"""The ``minidist`` command: ``demo`` (the tour, exits non-zero on any wrong result), ``bench``
(nccl-tests-style tables; ``bench ddp`` and ``bench pp`` for the strategies), ``doctor``,
``plan`` (3-D parallel configurations, :mod:`minidist_course.planner`) and ``matrix`` (every pair
of training-step features against one process, :mod:`minidist_course.matrix`)."""

from __future__ import annotations

import argparse
import importlib
import sys
import time

__all__ = ["main"]

# section of `minidist demo` -> the module of minidist_course.lessons that gives its rows
_SECTIONS = {name: f"{name}_demo" for name in ("data_parallel", "tensor_parallel", "pipeline_parallel",
                                                "sharding", "hybrid", "expert_parallel", "context_parallel")}


def demo(argv=None) -> int:
    p = argparse.ArgumentParser(prog="minidist demo", description="Run every hand-built collective "
                                "against torch's, then each strategy section (--sections) against "
                                "its one-process or torch reference; exit 1 if any result is wrong.")
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="where the collectives section's ranks compute; cuda: every rank shares "
                        "the one GPU, messages go through gloo (default: gloo on CPU unless the "
                        "machine has a GPU per rank)")
    p.add_argument("--sections", nargs="*", default=["collectives", *_SECTIONS],
                   choices=["collectives", *_SECTIONS], help="which sections to run (default: all)")
    args = p.parse_args(argv)
    from .lessons import collectives_demo

    start = time.perf_counter()
    rows = []
    if "collectives" in args.sections:
        print(f"minidist demo: hand-built collectives against torch.distributed, "
              f"world size {args.world_size} (gloo on CPU unless GPUs are available)\n")
        rows = collectives_demo.demo_rows(args.world_size,
                                          device=args.device if args.device == "cuda" else None)
        head = f"{'op/algorithm':<30}{'W':>3}{'max error':>12}{'busbw GB/s':>12}{'vs torch':>10}  ok"
        print(head + "\n" + "-" * len(head))
        for r in rows:
            print(f"{r['check']:<30}{r['world_size']:>3}{r['max_error']:>12.2e}{r['busbw']:>12.3f}"
                  f"{r['ratio']:>9.2f}x  {'✓' if r['ok'] else '✗ WRONG'}")
        print(f"(sizes checked: {', '.join(map(str, collectives_demo.SIZES))} elements per rank; busbw and "
              f"ratio measured at {collectives_demo.SIZES[-1]} elements, one call each: see `minidist bench`)")
    for section, module in _SECTIONS.items():
        if section not in args.sections:
            continue
        mod = importlib.import_module(f"minidist_course.lessons.{module}")
        print(f"\n== {section.replace('_', ' ')} ==")
        extra = mod.demo_rows()
        for r in extra:
            print(f"{r['check']:<48} W={r['world_size']:<2} max error {r['max_error']:.2e}  "
                  f"{'✓' if r['ok'] else '✗ WRONG'}  {r.get('detail', '')}")
        rows += extra
    bad = [r for r in rows if not r["ok"]]
    print(f"\n{len(rows) - len(bad)} of {len(rows)} checks correct in {time.perf_counter() - start:.1f} s")
    if bad:
        print("WRONG: " + ", ".join(f"{r['section']}:{r['check']}" for r in bad), file=sys.stderr)
        return 1
    return 0


# `minidist bench X` subcommands with their own parser: X -> module of minidist_course.bench with main(argv)
_BENCH_MAINS = {"alpha-beta": "alpha_beta_bench", "flops": "flops", "3d": "hybrid", "cp": "context_parallel",
                "tp": "tensor_parallel", "pp-torch": "pipeline_torch", "report": "report",
                "two-level": "two_level_report"}


def bench(argv=None) -> int:
    if argv and argv[0] in _BENCH_MAINS:  # their own options: `minidist bench flops --help`
        return importlib.import_module(f"minidist_course.bench.{_BENCH_MAINS[argv[0]]}").main(argv[1:])
    from . import bench as B

    p = argparse.ArgumentParser(prog="minidist bench", description="nccl-tests-style benchmark "
                                "(each row beside torch and the point-to-point ceiling); "
                                "'ddp', 'pp' and 'zero' benchmark the strategies; 'alpha-beta' "
                                "fits link latency and bandwidth with spreads; 'flops' the matmul rate; "
                                "'3d' measured vs predicted step time of dp x tp x pp configurations.")
    p.add_argument("what", nargs="?", default="collectives",
                   choices=["collectives", "ddp", "pp", "zero", *_BENCH_MAINS])
    p.add_argument("--ops", nargs="*", default=list(B.OPS), choices=B.OPS)
    p.add_argument("--algorithms", nargs="*", default=None,
                   help="torch and the names in minidist.collectives.ALGORITHMS (default: all "
                        "that apply to each op)")
    p.add_argument("--world-sizes", nargs="*", type=int, default=[2, 4])
    p.add_argument("--min-bytes", default="1K")
    p.add_argument("--max-bytes", default="64M")
    p.add_argument("--factor", type=int, default=4, help="size multiplier between rows")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--steps", type=int, default=10, help="'ddp': timed steps per variant")
    p.add_argument("--plot", metavar="FILE.png", help="draw busbw against size")
    args = p.parse_args(argv)
    if args.what == "ddp":
        from .bench.data_parallel import bench_ddp
        if args.steps < 1:
            p.error(f"--steps must be >= 1 (got {args.steps})")
        bench_ddp(algorithm=(args.algorithms or ["auto"])[0], steps=args.steps)
        return 0
    if args.what == "zero":
        from .bench.sharding import bench_zero
        bench_zero(world_size=(args.world_sizes or [2])[0])
        return 0
    if args.what == "pp":
        from .bench.pipeline_parallel import bench_schedules
        bench_schedules()
        return 0
    sizes, s = [], B.parse_size(args.min_bytes)
    while s <= B.parse_size(args.max_bytes):
        sizes.append(s)
        s *= args.factor
    rows = B.run_bench(args.ops, args.algorithms, args.world_sizes, sizes, iters=args.iters)
    print(B.format_table(rows))
    if args.plot:
        for op in args.ops:
            fig = B.plot_busbw(rows, op)
            path = args.plot if len(args.ops) == 1 else args.plot.replace(".png", f"-{op}.png")
            fig.savefig(path)
            print(f"wrote {path}")
    return 1 if any(r["wrong"] for r in rows) else 0


def doctor(argv=None) -> int:
    from . import doctor as D
    return D.main(argv)


def _number_or_json(text: str) -> float:
    """``1.5e9``, or a JSON file holding ``{"flop_rate": ...}``."""
    try:
        return float(text)
    except ValueError:
        import json
        with open(text) as f:
            return float(json.load(f)["flop_rate"])


def plan(argv=None) -> int:
    """``minidist plan``: every valid dp x tp x pp (+ ZeRO, recomputation) configuration, best first."""
    from . import planner as P
    from .planner import calc

    p = argparse.ArgumentParser(prog="minidist plan", description="List every valid (dp, tp, pp, "
                                "micro-batches, ZeRO, recomputation) configuration of a GPT with its "
                                "memory per device and predicted step time, best first.")
    for name, default, what in (
            ("layers", 24, "transformer blocks"), ("hidden", 2304, "hidden size (d_model)"),
            ("heads", 24, "attention heads (tp must divide them)"),
            ("vocab", 51200, "vocabulary size"), ("seq-len", 2048, "tokens per sequence"),
            ("global-batch", 512, "sequences per optimizer step, all replicas together"),
            ("devices", 32, "GPUs (or, with --this-machine, ranks)")):
        p.add_argument(f"--{name}", type=int, default=default, help=f"{what} (default {default})")
    p.add_argument("--gpu", default="A100-80GB", choices=sorted(calc.GPUS),
                   help="memory and peak FLOP/s (calc.GPUS) unless --memory / --flop-rate")
    p.add_argument("--memory", type=float, help="bytes per device (e.g. 80e9)")
    p.add_argument("--flop-rate", help="FLOP/s per device, or a JSON file with a 'flop_rate' key")
    p.add_argument("--efficiency", type=float, default=0.5, help="fraction of the GPU's peak reached")
    p.add_argument("--devices-per-node", type=int, default=8,
                   help="GPUs per node: tp stays inside a node (default 8)")
    p.add_argument("--intra", default=None, help="link inside a node: preset, alpha,beta or "
                   "the JSON of `minidist bench alpha-beta` (default nvlink3)")
    p.add_argument("--inter", default="ib-hdr", help="link between nodes (same forms)")
    p.add_argument("--this-machine", action="store_true", help="ranks are processes sharing this "
                   "machine's cores: rate x min(1, cores/ranks), one loopback link (--intra), fp32")
    p.add_argument("--zero", type=int, nargs="*", default=[0, 1, 2, 3], choices=[0, 1, 2, 3],
                   help="ZeRO stages to consider (default all)")
    p.add_argument("--recompute", nargs="*", default=["none", "full"], choices=list(P.RECOMPUTE),
                   help="activation recomputation modes to consider")
    p.add_argument("--interleave", type=int, nargs="*", default=[1],
                   help="model chunks per pipeline rank to consider (interleaved 1F1B)")
    p.add_argument("--precision", default=None, choices=sorted(P.PRECISIONS),
                   help="bytes per parameter of weights, gradients and optimizer states")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="shard LayerNorm/dropout activations over tp (Korthikanti et al. 2022)")
    p.add_argument("--layer-overhead", type=float, default=0.0, help="fixed seconds per layer "
                   "per forward (single rank; plan.calibrate_overhead fits it to one measured step)")
    p.add_argument("--fits-only", action="store_true", help="drop configurations that do not fit")
    p.add_argument("--top", type=int, default=20, help="rows to print (default 20)")
    a = p.parse_args(argv)

    def link(text):
        parts = text.split(",")
        return P.load_link(tuple(map(float, parts)) if len(parts) == 2 else text, a.devices)

    try:
        gpu = calc.GPUS[a.gpu]
        rate = gpu["peak_flops"] * a.efficiency if a.flop_rate is None else _number_or_json(a.flop_rate)
        if a.this_machine and (a.flop_rate is None or a.intra is None):
            raise ValueError("--this-machine needs the measured --flop-rate (bench flops) and "
                             "--intra loopback link (alpha,beta or the bench alpha-beta JSON)")
        model = P.ModelSpec(a.layers, a.hidden, a.heads, a.vocab, a.seq_len)
        kw = dict(zero_stages=a.zero, recompute=a.recompute, interleave=a.interleave,
                  only_fits=a.fits_only, sequence_parallel=a.sequence_parallel,
                  layer_overhead=a.layer_overhead)
        if a.precision:
            kw["precision"] = a.precision
        if a.this_machine:
            links = P.Links(link(a.intra), link(a.intra))
            preds = P.this_machine(model, a.global_batch, a.devices, rate, links.intra,
                                   memory=a.memory, **kw)
        else:
            links = P.Links(link(a.intra or "nvlink3"), link(a.inter))
            preds = P.plan(model, a.global_batch, a.devices, a.memory or gpu["memory"], rate,
                           links, a.devices_per_node, **kw)
    except (ValueError, OSError, KeyError) as e:
        print(f"minidist plan: {str(e).removeprefix('plan: ')}", file=sys.stderr)
        return 2
    n = model.params   # 146B, 6.67B, 54.4K: readable for the large models and the tiny ones
    count = next((f"{n / d:.3g}{u}" for d, u in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K"))
                  if n >= d), f"{n:.0f}")
    print(f"{count} parameters, global batch {a.global_batch} x {a.seq_len} "
          f"tokens, {a.devices} devices; {len(preds)} configurations, best first "
          f"(memory in GB per device; times in s per step; 'DP exp' = exposed DP communication)")
    print(_plan_assumptions(a, rate, links, gpu))
    print(P.format_table(preds, a.top))
    return 0


def _plan_assumptions(a, rate, links, gpu) -> str:
    """The header's second line: the FLOP rate and memory per device and the links assumed."""
    import os

    from .planner.calc import human_bytes

    def said(name, lk):  # "nvlink3 (alpha 5 µs, 300 GB/s)"
        return f"{os.path.basename(name)} (alpha {lk.alpha * 1e6:.3g} µs, {1 / lk.beta / 1e9:.3g} GB/s)"
    if a.this_machine:
        memory = human_bytes(a.memory) if a.memory else "RAM / ranks"
        return (f"assumed per rank: {rate:.3g} FLOP/s (--flop-rate) x min(1, cores / ranks), "
                f"{memory} memory; one link between all ranks: {said(a.intra, links.intra)}")
    source = ("--flop-rate" if a.flop_rate is not None else
              f"{a.efficiency:.0%} of the {a.gpu}'s peak {gpu['peak_flops']:.3g}")
    return (f"assumed per device: {rate:.3g} FLOP/s ({source}), "
            f"{human_bytes(a.memory or gpu['memory'])} memory; links: "
            f"{said(a.intra or 'nvlink3', links.intra)} inside a node of {a.devices_per_node} devices, "
            f"{said(a.inter, links.inter)} between nodes")


def matrix(argv=None) -> int:
    from .matrix import main as matrix_main
    return matrix_main(argv)


def bisect(argv=None) -> int:
    from .matrix.bisect import main as bisect_main
    return bisect_main(argv)


def site(argv=None) -> int:
    """``minidist site``: build the website (:mod:`minidist_course.site`)."""
    try:
        from . import site as S
        import myst_nb  # noqa: F401
    except ImportError as e:
        print(f"minidist site needs the site extra: pip install -e '.[site]' ({e})", file=sys.stderr)
        return 2
    return S.main(argv)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"demo": demo, "bench": bench, "doctor": doctor, "plan": plan, "matrix": matrix,
                "bisect": bisect, "site": site}
    if not argv or argv[0] not in commands:
        asked = bool(argv) and argv[0] in ("-h", "--help")
        print("usage: minidist {demo,bench,doctor,plan,matrix,bisect,site} [options]\n"
              "  demo    run every hand-built collective (and DDP/TP/PP) against torch; exit 1 if wrong\n"
              "  bench   nccl-tests-style table (algbw, busbw, ratio to torch); bench ddp | pp | zero |\n"
              "          alpha-beta (link latency/bandwidth with spreads) | flops (matmul GFLOP/s) |\n"
              "          3d (dp x tp x pp step time, tokens/s, MFU: measured vs the planner) | cp |\n"
              "          tp | pp-torch (against parallelize_module, torch.distributed.pipelining) |\n"
              "          report (every side-by-side benchmark in one table) | two-level (2 nodes x 2:\n"
              "          ring vs hierarchical, FSDP vs HSDP, DDP vs PowerSGD vs DiLoCo, TP/EP placement)\n"
              "  doctor  what this machine offers: torch, backends, devices, network, launch variables\n"
              "  plan    every valid dp x tp x pp (+ ZeRO, recompute) configuration: memory, step time\n"
              "  matrix  every pair of training-step features run against one process, or refused\n"
              "  bisect  the first tensor where one configuration leaves one process (rank, pattern)\n"
              "  site    the course as a static website, English and Chinese (needs the site extra)",
              file=sys.stdout if asked else sys.stderr)
        return 0 if asked else 2
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
