"""Zero-bubble schedules on the engine (gloo): against one process, against the simulator's memory,
and against torch.distributed.pipelining's own zero-bubble schedules.

Tolerance 1e-6 absolute in fp32: the B/W split computes the same products as a fused backward, but
the weight gradients of the micro-batches are added in a different order (ZB-H1's W lags), and
micro-batching changes the order of the loss sums; fp32 addition is not associative, so equality is
to rounding, not bit for bit (observed: about 1e-8 here).
One launch per P covers every case.
"""

import pytest
import torch
from torch import nn

import minidist
from minidist.pipeline_parallel import make_schedule, peak_bytes
from minidist.pipeline_parallel.engine import local_stages, pipeline_step
from minidist.pipeline_parallel.memory import StageActivationMeter
from minidist.pipeline_parallel.microbatch import split
from minidist.pipeline_parallel.partition import split_model

from _pp_models import make_model

N, WIDTH = 13, 6  # 13 samples: ragged micro-batches for every M tested


def make_batch(n=N):
    g = torch.Generator().manual_seed(7)
    return torch.randn(n, WIDTH, generator=g), torch.randn(n, WIDTH, generator=g)


def cases(P):
    return ([(name, M) for name in ("zb-h1", "zb-v", "1f1b") for M in (P, 2 * P, 3 * P, P + 1)]
            + [("dualpipe-v", M) for M in (2 * P, 3 * P, 2 * P + 1)])  # it needs M >= 2P


def _worker(rank, world, cases):
    out = {}
    x, y = make_batch()
    for name, M in cases:
        schedule = make_schedule(name, world, M)
        model = make_model()
        mods = local_stages(split_model(model, schedule.n_stages), schedule, rank)
        res = pipeline_step(schedule, mods, x, y, nn.functional.mse_loss)
        mine = {id(p) for m in mods.values() for p in m.parameters()}
        grads = {k: p.grad.clone() for k, p in model.named_parameters() if id(p) in mine}
        out[(name, M)] = (res.loss, grads, res.peak_activation_bytes, res.peak_inflight)
    return out


def _bytes_per_microbatch(schedule):
    """Saved bytes of each (micro-batch, stage), measured in one process, schedule-free (the last
    stage includes its loss, as in the engine)."""
    stages = split_model(make_model(), schedule.n_stages)
    meter = StageActivationMeter(dict(enumerate(stages)))
    x, y = make_batch()
    for m, (xm, ym) in enumerate(zip(split(x, schedule.M), split(y, schedule.M))):
        h = xm
        for s, stage in enumerate(stages):
            with meter.forward(s, m):
                h = stage(h)
                if s == len(stages) - 1:
                    h = nn.functional.mse_loss(h, ym)
            h = h.detach().requires_grad_()
    return dict(meter.per_mb)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("P", [2, 4])
def test_zero_bubble_schedules_match_one_process_and_simulator(P):
    results = minidist.run(_worker, P, cases(P), timeout=200)
    model = make_model()
    x, y = make_batch()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    ref = {k: p.grad for k, p in model.named_parameters()}
    worst = 0.0
    for name, M in cases(P):
        losses = [r[(name, M)][0] for r in results if r[(name, M)][0] is not None]
        assert len(losses) == 1 and losses[0] == pytest.approx(loss.item(), abs=1e-6), (name, M)
        grads = {k: g for r in results for k, g in r[(name, M)][1].items()}
        assert set(grads) == set(ref), (name, M)
        for k in ref:
            torch.testing.assert_close(grads[k], ref[k], atol=1e-6, rtol=0,
                                       msg=lambda m: f"{name} M={M} grad {k}: {m}")
            worst = max(worst, (grads[k] - ref[k]).abs().max().item())
        measured = {s: b for r in results for s, b in r[(name, M)][2].items()}
        schedule = make_schedule(name, P, M)
        per_mb = _bytes_per_microbatch(schedule)
        assert measured == peak_bytes(schedule, lambda m, s: per_mb[(s, m)]), (name, M)
        if name == "zb-h1":
            # 1F1B's peak (the paper's p·M_B): no stage holds more micro-batches than 1F1B's first
            # stage, and stage 0 holds the same bytes; the later stages hold more than in 1F1B
            # (P instead of P-s micro-batches: their W lag), so in bytes they differ
            inflight = {s: n for r in results for s, n in r[(name, M)][3].items()}
            ref_inflight = {s: n for r in results for s, n in r[("1f1b", M)][3].items()}
            assert inflight == {s: min(P, M) for s in range(P)}
            assert max(inflight.values()) == max(ref_inflight.values()) == ref_inflight[0]
            assert measured[0] == {s: b for r in results for s, b in r[("1f1b", M)][2].items()}[0]
    print(f"P={P}: largest gradient error vs one process {worst:.2e}")


