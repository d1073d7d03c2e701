"""``minidist bench 3d``: measured step time of 3-D configurations against the planner's prediction.

For each (dp, tp, pp) of a world size: ``steps`` timed training steps of the tiny GPT
(:func:`minidist.hybrid.train_step`: 1F1B, the engine's flat DP average, AdamW) after ``warmup``
ones, each timed from a barrier on every rank; a step's time is its slowest rank's, and the
configuration's the median over steps (and over ``rounds`` round-robin passes). From it:
tokens/s and MFU (:mod:`.mfu`: 6·N + attention FLOPs over the measured one-thread matmul rate ×
min(ranks, cores)).

The prediction is :func:`minidist_course.planner.this_machine` (ranks share the cores, one loopback link,
no overlap) fed with this machine's numbers: the one-thread FLOP rate (``minidist bench flops``)
and the ring all-reduce's alpha and beta over all W ranks (``minidist bench alpha-beta``; the
hybrid's collectives are minidist's ring; W processes share the cores as in the 3-D run),
measured in the same run unless given. Two predictions:

* ``predicted``: FLOPs and alpha-beta only;
* ``calibrated`` (unless ``calibrate=False``): plus a per-layer dispatch overhead fitted to one
  measured **single-rank** step (:func:`minidist_course.planner.calibrate_overhead`) — a configuration
  that is not in the table, so the table's configurations stay predictions, not fits;
* ``contended`` (unless ``contention=False``): the calibrated planner plus its contention terms
  (:mod:`minidist_course.planner.machine`: each group's link measured with all groups of its size running at
  once, pipeline ranks in the bubble freeing their core, the optimizer step measured on the
  single-rank step), fed with two more measured inputs, never with the table's step times.

Reported per world size: measured/predicted per configuration, the fraction within 30%,
Spearman's rank correlation of predicted and measured step times (:func:`minidist_course.planner.spearman`)
and whether the fastest and the slowest configuration agree. Timing on a shared machine is
noisy: the load average is recorded with the results.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from minidist.launch import run
from .alpha_beta import machine_note
from .group_links import measure_group_links
from .hybrid_report import format_table, summarize
from .mfu import cpu_peak_flops, model_flops_per_step

__all__ = ["CONFIGS", "MODEL", "FORMAT", "microbatches_for", "build", "measure_config",
           "measure_group_links",
           "predict_configs",
           "bench_3d", "summarize", "format_table", "main"]

FORMAT = "minidist-bench-3d/1"
# (dp, tp, pp) per world size: the capstone's configurations
CONFIGS = {4: ((4, 1, 1), (2, 2, 1), (2, 1, 2), (1, 2, 2), (1, 4, 1), (1, 1, 4)),
           8: ((8, 1, 1), (2, 2, 2), (1, 2, 4), (4, 1, 2), (2, 4, 1), (1, 1, 8))}
MODEL = dict(vocab_size=93, block_size=16, n_layer=8, n_head=4, n_embd=32)
WITHIN = 0.30


def microbatches_for(batch: int, dp: int, want: int) -> int:
    """The largest divisor of the per-replica batch ``batch // dp`` that is <= ``want``
    (ValueError when ``dp`` does not divide ``batch``)."""
    if batch % dp:
        raise ValueError(f"bench 3d: the global batch {batch} does not split over dp={dp}")
    per = batch // dp
    return max(m for m in range(1, min(want, per) + 1) if per % m == 0)


def _gpt(model: dict):
    from minidist.models.gpt import GPTConfig
    return GPTConfig(**model)


def build(dp: int, tp: int, pp: int, model: dict = MODEL, batch: int = 16, dp_mode: str = "flat",
          seed: int = 0):
    """On every rank: ``(HybridGPT, AdamW optimizer, modules, ids, targets)`` of the bench's GPT on
    a ``ProcessGrid(dp, pp, tp)``, with a seeded global batch ``[batch, block_size]``."""
    from minidist.grid import ProcessGrid
    from minidist.hybrid import HybridGPT, make_optimizer, wrap_stages

    cfg = _gpt(model)
    net = HybridGPT(cfg, ProcessGrid(dp, pp, tp), seed=seed)
    modules = wrap_stages(net, dp_mode)
    opt = make_optimizer(net, dp_mode, torch.optim.AdamW, lr=1e-3)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=g)
    return net, opt, modules, ids, targets


def _rank(rank, world, dp, tp, pp, model, batch, M, steps, warmup, dp_mode, breakdown):
    from minidist.hybrid import train_step
    from minidist_course.diagrams.step_timeline import kind_of, record_step

    net, opt, modules, ids, targets = build(dp, tp, pp, model, batch, dp_mode)
    times = []
    for i in range(warmup + steps):
        dist.barrier()
        t0 = time.perf_counter()
        train_step(net, opt, modules, ids, targets, M, dp_mode=dp_mode)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    parts = {}
    if breakdown:   # one more step, recorded: this rank's seconds per kind
        parts = dict.fromkeys(("compute", "tp", "pp", "dp", "other", "tp_in"), 0.0)
        parts["optimizer"] = 0.0    # also inside "other"
        for e in record_step(net, opt, modules, ids, targets, M, dp_mode=dp_mode)[1]:
            parts["tp_in" if e.name.startswith("tp ") else kind_of(e)] += e.duration
            if e.name == "optimizer":
                parts["optimizer"] += e.duration
        parts["compute"] -= parts["tp_in"]     # the TP collectives run inside F/B
        parts["tp"] += parts.pop("tp_in")
    return times, parts


def measure_config(dp: int, tp: int, pp: int, model: dict = MODEL, batch: int = 16,
                   microbatches: int = 4, steps: int = 3, warmup: int = 1, dp_mode: str = "flat",
                   timeout: float = 600.0, breakdown: bool = False) -> dict:
    """Run ``warmup + steps`` steps on ``dp·tp·pp`` ranks. Returns ``{"times": [slowest rank's
    seconds per step], "median_s", "min_s", "max_s", "microbatches", "parts"}``; ``parts``
    (``breakdown``: one more step, recorded by :func:`minidist_course.diagrams.step_timeline.record_step`): per
    kind, the largest over ranks of a rank's seconds — compute (F/B without the TP collectives
    inside them), tp, pp (transport, including waiting for a stage: the bubble), dp, other."""
    if steps < 1 or warmup < 0:
        raise ValueError(f"bench 3d: steps must be >= 1 and warmup >= 0, got {steps}, {warmup}")
    M = microbatches_for(batch, dp, microbatches)
    per_rank = run(_rank, dp * tp * pp, dp, tp, pp, model, batch, M, steps, warmup, dp_mode,
                   breakdown, timeout=timeout)
    times = [max(r[0][i] for r in per_rank) for i in range(steps)]
    parts = {k: max(r[1].get(k, 0.0) for r in per_rank) for k in per_rank[0][1]}
    return dict(times=times, median_s=statistics.median(times), min_s=min(times), max_s=max(times),
                microbatches=M, parts=parts)


def predict_configs(model: dict, batch: int, world_size: int, flop_rate: float, link,
                    cores: int | None = None, layer_overhead: float = 0.0,
                    dp_mode: str = "flat", **contention) -> dict:
    """{(dp, tp, pp, M): Prediction} of :func:`minidist_course.planner.this_machine` (ZeRO-0, or ZeRO-1 as
    the hybrid runs it for ``dp_mode="zero1"``; no recomputation, v = 1). ``contention``:
    this_machine's group_links, bubble_frees_cores, optimizer_s."""
    from ..planner import ModelSpec, this_machine
    zero = 1 if dp_mode == "zero1" else 0
    preds = this_machine(ModelSpec.from_gpt_config(_gpt(model)), batch, world_size, flop_rate,
                         link, cores, layer_overhead=layer_overhead, zero_stages=(zero,),
                         recompute=("none",), zero1_all_reduce=zero == 1, **contention)
    return {(q.config.dp, q.config.tp, q.config.pp, q.config.microbatches): q for q in preds
            if q.config.v == 1 and q.config.zero == (zero if q.config.dp > 1 else 0)}


