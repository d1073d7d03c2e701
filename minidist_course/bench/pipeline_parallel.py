"""Measure a real pipeline's bubble against the simulator, and its activation memory, per schedule.

On 2 shared CPU cores, 4 ranks computing at once slow each other down, so measured compute times
would say more about the machine than about the schedule. Each stage here is a small Linear plus
a :class:`FixedCost` layer that *sleeps* ``t_f`` in forward and ``t_b`` in backward: a stage's
duration is then fixed and independent of what the other ranks do, the way it is when every stage
has its own GPU. The real forward/backward/communication of the engine still runs around it.
Its backward is two sleeps: ``t_b - t_w`` on the input path (op B) and ``t_w`` on a branch to a
parameter (op W), so a split backward (zero-bubble schedules) costs what the simulator assumes.

``bench_bubble`` measures, per rank, the compute (F, B) intervals of the engine's timeline and
reports ``bubble = 1 - Σ busy / (P · span)`` (``timeline.bubble_fraction``) next to the
simulator's prediction for the same schedule and costs; ``bench_schedules`` does it for every
schedule (``minidist bench pp``), with the span's error and where the time goes on each
timeline's critical path (:mod:`.pipeline_critical_path`): a bubble ``b`` moves by ``(1-b)/b``
times the span's relative error, 11x for ZB-V's 0.08 and 2.5x for 1F1B's 0.28, so a small bubble's
relative error says more about a few milliseconds of messages than about the schedule.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from minidist.launch import run
from minidist.pipeline_parallel.engine import local_stages, pipeline_step
from minidist.pipeline_parallel.catalog import make_schedule
from minidist.pipeline_parallel.simulator import bubble_formula, simulate
from minidist.trace import Timeline, align, bubble_fraction

from .pipeline_critical_path import critical_path

__all__ = ["FixedCost", "bench_bubble", "bench_schedules", "activation_memory", "make_model", "align",
           "measured_costs"]


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, t_f, t_b):
        time.sleep(t_f)
        ctx.t_b = t_b
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.t_b)
        return grad, None, None


class FixedCost(nn.Module):
    """Identity whose forward takes ``t_f`` seconds and backward ``t_b`` (a stand-in for a big
    layer): ``t_b - t_w`` of it towards the input, ``t_w`` towards its (zero) parameter ``w``."""

    def __init__(self, t_f: float, t_b: float, t_w: float | None = None):
        super().__init__()
        self.t_f, self.t_b = t_f, t_b
        self.t_w = t_b / 2 if t_w is None else t_w
        self.w = nn.Parameter(torch.zeros(()))

    def forward(self, x):
        return _Sleep.apply(x, self.t_f, self.t_b - self.t_w) + _Sleep.apply(self.w, 0.0, self.t_w)


def make_model(n_stages: int, width: int = 16, t_f: float = 0.0, t_b: float = 0.0,
               layers_per_stage: int = 2, seed: int = 0, t_w: float | None = None) -> nn.Sequential:
    """``n_stages`` blocks of [Linear, Tanh] x ``layers_per_stage`` (+ FixedCost if t_f or t_b)."""
    torch.manual_seed(seed)
    layers = []
    for _ in range(n_stages):
        block = [m for _ in range(layers_per_stage) for m in (nn.Linear(width, width), nn.Tanh())]
        if t_f or t_b:
            block.append(FixedCost(t_f, t_b, t_w))
        layers.append(nn.Sequential(*block))
    return nn.Sequential(*layers)


def _worker(rank, world, name, M, v, t_f, t_b, steps, width, batch, t_w=None):
    schedule = make_schedule(name, world, M, v)
    model = make_model(schedule.n_stages, width, t_f / schedule.v, t_b / schedule.v,
                       t_w=None if t_w is None else t_w / schedule.v)
    mods = local_stages(list(model), schedule, rank)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)
    out = []
    for _ in range(steps):
        for m in mods.values():
            m.zero_grad()
        tl = Timeline()   # the transport's spans: send, recv, send wait
        dist.barrier()    # every rank starts the step together
        with tl.observe():
            res = pipeline_step(schedule, mods, x, y, nn.functional.mse_loss)
        shift = tl.origin - res.t0   # onto the engine's clock
        comm = [e._replace(start=e.start + shift, end=e.end + shift) for e in tl.events]
        out.append((sorted(res.events + comm, key=lambda e: e.start), res.peak_inflight,
                    res.peak_activation_bytes, res.loss, res.t0))
    return out


def measured_costs(events, schedule) -> dict:
    """From a real timeline: mean forward and backward time per rank-stage (``t_f``, ``t_b`` in the
    simulator's units: all ``v`` chunks of a rank; for a split backward ``t_b`` is B + W and
    ``t_w`` the W part, else ``t_w`` is None), the same per stage for one op (``stage_t_f``,
    ``stage_t_b``, ``stage_t_w``: the simulator's per-stage costs) and ``t_comm``, the median delay from the end of
    an op to the start of the op that needed its output, on another rank that was already waiting
    for it (so the delay is message latency, not queueing); ``t_gap``, the mean idle between two
    ops of a rank whose input was already there (a mean, not a median: a chain's time is a sum,
    and its expectation counts the few long stalls a median hides)."""
    compute = [e for e in events if e.kind in ("F", "B", "W")]
    end = {(e.kind, e.mb, e.stage): e.end for e in compute}
    recvs = sorted((e for e in events if e.kind == "recv"), key=lambda e: e.start)
    last = schedule.n_stages - 1
    lat = []
    for e in compute:
        if e.kind == "F" and e.stage > 0:
            dep = ("F", e.mb, e.stage - 1)
        elif e.kind == "B" and e.stage < last:
            dep = ("B", e.mb, e.stage + 1)
        else:
            continue
        if schedule.owner(dep[2]) == e.rank:
            continue
        mine = [r for r in recvs if r.rank == e.rank and r.end <= e.start + 1e-9]
        if mine and mine[-1].start <= end[dep]:  # the receiver was already waiting
            lat.append(e.start - end[dep])
    v = schedule.v
    split = {(r, mb, s) for r in range(schedule.P) for mb, s in schedule.split(r)}
    f = [e.duration for e in compute if e.kind == "F"]
    b = [e.duration for e in compute if e.kind == "B" and (e.rank, e.mb, e.stage) not in split]
    bi = [e.duration for e in compute if e.kind == "B" and (e.rank, e.mb, e.stage) in split]
    w = [e.duration for e in compute if e.kind == "W"]
    t_w = statistics.fmean(w) * v if w else None
    t_b = statistics.fmean(b) * v if b else statistics.fmean(bi) * v + t_w

    def by_stage(kind):  # {stage: mean duration of its ``kind`` ops}
        d = {s: [e.duration for e in compute if e.stage == s and e.kind == kind]
             for s in range(schedule.n_stages)}
        return {s: statistics.fmean(x) if x else 0.0 for s, x in d.items()}

    # a stage's whole backward: B, plus W when split (B and W counted once per micro-batch)
    per_b = {s: sum(e.duration for e in compute if e.stage == s and e.kind in ("B", "W"))
             / max(1, sum(1 for e in compute if e.stage == s and e.kind == "B"))
             for s in range(schedule.n_stages)}
    gaps = []  # idle between two ops of a rank although the second's input was already there
    for r in range(schedule.P):
        mine = sorted((e for e in compute if e.rank == r), key=lambda e: e.start)
        for a, e in zip(mine, mine[1:]):
            dep = _dep_end(e, end, schedule)
            if dep is None or dep <= a.end:
                gaps.append(e.start - a.end)
    return dict(t_f=statistics.fmean(f) * v, t_b=t_b, t_w=t_w,
                t_gap=max(0.0, statistics.fmean(gaps)) if gaps else 0.0,
                stage_t_f=by_stage("F"), stage_t_b=per_b,
                # W is part of its backward: a mean over fewer (split) ops may exceed it by noise
                stage_t_w={s: min(t, per_b[s]) for s, t in by_stage("W").items()} if w else None,
                t_comm=max(0.0, statistics.median(lat)) if lat else 0.0)


def _dep_end(e, end, schedule):
    """When the op that ``e`` waits for ended (None: it waits for nothing, or for its own B)."""
    last = schedule.n_stages - 1
    if e.kind == "F":
        return end.get(("F", e.mb, e.stage - 1)) if e.stage > 0 else None
    if e.kind == "B":
        return end.get(("F", e.mb, e.stage) if e.stage == last else ("B", e.mb, e.stage + 1))
    return None


def bench_bubble(P: int = 4, M: int = 8, schedule: str = "1f1b", v: int = 2, t_f: float = 0.04,
                 t_b: float = 0.08, steps: int = 5, width: int = 16, batch: int | None = None,
                 verbose: bool = True, timeout: float = 120.0, t_w: float | None = None) -> dict:
    """Run ``steps`` pipeline steps on ``P`` ranks and compare the measured bubble with the simulator.

    ``t_f``/``t_b``: seconds of one micro-batch's forward/backward through one rank's stage(s);
    ``t_w``: the weight-gradient part of ``t_b`` (default half), run as W by zero-bubble schedules.
    Returns a dict: ``measured`` (median over steps), ``measured_steps``, ``predicted``
    (simulator, same costs, no communication time), ``rel_error`` = |measured-predicted|/predicted,
    ``events`` (the median step's timeline, all ranks), ``ok`` (rel_error <= 10%), ``schedule``
    and the arguments.
    """
    batch = batch or 4 * M
    sched = make_schedule(schedule, P, M, v)
    results = run(_worker, P, schedule, M, v, t_f, t_b, steps + 1, width, batch, t_w, timeout=timeout)
    per_step = []
    for step in range(1, steps + 1):  # step 0 warms up (first messages set up gloo's pairs)
        events = align([results[r][step][0] for r in range(P)], [results[r][step][4] for r in range(P)])
        costs = measured_costs(events, sched)
        predicted = simulate(sched, costs["stage_t_f"], costs["stage_t_b"], costs["t_comm"],
                             costs["stage_t_w"], costs["t_gap"]).bubble
        per_step.append((bubble_fraction(events, P), predicted, costs, events))
    measured, predicted, costs, events = sorted(per_step, key=lambda x: x[0])[(steps - 1) // 2]
    ideal = simulate(sched, t_f, t_b, t_w=t_w).bubble
    sim = simulate(sched, costs["stage_t_f"], costs["stage_t_b"], costs["t_comm"],
                   costs["stage_t_w"], costs["t_gap"])
    path = {"measured": critical_path(events, sched.n_stages),
            "simulated": critical_path(sim.events, sched.n_stages)}
    out = dict(P=P, M=M, schedule=sched.name, t_f=t_f, t_b=t_b, measured=measured,
               measured_steps=[x[0] for x in per_step], predicted=predicted, predicted_ideal=ideal,
               costs=costs, rel_error=abs(measured - predicted) / predicted if predicted else measured,
               events=events, critical_path=path,
               span_error=path["measured"].span / path["simulated"].span - 1)
    out["ok"] = out["rel_error"] <= 0.10
    w_part = "" if costs["t_w"] is None else f", W {costs['t_w'] * 1e3:.1f} ms of t_b"
    if verbose:
        print(f"pipeline bubble, {sched.name}, P={P}, M={M}, t_f={t_f * 1e3:g} ms, "
              f"t_b={t_b * 1e3:g} ms (median of {steps} steps: "
              f"{', '.join(f'{x[0]:.4f}' for x in per_step)})\n"
              f"  measured {measured:.4f}; simulator with the measured costs (t_f "
              f"{costs['t_f'] * 1e3:.1f} ms, t_b {costs['t_b'] * 1e3:.1f} ms, message latency "
              f"{costs['t_comm'] * 1e3:.2f} ms{w_part}, between ops {costs['t_gap'] * 1e3:.2f} ms) "
              f"{predicted:.4f}: relative error "
              f"{out['rel_error']:.1%} ({'✓' if out['ok'] else '✗'} goal: within 10%)\n  simulator without communication time {ideal:.4f} "
              f"(1F1B-style formula (P-1)/(vM+P-1) = {bubble_formula(P, M, sched.v):.4f})\n"
              f"  where the time goes (critical path), measured:  {path['measured'].line()}\n"
              f"                                      simulated: {path['simulated'].line()}\n"
              f"  span {out['span_error']:+.2%} against the simulator: a bubble b moves by "
              f"(1-b)/b times the span's relative error, {(1 - measured) / measured:.1f}x here")
    return out


def bench_schedules(P: int = 4, M: int = 8,
                    schedules=("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipe-v"),
                    t_f: float = 0.04, t_b: float = 0.08, t_w: float | None = None, steps: int = 3,
                    verbose: bool = True, timeout: float = 120.0) -> dict:
    """:func:`bench_bubble` for every schedule (same costs): ``{name: result}``, and a table of
    measured vs simulated bubble when ``verbose``."""
    out = {name: bench_bubble(P, M, name, 2, t_f, t_b, steps, verbose=False, timeout=timeout, t_w=t_w)
           for name in schedules}
    if verbose:
        print(f"pipeline bubble per schedule, P={P}, M={M}, t_f={t_f * 1e3:g} ms, t_b={t_b * 1e3:g} ms "
              f"(W {'half' if t_w is None else f'{t_w * 1e3:g} ms'} of it), median of {steps} steps")
        print(f"  {'schedule':16s} {'measured':>9s} {'simulated':>9s} {'rel.err':>8s} {'no-comm sim':>11s}"
              f"  {'span err':>8s}  critical path: messages / gaps (ms), measured | simulated")
        for r in out.values():
            m, s = r["critical_path"]["measured"], r["critical_path"]["simulated"]
            print(f"  {r['schedule']:16s} {r['measured']:9.4f} {r['predicted']:9.4f} "
                  f"{r['rel_error']:8.1%} {r['predicted_ideal']:11.4f}  {'✓' if r['ok'] else '✗'} "
                  f"{r['span_error']:+7.2%}  {m.messages * 1e3:5.1f} / {m.gaps * 1e3:5.1f} | "
                  f"{s.messages * 1e3:5.1f} / {s.gaps * 1e3:5.1f}")
    return out


def activation_memory(P: int = 4, M: int = 8, width: int = 64, batch: int | None = None,
                      schedules=("gpipe", "1f1b"), verbose: bool = True, timeout: float = 60.0) -> dict:
    """Peak saved-activation bytes and micro-batches in flight per stage, measured, per schedule.

    Returns ``{schedule: {"bytes": {stage: peak bytes}, "inflight": {stage: peak micro-batches},
    "predicted_inflight": {stage: simulator's peak}}}``.
    """
    batch = batch or 4 * M
    out = {}
    for name in schedules:
        res = run(_worker, P, name, M, 2, 0.0, 0.0, 1, width, batch, timeout=timeout)
        bytes_, inflight = {}, {}
        for r in range(P):
            _, pin, pbytes, _, _ = res[r][0]
            bytes_.update(pbytes)
            inflight.update(pin)
        sched = make_schedule(name, P, M)
        out[name] = {"bytes": dict(sorted(bytes_.items())), "inflight": dict(sorted(inflight.items())),
                     "predicted_inflight": simulate(sched).peak_inflight}
    if verbose:
        print(f"peak saved activations per stage (P={P}, M={M}, batch {batch}, width {width}, fp32):")
        for name, d in out.items():
            cells = ", ".join(f"s{s}: {d['inflight'][s]} mb / {d['bytes'][s] / 1024:.1f} KiB"
                              for s in d["bytes"])
            print(f"  {name:6s} {cells}")
    return out


if __name__ == "__main__":
    bench_schedules()
    activation_memory()
