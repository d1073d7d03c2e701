"""Transport: shape and dtype travel in the header (nothing preallocated), empty and 0-d tensors too."""

import pytest
import torch
from torch import nn

import minidist
from minidist.pipeline_parallel import make_schedule
from minidist.pipeline_parallel.engine import local_stages, pipeline_step
from minidist.pipeline_parallel.transport import INLINE_BYTES, Transport

TENSORS = [torch.arange(6.0).view(2, 3), torch.arange(24, dtype=torch.int64).view(2, 3, 4),
           torch.zeros(0, 5, dtype=torch.float64), torch.tensor(3.5), torch.ones(7, dtype=torch.bfloat16),
           torch.tensor([True, False]),
           # at the inline limit (one message on gloo), one element past it (header, then payload)
           torch.arange(INLINE_BYTES // 4, dtype=torch.float32).view(-1, 4),
           torch.arange(INLINE_BYTES // 4 + 1, dtype=torch.float32), torch.randn(3, 2, dtype=torch.complex64),
           torch.randn(64, 32)[:, ::2]]   # a strided view: sent as its contiguous copy


def _roundtrip(rank, world, prefetch):
    t = Transport()
    if rank == 0:
        for i, x in enumerate(TENSORS):
            t.send(x, 1, "act", i, 0, 1)
        t.finish()
        return None
    if prefetch:
        t.start_prefetch([(0, "act", i, 0, 1) for i in range(len(TENSORS))])
    got = [t.recv(0, "act", i, 0, 1) for i in reversed(range(len(TENSORS)))][::-1] if not prefetch \
        else [t.recv(0, "act", i, 0, 1) for i in range(len(TENSORS))]
    t.finish()
    return got


@pytest.mark.parametrize("prefetch", [False, True])
def test_header_carries_shape_and_dtype(prefetch):
    """Inline (a payload of at most INLINE_BYTES in the header's message) and two-message sends
    alike; a receiver's buffer for an inline message is INLINE_BYTES long, never shorter than one."""
    # without prefetch the receiver asks in the reverse order: tags match them anyway (gloo)
    got = minidist.run(_roundtrip, 2, prefetch, timeout=30)[1]
    for g, want in zip(got, TENSORS):
        assert g.dtype == want.dtype and g.shape == want.shape
        assert torch.equal(g, want)


def _no_prefetch(rank, world):
    out = []
    for name, M in [("1f1b", 3), ("interleaved", 4), ("gpipe", 5)]:
        sched = make_schedule(name, world, M, v=2)
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(sched.n_stages)])
        mods = local_stages(list(model), sched, rank)
        x = torch.randn(7, 4, generator=torch.Generator().manual_seed(1))
        a = pipeline_step(sched, mods, x, x, nn.functional.mse_loss, prefetch=False)
        grads_a = [p.grad.clone() for m in mods.values() for p in m.parameters()]
        for m in mods.values():
            m.zero_grad()
        b = pipeline_step(sched, mods, x, x, nn.functional.mse_loss, prefetch=True)
        grads_b = [p.grad.clone() for m in mods.values() for p in m.parameters()]
        out.append((a.loss, b.loss, all(torch.equal(u, v) for u, v in zip(grads_a, grads_b))))
    return out


def test_engine_without_prefetch_gives_the_same_step():
    for rank_out in minidist.run(_no_prefetch, 2, timeout=60):
        for loss_a, loss_b, same in rank_out:
            assert same and loss_a == loss_b