def _machine_numbers(flop_rate, link, budget_s: float, world_sizes) -> tuple[float, dict]:
    """The one-thread FLOP rate (FLOP/s) and {W: ring all-reduce Link}: given, read or measured.
    Measured: the ring all-reduce over all W ranks, so the link is what W processes sharing these
    cores see; a JSON with several world sizes gives each W its nearest fit (load_link)."""
    from ..planner import load_link
    from .flops import bench_flops, load_flops
    if flop_rate is None:
        flop_rate = bench_flops(threads=1, budget_s=budget_s).flops_per_s
    elif isinstance(flop_rate, (str, os.PathLike)):
        flop_rate = min(load_flops(flop_rate), key=lambda r: r.threads).flops_per_s
    links = {}
    for w in world_sizes:
        if link is None:
            from .alpha_beta_bench import bench_alpha_beta
            fit = bench_alpha_beta(world_size=w, algorithms=("ring",), budget_s=budget_s,
                                   n_bootstrap=200)[0]
            links[w] = load_link((fit.alpha, fit.beta))
        else:
            links[w] = load_link(link, w)
    return float(flop_rate), links


def bench_3d(world_sizes=(4, 8), configs: dict | None = None, model: dict = MODEL, batch: int = 16,
             microbatches: int = 4, steps: int = 3, warmup: int = 1, dp_mode: str = "flat",
             flop_rate=None, link=None, cores: int | None = None, calibrate: bool = True,
             budget_s: float = 10.0, progress: bool = True, timeout: float = 600.0,
             rounds: int = 1, breakdown: bool = False, contention: bool = True) -> dict:
    """Measure and predict every configuration (module docstring); returns the JSON-able result
    ``{"format", "model", "batch", "steps", "warmup", "dp_mode", "flop_rate", "link", "cores",
    "layer_overhead", "machine", "rows": [...], "summary": {W: ...}}``.

    ``flop_rate``: FLOP/s, the ``bench flops`` JSON, or None (measure, ``budget_s``); ``link``:
    (alpha, beta), a preset or the ``bench alpha-beta`` JSON (the fit nearest each W, see
    :func:`minidist_course.planner.load_link`), or None (measure the ring all-reduce at each W).
    ``configs``: {W: [(dp, tp, pp), ...]} (default
    :data:`CONFIGS`). ``rounds``: passes over all configurations (and the single-rank step), each
    adding ``steps`` times: load spikes spread over all of them. ValueError for a configuration
    whose product is not its world size. ``breakdown``: per configuration and round one more,
    recorded step, whose time per kind (:func:`measure_config`) goes to ``row["measured_parts"]``.
    ``contention`` (with ``calibrate``): a third prediction, ``contended`` — the planner's contention
    terms (:mod:`minidist_course.planner.machine`) fed with two more measured inputs: the ring all-reduce
    with all W/n groups of n ranks at once (:func:`measure_group_links`, result ``group_links``)
    (n < W; for n = W, one group, the link above) and the single-rank step's optimizer seconds (one recorded step per round, ``optimizer_s``).
    """
    from tqdm.auto import tqdm

    configs = configs or {w: CONFIGS[w] for w in world_sizes}
    for w, cs in configs.items():
        for c in cs:
            if c[0] * c[1] * c[2] != w:
                raise ValueError(f"bench 3d: (dp, tp, pp) = {c} has {c[0] * c[1] * c[2]} ranks, "
                                 f"not the world size {w}")
    cores = cores or len(os.sched_getaffinity(0))
    flops, links = _machine_numbers(flop_rate, link, budget_s, sorted(configs))
    contention = contention and calibrate
    group_links = {}   # n = W is one group: the single collective's fit (links[W]) is that link
    for w in sorted(configs) if contention else ():
        smaller = [n for n in range(2, w) if w % n == 0]
        group_links[w] = (measure_group_links(w, smaller, timeout=timeout) if smaller else {}) \
            | {w: (links[w].alpha, links[w].beta)}
    cfg = _gpt(model)
    jobs = ([(1, (1, 1, 1))] if calibrate else []) + [(w, c) for w, cs in configs.items() for c in cs]
    measured = {}
    bar = tqdm(total=rounds * len(jobs), desc="bench 3d", disable=not progress, leave=False)
    for _ in range(rounds):   # round-robin: a load spike on a shared machine hits every config
        for w, c in jobs:
            m = measure_config(*c, model, batch, microbatches, steps, warmup, dp_mode, timeout,
                               (breakdown or contention) if c == (1, 1, 1) and contention
                               else breakdown and c != (1, 1, 1))
            measured.setdefault(c, dict(m, times=[], parts=[]))["times"] += m["times"]
            measured[c]["parts"].append(m["parts"])
            bar.update()
    bar.close()
    overhead = opt_s = overhead_c = 0.0
    if calibrate:
        from ..planner import ModelSpec, calibrate_overhead
        single = measured.pop((1, 1, 1))
        overhead = calibrate_overhead(ModelSpec.from_gpt_config(cfg), batch,
                                      statistics.median(single["times"]), flops, single["microbatches"])
        if contention:
            opt_s = statistics.median(p["optimizer"] for p in single["parts"])
            overhead_c = calibrate_overhead(ModelSpec.from_gpt_config(cfg), batch,
                                            statistics.median(single["times"]), flops,
                                            single["microbatches"], optimizer_s=opt_s)
    step_flops = model_flops_per_step(cfg, batch)
    rows = []
    for w, (dp, tp, pp) in jobs[int(calibrate):]:
        m, times = measured[(dp, tp, pp)], measured[(dp, tp, pp)]["times"]
        step_s, key = statistics.median(times), (dp, tp, pp, m["microbatches"])
        row = dict(world_size=w, dp=dp, tp=tp, pp=pp, microbatches=m["microbatches"],
                   measured_s=step_s, min_s=min(times), max_s=max(times), times=times,
                   tokens_per_s=batch * cfg.block_size / step_s,
                   mfu=step_flops / step_s / cpu_peak_flops(flops, w, cores))
        if breakdown:   # the median over rounds, per kind
            row["measured_parts"] = {k: statistics.median(p.get(k, 0.0) for p in m["parts"])
                                     for k in m["parts"][0]}
        kinds = [("predicted", 0.0, {}), ("calibrated", overhead, {})][:1 + calibrate]
        if contention:
            kinds.append(("contended", overhead_c, dict(group_links=group_links[w],
                                                        bubble_frees_cores=True, optimizer_s=opt_s)))
        for name, ovh, extra in kinds:
            q = predict_configs(model, batch, w, flops, links[w], cores, ovh, dp_mode, **extra)[key]
            ratio = step_s / q.step_s
            row[name] = dict(step_s=q.step_s, ratio=ratio, within=abs(ratio - 1) <= WITHIN,
                             parts={k: q.time.get(k, 0.0) for k in
                                    ("compute", "bubble", "tp", "pp", "dp", "optimizer")})
        rows.append(row)
    return dict(format=FORMAT, model=dict(model), batch=batch, steps=steps, warmup=warmup,
                rounds=rounds, dp_mode=dp_mode, flop_rate=flops,
                link={w: dict(alpha=k.alpha, beta=k.beta) for w, k in links.items()},
                cores=cores, layer_overhead=overhead, step_flops=step_flops,
                group_links={w: {n: dict(alpha=a, beta=b) for n, (a, b) in g.items()}
                             for w, g in group_links.items()},
                optimizer_s=opt_s, contended_layer_overhead=overhead_c,
                machine=machine_note("minidist bench 3d"), rows=rows, summary=summarize(rows))


