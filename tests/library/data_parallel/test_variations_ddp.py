"""The three DDP wrappers in combinations the course does not show (issue 14).

For NaiveDDP, FlatDDP and BucketedDDP: use on a process subgroup (the DP groups of a
``ProcessGrid``), a parameter used on some ranks and not others in the same step, activation
checkpointing inside the wrapped model (``use_reentrant`` True and False), and gradient
accumulation with ``no_sync()``. Each must give the one-process answer — the gradient of the mean
over ranks of each rank's loss, computed in one process on a copy of the model — within 1e-5
(float32, the summation order differs), or a clear error naming the parameter and the rank.
"""

import contextlib
import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import minidist
from minidist.data_parallel import VERSIONS, UnusedParametersError  # noqa: F401
from minidist.grid import ProcessGrid

TOL = 1e-5


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.extra = nn.Linear(16, 4)  # the head some ranks use and others do not

    def forward(self, x, use_extra=False, reentrant=None):
        h = torch.relu(self.a(x))
        if reentrant is None:
            h = torch.relu(self.b(h))
        else:
            h = checkpoint(lambda t: torch.relu(self.b(t)), h, use_reentrant=reentrant)
        out = self.c(h)
        return out + self.extra(h) if use_extra else out


def _data(dp_rank, n=6, step=0, salt=0):
    g = torch.Generator().manual_seed(100 * dp_rank + step + 10_000 * salt)
    return torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)


def _loss(model, x, y, **kw):
    return ((model(x, **kw) - y) ** 2).mean()


def _wrap(version, model, group, find_unused, **kw):
    cls = VERSIONS[version]
    if version == "bucketed":
        kw.setdefault("bucket_cap_mb", 0.0005)  # a few buckets
    return cls(model, group=group, find_unused_parameters=find_unused, **kw)


def _grads(model):
    return {n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()}


def _compare(got, want):
    worst = 0.0
    for n in want:
        if want[n] is None or got[n] is None:
            assert want[n] is None and got[n] is None, f"{n}: grad None in one of them"
            continue
        worst = max(worst, (got[n] - want[n]).abs().max().item())
    return worst


def _variation_rank(rank, world, version, variation, find_unused=False):
    """Run one training step of ``variation``; return max |grad - one-process grad|."""
    if variation == "subgroup":
        grid = ProcessGrid(dp=2, tp=world // 2)
        group, dp_rank, dp_size = grid.dp_group, grid.dp_rank, grid.dp_size
        salt = grid.tp_rank  # the two DP groups see different data: cross-talk would show
    else:
        group, dp_rank, dp_size, salt = None, rank, world, 0
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    ddp = _wrap(version, model, group, find_unused)

    def kw_for(r):
        if variation == "partial":
            return {"use_extra": r % 2 == 0}  # even ranks use the extra head
        if variation.startswith("checkpoint"):
            return {"reentrant": variation == "checkpoint-reentrant"}
        return {}

    if variation.startswith("accumulation"):
        k = 3
        for i in range(k):
            x, y = _data(dp_rank, step=i)
            synced = variation == "accumulation-synced" or i == k - 1  # sync every micro-batch
            ctx = contextlib.nullcontext() if synced else ddp.no_sync()
            with ctx:
                (_loss(ddp, x, y) / k).backward()
            if synced:
                ddp.sync_gradients()  # then p.grad = sum over micro-batches of their averages
        total = sum(_loss(ref, *_data(r, step=i)) / k for r in range(dp_size) for i in range(k))
    else:
        x, y = _data(dp_rank, salt=salt)
        _loss(ddp, x, y, **kw_for(dp_rank)).backward()
        ddp.sync_gradients()
        total = sum(_loss(ref, *_data(r, salt=salt), **kw_for(r)) for r in range(dp_size))
    (total / dp_size).backward()
    got = _grads(model)
    if hasattr(ddp, "close"):
        ddp.close()
    return _compare(got, _grads(ref))


VARIANTS = ["subgroup", "partial", "checkpoint-reentrant", "checkpoint-nonreentrant",
            "accumulation", "accumulation-synced"]


@pytest.mark.parametrize("variation", VARIANTS)
@pytest.mark.parametrize("version", ["naive", "flat", "bucketed"])
def test_gives_the_one_process_answer(version, variation):
    world = 4 if variation == "subgroup" else 2
    errs = minidist.run(_variation_rank, world, version, variation, True, timeout=120)
    assert max(errs) <= TOL, errs


@pytest.mark.parametrize("version", ["naive", "flat", "bucketed"])
def test_partial_use_without_find_unused_names_the_parameter_and_rank(version):
    with pytest.raises(minidist.RankError) as info:
        minidist.run(_variation_rank, 2, version, "partial", False, timeout=60)
    msg = str(info.value)
    assert "UnusedParametersError" in msg and "rank 1" in msg, msg[-2000:]
    assert "extra.weight" in msg and "extra.bias" in msg, msg[-2000:]
