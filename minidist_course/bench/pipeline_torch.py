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
rank must do (its stages' sleeps), beside the simulator's bubble for the same schedule and costs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

__all__ = ["TORCH_SCHEDULES", "bench_pp_torch", "main"]

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
        pipeline_step(schedule, ours_mods, x, y, nn.functional.mse_loss)

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


def _rank(rank, world, names, M, t_f, t_b, steps, warmup, width):
    import torch.distributed as dist

    from .collectives import balanced_order
    torch.set_num_threads(1)
    rows = []
    for name in names:
        ours, theirs, schedule = _build(name, rank, world, M, t_f, t_b, width)
        runs = {"minidist": ours, "torch": theirs}
        times: dict = {k: [] for k in runs}
        for i in range(warmup + steps):
            for k in balanced_order(list(runs), i):
                dist.barrier()
                t0 = time.perf_counter()
                runs[k]()
                dist.barrier()
                if i >= warmup:
                    times[k].append(time.perf_counter() - t0)
        rows.append((name, schedule, times))
    return rows


def bench_pp_torch(P: int = 4, M: int = 8, schedules=tuple(TORCH_SCHEDULES), t_f: float = 0.02,
                   t_b: float = 0.04, steps: int = 5, warmup: int = 1, width: int = 16,
                   timeout: float = 600, quiet: bool = False) -> list[dict]:
    """Run on ``P`` ranks; print (unless ``quiet``) and return one row per schedule: ``schedule``,
    ``minidist_ms``, ``torch_ms`` (medians), ``ratio`` (median of per-step ratios minidist/torch),
    ``bubble_minidist``, ``bubble_torch`` (measured), ``bubble_simulated``."""
    from minidist.launch import run
    from minidist.pipeline_parallel.simulator import simulate
    out = run(_rank, P, tuple(schedules), M, t_f, t_b, steps, warmup, width, timeout=timeout)[0]
    busy = M * (t_f + t_b)
    rows = []
    for name, schedule, times in out:
        med = {k: statistics.median(v) for k, v in times.items()}
        sim = simulate(schedule, t_f / schedule.v, t_b / schedule.v)
        rows.append({"schedule": name, "minidist_ms": 1e3 * med["minidist"],
                     "torch_ms": 1e3 * med["torch"],
                     "ratio": statistics.median(a / b for a, b in zip(times["minidist"], times["torch"])),
                     "bubble_minidist": 1 - busy / med["minidist"],
                     "bubble_torch": 1 - busy / med["torch"], "bubble_simulated": sim.bubble})
    if not quiet:
        print(f"minidist bench pp-torch: P={P}, M={M}, t_f={t_f * 1e3:g} ms, t_b={t_b * 1e3:g} ms "
              f"(W half of it), median of {steps} steps, barrier to barrier")
        print(f"  {'schedule':12s} {'minidist ms':>11s} {'torch ms':>9s} {'ratio':>6s} "
              f"{'bubble ours':>11s} {'torch':>6s} {'simulated':>9s}")
        for r in rows:
            print(f"  {r['schedule']:12s} {r['minidist_ms']:11.1f} {r['torch_ms']:9.1f} "
                  f"{r['ratio']:6.2f} {r['bubble_minidist']:11.3f} {r['bubble_torch']:6.3f} "
                  f"{r['bubble_simulated']:9.3f}")
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