def _number_or_file(text: str):
    return float(text) if text.replace(".", "", 1).replace("e", "", 1).isdigit() else text


def _link_arg(text: str):
    parts = text.split(",")
    return (float(parts[0]), float(parts[1])) if len(parts) == 2 else text


def main(argv=None) -> int:
    """``minidist bench 3d [--world-sizes 4 8] [--configs 2,2,1 ...] [--steps N] [--json FILE]``"""
    p = argparse.ArgumentParser(prog="minidist bench 3d", description="Measured step time, tokens/s "
                                "and MFU of (dp, tp, pp) configurations of the tiny GPT against "
                                "minidist plan's prediction with this machine's FLOP rate and link.")
    p.add_argument("--world-sizes", nargs="+", type=int, default=[4, 8], choices=sorted(CONFIGS))
    p.add_argument("--configs", nargs="+", metavar="DP,TP,PP",
                   help="instead of the capstone's configurations (grouped by their product)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per configuration (median)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=1, help="passes over the configurations")
    p.add_argument("--breakdown", action="store_true", help="also record one step per "
                   "configuration: measured compute / TP / PP / DP time beside the prediction's")
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    p.add_argument("--microbatches", type=int, default=4,
                   help="at most this many (a divisor of the per-replica batch)")
    p.add_argument("--dp-mode", default="flat", choices=["flat", "bucketed", "zero1"])
    for k, v in MODEL.items():
        p.add_argument(f"--{k.replace('_', '-')}", type=int, default=v)
    p.add_argument("--flop-rate", type=_number_or_file,
                   help="FLOP/s of one thread, or the JSON of `minidist bench flops` (default: measure)")
    p.add_argument("--link", type=_link_arg, help="alpha,beta (s, s/byte), a preset, or the JSON "
                   "of `minidist bench alpha-beta` (nearest W; default: measure the ring at each W)")
    p.add_argument("--budget-s", type=float, default=10.0, help="seconds to measure each of them")
    p.add_argument("--cores", type=int, default=None)
    p.add_argument("--no-calibrate", action="store_true",
                   help="skip the single-rank step that calibrates the per-layer overhead")
    p.add_argument("--no-contention", action="store_true", help="skip the contended prediction "
                   "(concurrent-group links, bubble frees cores, optimizer step)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per configuration")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    configs = {}
    for text in args.configs or []:
        c = tuple(int(x) for x in text.split(",") if x.isdigit())
        if len(c) != 3 or min(c) < 1 or len(text.split(",")) != 3:
            p.error(f"--configs: expected DP,TP,PP (positive integers), got {text!r}")
        configs.setdefault(c[0] * c[1] * c[2], []).append(c)
    model = {k: getattr(args, k) for k in MODEL}
    result = bench_3d(args.world_sizes, configs or None, model, args.batch, args.microbatches,
                      args.steps, args.warmup, args.dp_mode, args.flop_rate, args.link, args.cores,
                      not args.no_calibrate, args.budget_s, not args.no_progress, args.timeout,
                      args.rounds, args.breakdown, not args.no_contention)
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=list)
        print(f"wrote {args.json}")
    return 0
