"""Communication hooks (fp16/bf16, top-k with error feedback), bytes saved, and mixed precision."""

import pytest
import torch
import torch._dynamo  # noqa: F401  (forked ranks build optimizers, which import it: 5-10 s each)
import torch.nn.functional as F

import minidist
from minidist.comm import p2p
from minidist.data_parallel import BucketedDDP, assert_replicas_identical
from minidist.data_parallel.compression import (TopK, bf16_compress_hook, fp16_compress_hook,
                                                ring_allreduce_bytes)
from minidist.data_parallel.mixed_precision import MixedPrecision
from minidist_course.references.data_parallel import torch_ddp, train_ddp
from minidist.models import MLP


def _grads(rank, world, hook=None, state=None, steps=1):
    """Per step: the hooked DDP's gradients, the exact average, and the bytes sent."""
    torch.manual_seed(0)
    model = MLP(12, (32,), 5)
    ddp = BucketedDDP(model, bucket_cap_mb=25)
    if hook is not None:
        ddp.register_comm_hook(state, hook)
    out = []
    for step in range(steps):
        x = torch.randn(8, 12, generator=torch.Generator().manual_seed(10 * step + rank))
        model.zero_grad()
        local_loss = F.cross_entropy(model(x), torch.arange(8) % 5)
        local = torch.autograd.grad(local_loss, list(model.parameters()))
        exact = [g.clone() for g in local]
        for g in exact:
            minidist.collectives.all_reduce(g, "avg")
        model.zero_grad()
        with p2p.count_traffic() as t:
            F.cross_entropy(ddp(x), torch.arange(8) % 5).backward()
        out.append(([p.grad.clone() for p in model.parameters()], exact, t.bytes_sent))
    assert_replicas_identical(ddp)
    residual = state.residual() if isinstance(state, TopK) else 0.0
    errors = ([state.errors[0].clone()] if isinstance(state, TopK) and state.errors else [])
    ddp.close()
    return out, residual, errors


@pytest.mark.parametrize("hook,rtol", [(fp16_compress_hook, 2e-3), (bf16_compress_hook, 2e-2)])
def test_half_precision_hooks_halve_the_bytes(hook, rtol):
    plain = minidist.run(_grads, 2, timeout=30)[0][0][0]
    res = minidist.run(_grads, 2, hook, timeout=30)
    for (steps, _, _) in res:
        grads, exact, sent = steps[0]
        for g, e in zip(grads, exact):
            assert torch.allclose(g, e, rtol=rtol, atol=rtol * e.abs().max())
        assert sent == plain[2] // 2  # half of the fp32 all-reduce's bytes
    numel = sum(p.numel() for p in MLP(12, (32,), 5).parameters())
    assert plain[2] == ring_allreduce_bytes(numel, 2)


def test_topk_ratio_one_is_the_exact_average():
    for steps, _, _ in minidist.run(_grads, 3, TopK.hook, TopK(1.0), timeout=30):
        grads, exact, _ = steps[0]
        for g, e in zip(grads, exact):
            assert torch.allclose(g, e, atol=1e-6)


def test_topk_error_feedback_loses_nothing_and_saves_bytes():
    world, steps = 2, 4
    res = minidist.run(_grads, world, TopK.hook, TopK(0.05), steps, timeout=30)
    dense_bytes = minidist.run(_grads, world, timeout=30)[0][0][0][2]
    applied = [torch.cat([g.flatten() for g in res[0][0][t][0]]) for t in range(steps)]
    for r in res:
        for grads, exact, sent in r[0]:
            assert sent < dense_bytes / 3  # measured saving
    # invariant: Σ_t applied + mean_r error_r = mean_r Σ_t local grads = Σ_t exact average
    total_applied = sum(applied)
    total_exact = sum(torch.cat([e.flatten() for e in res[0][0][t][1]]) for t in range(steps))
    # bucket order is reverse registration: flatten errors back to registration order
    names = [p.numel() for p in MLP(12, (32,), 5).parameters()]
    mean_err = sum(r[2][0] for r in res) / world
    pieces = list(mean_err.split(list(reversed(names))))
    mean_err = torch.cat(list(reversed(pieces)))
    assert torch.allclose(total_applied + mean_err, total_exact, atol=1e-5)
    assert res[0][1] > 0  # something is still waiting: the test would notice a dropped residual


def _mixed(rank, world, dtype):
    def wrap(m):
        return BucketedDDP(m, bucket_cap_mb=0.0005)
    mp = MixedPrecision(device="cpu", dtype=dtype)
    ours = train_ddp(rank, world, wrap, dtype=dtype)
    ref = train_ddp(rank, world, torch_ddp, dtype=dtype)
    return ours, ref, mp.dtype, mp.scaler is not None


def test_mixed_precision_defaults_and_bf16_matches_torch_ddp():
    mp = MixedPrecision(device="cpu")
    assert mp.dtype == torch.bfloat16 and mp.scaler is None and mp.scale == 1.0
    ours, ref, dtype, scaled = minidist.run(_mixed, 2, torch.bfloat16, timeout=30)[1]
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(ours, ref))
    with pytest.raises(ValueError, match="bfloat16, float16 or None"):
        MixedPrecision(device="cpu", dtype=torch.int8)


def _fp16_scaled(rank, world):
    torch.manual_seed(0)
    model = MLP(12, (16,), 5)
    ddp = BucketedDDP(model)
    mp = MixedPrecision(device="cpu", dtype=torch.float16, init_scale=2.0**10)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    took = []
    for step in range(3):
        opt.zero_grad()
        x = torch.randn(4, 12, generator=torch.Generator().manual_seed(step * 10 + rank))
        with mp.autocast():
            loss = F.cross_entropy(ddp(x), torch.arange(4))
        if step == 1:
            loss = loss * float("inf")  # an overflow: the step must be skipped on every rank
        mp.backward(loss)
        took.append(mp.step(opt))
    assert_replicas_identical(ddp)
    return took, mp.scale


def test_fp16_loss_scaling_skips_overflow_steps_on_every_rank():
    for took, scale in minidist.run(_fp16_scaled, 2, timeout=30):
        assert took == [True, False, True] and scale == 2.0**9