# ---- torch.distributed.pipelining's zero-bubble schedules on the same split ---------------------

def _torch_and_ours(rank, world, M):
    from torch.distributed.pipelining import (PipelineStage, ScheduleDualPipeV,
                                              ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble)
    x, y = make_batch(4 * M)  # torch weights every micro-batch 1/M: equal micro-batches
    out = {}
    for ours, theirs in (("zb-h1", ScheduleInterleavedZeroBubble), ("zb-v", ScheduleZBVZeroBubble),
                         ("dualpipe-v", ScheduleDualPipeV)):
        for who in ("ours", "torch"):
            schedule = make_schedule(ours, world, M)
            model = make_model()
            stages = split_model(model, schedule.n_stages)
            mine = schedule.stages_of(rank)
            if who == "ours":
                mods = {s: stages[s] for s in mine}
                loss = pipeline_step(schedule, mods, x, y, nn.functional.mse_loss).loss
            else:
                pst = [PipelineStage(stages[s], s, schedule.n_stages, torch.device("cpu"))
                       for s in mine]
                sched = theirs(pst, n_microbatches=M, loss_fn=nn.functional.mse_loss)
                losses = []
                last = schedule.n_stages - 1 in mine
                sched.step(*((x,) if 0 in mine else ()),
                           **(dict(target=y, losses=losses) if last else {}))
                loss = float(sum(l.detach() for l in losses)) / M if last else None
            keep = {id(p) for s in mine for p in stages[s].parameters()}
            out[(theirs.__name__, who)] = (loss, {k: p.grad.clone() for k, p in model.named_parameters()
                                                  if id(p) in keep})
    return out


@pytest.mark.timeout(200)
@pytest.mark.parametrize("P,M", [(2, 4), (4, 8)])  # DualPipeV needs M >= 2P
def test_equal_to_torch_zero_bubble_schedules(P, M):
    """Ours ZB-H1 vs torch's ZB1P (ScheduleInterleavedZeroBubble, one stage per rank); ZB-V and
    DualPipe-V vs ScheduleZBVZeroBubble and ScheduleDualPipeV (same V placement, same split)."""
    results = minidist.run(_torch_and_ours, P, M, timeout=150)
    worst = 0.0
    for theirs in ("ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV"):
        loss = {who: [r[(theirs, who)][0] for r in results if r[(theirs, who)][0] is not None]
                for who in ("ours", "torch")}
        assert len(loss["ours"]) == len(loss["torch"]) == 1
        assert loss["ours"][0] == pytest.approx(loss["torch"][0], abs=1e-6), theirs
        grads = {who: {k: g for r in results for k, g in r[(theirs, who)][1].items()}
                 for who in ("ours", "torch")}
        assert set(grads["ours"]) == set(grads["torch"]) and len(grads["ours"]) == 16
        for k, g in grads["ours"].items():
            torch.testing.assert_close(g, grads["torch"][k], atol=1e-6, rtol=0,
                                       msg=lambda m: f"{theirs} {k}: {m}")
            worst = max(worst, (g - grads["torch"][k]).abs().max().item())
    print(f"P={P}, M={M}: largest gradient difference vs torch's schedules {worst:.2e}")


def _w_before_b(rank, world):
    from minidist.pipeline_parallel import Op, Schedule
    good = make_schedule("zb-h1", world, 2)
    row = list(good.ops[1])
    i, j = row.index(Op("B", 0, 1)), row.index(Op("W", 0, 1))
    row[i], row[j] = row[j], row[i]
    bad = Schedule("w-first", world, 2, 1, (good.ops[0], tuple(row)))
    mods = local_stages(split_model(make_model(), 2), bad, rank)
    x, y = make_batch()
    pipeline_step(bad, mods, x, y, nn.functional.mse_loss)


@pytest.mark.timeout(60)
def test_engine_refuses_w_before_b_on_every_rank():
    with pytest.raises(minidist.RankError) as info:
        minidist.run(_w_before_b, 2, timeout=30)
    msg = str(info.value)
    for r in (0, 1):  # rank 0's own list is fine: it refuses too instead of waiting for rank 1
        assert (f"pipeline_step (rank {r}): w-first, rank 1: W0@s1 (weight gradient) comes "
                "before its B0@s1") in msg, msg
