"""``minidist bench pp-torch`` — minidist's pipeline schedules against torch.distributed.pipelining's,
on the same stage split and micro-batches, measured in the same run.

The model is :func:`.pipeline_parallel.make_model`'s: each stage a small Linear stack plus a
:class:`~.pipeline_parallel.FixedCost` that sleeps ``t_f`` forward and ``t_b`` backward (half of
it on the weight branch, op W), so every stage costs the same fixed time whatever else the 2
shared cores do — as if each rank had its own GPU — and the engines, their messages and their
bookkeeping are what differs. Each schedule runs twice per step, minidist's
(:func:`minidist.pipeline_parallel.engine.pipeline_step`) and torch's (``PipelineStage`` plus
``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``, ``ScheduleInterleavedZeroBubble``
— torch's ZB1P, ZB-H1 with one stage per rank —, ``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``),
in a balanced order; a step is timed from a barrier to a barrier (the whole pipeline).

Per schedule: the median step time of each and their ratio (median of per-step ratios), and each
one's **measured bubble** ``1 − busy / step``, where ``busy = M·(t_f + t_b)`` is the compute every
rank must do (its stages' sleeps), beside two predictions of the simulator for the same schedule:
``bubble_simulated`` with the nominal costs and no communication, and ``bubble_predicted``, the
**communication-aware** one: the op times and the per-op overhead measured on minidist's timeline
(:func:`.pipeline_parallel.measured_costs`), and every message between ranks costing
``alpha + bytes · beta`` of the link it crosses (:func:`~minidist.pipeline_parallel.simulator.link_costs`),
alpha and beta fitted to a ping-pong in the same run (:func:`.kernel_links.fit_link`, relative
errors; one link class on one machine) whose sides pause as long as a forward chunk before each
send (a message that wakes an idle process costs more than one between two that spin: on 2 shared
cores 352 B took ~60 us without a pause and 300-450 us with 10 ms), and the barrier that ends the
step, gloo's dissemination barrier: ``ceil(log2 P)`` rounds of alpha. ``idle_ratio_*``: an
engine's idle time over the predicted idle time, each timed step against the prediction from its
own op times, the median (goal: ≤ 1.10, the other benchmarks' goal).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
from torch import nn

__all__ = ["TORCH_SCHEDULES", "bench_pp_torch", "link_fit", "main"]

TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
                   "interleaved": "ScheduleInterleaved1F1B",
                   "zb-h1": "ScheduleInterleavedZeroBubble", "zb-v": "ScheduleZBVZeroBubble",
                   "dualpipe-v": "ScheduleDualPipeV"}


def _build(name, rank, world, M, t_f, t_b, width):
    """``(ours, theirs)``: two callables that run one pipeline step on the same split."""
    import torch.distributed.pipelining as pipelining

    from minidist.pipeline_parallel.catalog import make_schedule
    from minidist.pipeline_parallel.engine import pipeline_step
    from .pipeline_parallel import make_model
    schedule = make_schedule(name, world, M, 2)
    mine = schedule.stages_of(rank)
    batch = 4 * M
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)
    ours_model = make_model(schedule.n_stages, width, t_f / schedule.v, t_b / schedule.v)
    ours_mods = {s: list(ours_model)[s] for s in mine}

    def ours():
        for m in ours_mods.values():
            m.zero_grad()
        return pipeline_step(schedule, ours_mods, x, y, nn.functional.mse_loss)

    theirs_model = make_model(schedule.n_stages, width, t_f / schedule.v, t_b / schedule.v)
    stages = [pipelining.PipelineStage(list(theirs_model)[s], s, schedule.n_stages,
                                       torch.device("cpu")) for s in mine]
    cls = getattr(pipelining, TORCH_SCHEDULES[name])
    sched = cls(stages if len(stages) > 1 or name not in ("gpipe", "1f1b") else stages[0],
                n_microbatches=M, loss_fn=nn.functional.mse_loss)
    last = schedule.n_stages - 1 in mine

    def theirs():
        theirs_model.zero_grad()
        sched.step(*((x,) if 0 in mine else ()), **(dict(target=y, losses=[]) if last else {}))

    return ours, theirs, schedule


# the ping-pong's sizes beside the pipeline message's own (the alpha-beta fit): up to 4 MiB, whose
# time grows with its size well beyond the noise of the small ones; the fit weighs each size's
# relative error, so alpha is what a message as small as the pipeline's costs
PING_BYTES = (1 << 14, 1 << 20, 1 << 22)


def wire_bytes(width: int) -> int:
    """Bytes of one pipeline message of the benchmark: a micro-batch's activation (or gradient),
    4 rows of ``width`` fp32, inline behind the transport's header (gloo)."""
    from minidist.pipeline_parallel.transport import HEADER_LEN
    return 8 * HEADER_LEN + 4 * width * 4


