"""The PP section of ``minidist demo``: every schedule against one process, DP x PP, the simulator.

``demo_rows()`` returns rows ``{"section": "PP", "check", "world_size", "max_error", "ok",
"detail"}``; it takes a few seconds (two launches of 4 ranks).
"""

from __future__ import annotations

import torch
from torch import nn

from minidist.launch import run
from minidist.hybrid.dp_pipeline import dp_pipeline_step
from minidist.pipeline_parallel.engine import local_stages, pipeline_step
from minidist.pipeline_parallel.catalog import make_schedule
from minidist.pipeline_parallel.simulator import PipelineDeadlock, bubble_formula, simulate
from minidist.pipeline_parallel.schedules import Op, Schedule

__all__ = ["demo_rows"]

_N, _WIDTH = 10, 8
_CASES = [("gpipe", 3), ("1f1b", 3), ("1f1b", 8), ("interleaved", 4)]


def _model(n_stages: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(_WIDTH, _WIDTH), nn.Tanh())
                           for _ in range(n_stages)])


def _batch(n: int = _N):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, _WIDTH, generator=g), torch.randn(n, _WIDTH, generator=g)


def _reference(n_stages: int, x, y):
    model = _model(n_stages)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    return loss.item(), [p.grad for p in model.parameters()]


def _grads(mods, n_stages):
    """{parameter index in the full model: grad} for this rank's stages."""
    per_stage = 2  # weight, bias of one Linear
    return {s * per_stage + i: p.grad.clone() for s, m in mods.items()
            for i, p in enumerate(m.parameters())}


def _pp_rank(rank, world, cases):
    out = []
    for name, M in cases:
        sched = make_schedule(name, world, M, v=2)
        mods = local_stages(list(_model(sched.n_stages)), sched, rank)
        x, y = _batch()
        res = pipeline_step(sched, mods, x, y, nn.functional.mse_loss)
        out.append((res.loss, _grads(mods, sched.n_stages), res.peak_inflight))
    return out


def _dp_pp_rank(rank, world):
    from minidist.grid import ProcessGrid
    grid = ProcessGrid(dp=2, pp=2)
    sched = make_schedule("1f1b", 2, 3)
    mods = local_stages(list(_model(2)), sched, grid.pp_rank)
    x, y = _batch(12)
    x, y = x.tensor_split(2)[grid.dp_rank], y.tensor_split(2)[grid.dp_rank]
    dp_pipeline_step(sched, mods, x, y, nn.functional.mse_loss, grid.pp_group, grid.dp_group)
    return _grads(mods, 2)


def _max_error(grads: dict, ref: list) -> float:
    return max((grads[i] - ref[i]).abs().max().item() for i in range(len(ref)))


def demo_rows() -> list[dict]:
    rows = []
    P = 4
    results = run(_pp_rank, P, _CASES, timeout=60)
    for k, (name, M) in enumerate(_CASES):
        n_stages = P * (2 if name == "interleaved" else 1)
        ref_loss, ref = _reference(n_stages, *_batch())
        grads = {i: g for r in results for i, g in r[k][1].items()}
        loss = next(r[k][0] for r in results if r[k][0] is not None)
        err = max(_max_error(grads, ref), abs(loss - ref_loss))
        inflight = {s: v for r in results for s, v in r[k][2].items()}
        rows.append(dict(section="PP", check=f"{name} P={P} M={M} (batch {_N}) vs 1 process",
                         world_size=P, max_error=err, ok=err <= 1e-6 and len(grads) == len(ref),
                         detail=f"peak micro-batches in flight by stage {[inflight[s] for s in sorted(inflight)]}"))
    grads_by_rank = run(_dp_pp_rank, 4, timeout=60)
    _, ref = _reference(2, *_batch(12))
    err = max(_max_error({**grads_by_rank[d * 2], **grads_by_rank[d * 2 + 1]}, ref)
              for d in range(2))
    rows.append(dict(section="PP", check="DP=2 x PP=2, 1f1b M=3 vs 1 process", world_size=4,
                     max_error=err, ok=err <= 1e-6, detail="grads averaged over DP once per step"))
    for name in ("gpipe", "1f1b"):
        b = simulate(make_schedule(name, 8, 32)).bubble
        err = abs(b - bubble_formula(8, 32))
        rows.append(dict(section="PP", check=f"simulator {name} P=8 M=32 bubble", world_size=1,
                         max_error=err, ok=err < 1e-12 and round(b, 4) == 0.1795,
                         detail=f"{b:.4f} = (P-1)/(M+P-1)"))
    wrong = Schedule("wrong", 2, 2, 1, ((Op("F", 0, 0), Op("B", 0, 0), Op("F", 1, 0), Op("B", 1, 0)),
                                        (Op("F", 0, 1), Op("F", 1, 1), Op("B", 0, 1), Op("B", 1, 1))))
    try:
        simulate(wrong)
        found = False
    except PipelineDeadlock:
        found = True
    rows.append(dict(section="PP", check="simulator finds a deadlocking order", world_size=1,
                     max_error=0.0, ok=found, detail="rank 0: B0 before F1; rank 1: F1 before B0"))
    return rows
