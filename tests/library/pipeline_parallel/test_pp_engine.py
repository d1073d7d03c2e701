"""The engine against one process on the whole batch: loss, every gradient, a few SGD steps.

Tolerance: 1e-6 absolute in fp32 (micro-batching only changes the order of the sums).
One minidist.run per P covers every schedule and M, to keep the suite fast.
"""

import pytest
import torch
from torch import nn

import minidist
from minidist.pipeline_parallel import make_schedule
from minidist.pipeline_parallel.engine import local_stages, pipeline_step
from minidist.pipeline_parallel.partition import split_model

from _pp_models import make_model

N, WIDTH, STEPS, LR = 10, 6, 3, 0.1
CASES = [(name, M) for name in ("gpipe", "1f1b", "interleaved") for M in (1, 3, 4, 8)]


def make_batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(N, WIDTH, generator=g), torch.randn(N, WIDTH, generator=g)


def reference():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], None
    for step in range(STEPS):
        x, y = make_batch(step)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        losses.append(loss.item())
        if step == 0:
            grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        opt.step()
    return losses, grads, {k: p.detach().clone() for k, p in model.named_parameters()}


def pipeline_worker(rank, world, cases):
    out = {}
    for name, M in cases:
        if name == "interleaved" and M % world:
            continue
        schedule = make_schedule(name, world, M, v=2)
        model = make_model()
        mods = local_stages(split_model(model, schedule.n_stages), schedule, rank)
        mine = {id(p) for m in mods.values() for p in m.parameters()}
        named = {k: p for k, p in model.named_parameters() if id(p) in mine}
        opt = torch.optim.SGD(list(named.values()), lr=LR)
        losses, grads = [], None
        for step in range(STEPS):
            x, y = make_batch(step)
            opt.zero_grad()
            res = pipeline_step(schedule, mods, x, y, nn.functional.mse_loss)
            losses.append(res.loss)
            if step == 0:
                grads = {k: p.grad.clone() for k, p in named.items()}
            opt.step()
        out[(name, M)] = (losses, grads, {k: p.detach().clone() for k, p in named.items()})
    return out


def check_against_reference(results, cases, world):
    ref_losses, ref_grads, ref_params = reference()
    checked = 0
    for name, M in cases:
        if name == "interleaved" and M % world:
            continue
        losses = [l for r in results for l in [r[(name, M)][0]] if l[0] is not None]
        assert len(losses) == 1, "exactly one rank holds the last stage"
        assert losses[0] == pytest.approx(ref_losses, abs=1e-6), (name, M)
        grads = {k: g for r in results for k, g in r[(name, M)][1].items()}
        params = {k: p for r in results for k, p in r[(name, M)][2].items()}
        assert set(grads) == set(ref_grads), (name, M)
        for k in ref_grads:
            torch.testing.assert_close(grads[k], ref_grads[k], atol=1e-6, rtol=0,
                                       msg=lambda m: f"{name} M={M} grad {k}: {m}")
            torch.testing.assert_close(params[k], ref_params[k], atol=1e-6, rtol=0,
                                       msg=lambda m: f"{name} M={M} param {k} after {STEPS} steps: {m}")
        checked += 1
    return checked


@pytest.mark.parametrize("P", [1, 2, 4])
def test_every_schedule_matches_single_process(P):
    results = minidist.run(pipeline_worker, P, CASES, timeout=90)
    checked = check_against_reference(results, CASES, P)
    assert checked == (12 if P == 1 else 10)


def test_m_smaller_than_p_and_ragged_batches():
    cases = [("1f1b", 1), ("1f1b", 3), ("gpipe", 3)]
    results = minidist.run(pipeline_worker, 4, cases, timeout=60)
    assert check_against_reference(results, cases, 4) == 3


def _interleaved_m_not_multiple(rank, world):
    make_schedule("interleaved", world, 3)


def test_interleaved_refuses_m_not_multiple_of_p():
    with pytest.raises(minidist.RankError, match="multiple of the pipeline size P"):
        minidist.run(_interleaved_m_not_multiple, 2, timeout=30)


def _too_few_samples(rank, world):
    schedule = make_schedule("1f1b", world, 8)
    mods = local_stages(split_model(make_model(), world), schedule, rank)
    x = torch.randn(5, WIDTH)
    pipeline_step(schedule, mods, x, x, nn.functional.mse_loss)


def test_batch_smaller_than_m_is_refused():
    with pytest.raises(minidist.RankError, match=r"cannot cut the input batch \(5 samples\) into M=8"):
        minidist.run(_too_few_samples, 2, timeout=30)