def _rank(rank, world, names, M, t_f, t_b, steps, warmup, width):
    import torch.distributed as dist

    from .collectives import balanced_order
    from .kernel_links import pingpong
    torch.set_num_threads(1)
    rows = []
    for name in names:
        ours, theirs, schedule = _build(name, rank, world, M, t_f, t_b, width)
        runs = {"minidist": ours, "torch": theirs}
        times: dict = {k: [] for k in runs}
        timelines = []   # minidist's (events, t0) per timed step: the measured costs
        for i in range(warmup + steps):
            for k in balanced_order(list(runs), i):
                dist.barrier()
                t0 = time.perf_counter()
                res = runs[k]()
                dist.barrier()
                if i >= warmup:
                    times[k].append(time.perf_counter() - t0)
                    if k == "minidist":
                        timelines.append((res.events, res.t0))
        rows.append((name, schedule, times, timelines))
    ping = {}   # rank 0 <-> 1, one-way seconds per size: this run's alpha and beta
    for nbytes in (wire_bytes(width), *PING_BYTES):
        dist.barrier()
        if rank < 2:   # paused as long as a forward chunk, as a stage's messages are
            ping[nbytes] = pingpong(1 - rank, nbytes, 20, rank == 0, pause=t_f / 2)
    return rows, ping


def link_fit(ping: dict) -> tuple[float, float]:
    """``(alpha s, bandwidth B/s)`` of a ping-pong ``{bytes: one-way s}``
    (:func:`.kernel_links.fit_link`, relative errors: alpha follows the small messages); on a
    machine so loaded that the times do not grow with the size, alpha is the fastest time and the
    bandwidth unlimited (beta 0)."""
    from .kernel_links import fit_link
    try:
        return fit_link(ping, relative=True)
    except ValueError:
        return min(ping.values()), float("inf")


def bench_pp_torch(P: int = 4, M: int = 8, schedules=tuple(TORCH_SCHEDULES), t_f: float = 0.02,
                   t_b: float = 0.04, steps: int = 5, warmup: int = 1, width: int = 16,
                   timeout: float = 600, quiet: bool = False) -> list[dict]:
    """Run on ``P`` ranks; print (unless ``quiet``) and return one row per schedule: ``schedule``,
    ``minidist_ms``, ``torch_ms`` (medians), ``ratio`` (median of per-step ratios minidist/torch),
    ``bubble_minidist``, ``bubble_torch`` (measured), ``bubble_simulated`` (nominal costs, no
    communication), ``bubble_predicted`` (communication-aware), ``idle_ratio_minidist`` and
    ``idle_ratio_torch`` (measured idle / predicted idle), ``alpha_s``, ``beta_s_per_byte``,
    ``message_bytes``, ``t_gap_s`` and ``barrier_s`` (what the prediction used; on a machine so loaded that the
    ping-pong's times do not grow with the size, alpha is its fastest time and beta 0)."""
    from minidist.comm.topology import Link, Topology
    from minidist.launch import run
    from minidist.pipeline_parallel.simulator import link_costs, simulate
    from minidist.trace import align

    from .pipeline_parallel import measured_costs
    per_rank = run(_rank, P, tuple(schedules), M, t_f, t_b, steps, warmup, width, timeout=timeout)
    alpha, bandwidth = link_fit(per_rank[0][1])
    links = Topology(1, P, intra=Link(alpha, bandwidth))   # one machine: one link class
    message = wire_bytes(width)
    busy = M * (t_f + t_b)
    # the step ends at a barrier: gloo's is a dissemination barrier, ceil(log2 P) rounds of empty
    # messages (Hensgen, Finkel and Manber 1988; gloo/barrier.cc)
    barrier = math.ceil(math.log2(P)) * alpha
    rows = []
    for i, (name, schedule, times, _) in enumerate(per_rank[0][0]):
        med = {k: statistics.median(v) for k, v in times.items()}
        sim = simulate(schedule, t_f / schedule.v, t_b / schedule.v)
        spans, gaps = [], []   # each timed step's predicted span and per-op overhead
        for step in range(len(times["minidist"])):
            c = measured_costs(align([per_rank[r][0][i][3][step][0] for r in range(P)],
                                     [per_rank[r][0][i][3][step][1] for r in range(P)]), schedule)
            spans.append(simulate(schedule, c["stage_t_f"], c["stage_t_b"],
                                  link_costs(links, message), c["stage_t_w"], c["t_gap"],
                                  t_sync=barrier).makespan)
            gaps.append(c["t_gap"])
        predicted = statistics.median(spans)
        rows.append({"schedule": name, "minidist_ms": 1e3 * med["minidist"],
                     "torch_ms": 1e3 * med["torch"],
                     "ratio": statistics.median(a / b for a, b in zip(times["minidist"], times["torch"])),
                     "bubble_minidist": 1 - busy / med["minidist"],
                     "bubble_torch": 1 - busy / med["torch"], "bubble_simulated": sim.bubble,
                     "bubble_predicted": 1 - busy / predicted,
                     # each step against its own prediction (that step's op times), then the median
                     **{f"idle_ratio_{k}": statistics.median(
                         (t - busy) / (span - busy) for t, span in zip(times[k], spans))
                        for k in ("minidist", "torch")},
                     "alpha_s": alpha, "beta_s_per_byte": 1 / bandwidth, "message_bytes": message,
                     "barrier_s": barrier,
                     "t_gap_s": statistics.median(gaps)})
    if not quiet:
        print(f"minidist bench pp-torch: P={P}, M={M}, t_f={t_f * 1e3:g} ms, t_b={t_b * 1e3:g} ms "
              f"(W half of it), median of {steps} steps, barrier to barrier")
        print(f"  {'schedule':12s} {'minidist ms':>11s} {'torch ms':>9s} {'ratio':>6s} "
              f"{'bubble ours':>11s} {'torch':>6s} {'predicted':>9s} {'no comm':>7s} "
              f"{'idle/predicted ours':>19s} {'torch':>6s}")
        for r in rows:
            print(f"  {r['schedule']:12s} {r['minidist_ms']:11.1f} {r['torch_ms']:9.1f} "
                  f"{r['ratio']:6.2f} {r['bubble_minidist']:11.3f} {r['bubble_torch']:6.3f} "
                  f"{r['bubble_predicted']:9.3f} {r['bubble_simulated']:7.3f} "
                  f"{r['idle_ratio_minidist']:19.2f} {r['idle_ratio_torch']:6.2f}")
        r = rows[0]
        print(f"  predicted: the simulator with minidist's measured op times and per-op overhead "
              f"({r['t_gap_s'] * 1e3:.2f} ms), each message {r['message_bytes']} B at alpha "
              f"{r['alpha_s'] * 1e6:.0f} us + beta {r['beta_s_per_byte'] * 1e9:.2f} ns/B (a "
              f"ping-pong in this run, each side pausing {t_f / 2 * 1e3:g} ms before it sends), "
              f"the closing barrier {r['barrier_s'] * 1e3:.2f} ms; idle/predicted (each step "
              f"against its own prediction, median) goal <= 1.10")
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="minidist bench pp-torch", description=__doc__.split("\n\n")[0])
    p.add_argument("--P", type=int, default=4)
    p.add_argument("--M", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--schedules", nargs="*", default=list(TORCH_SCHEDULES),
                   choices=list(TORCH_SCHEDULES))
    a = p.parse_args(argv)
    bench_pp_torch(a.P, a.M, tuple(a.schedules), steps=a.steps)
    return 0
