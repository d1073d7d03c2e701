"""Sampler, evaluation, SyncBatchNorm, checkpoints and resume."""

import os

import pytest
import torch
import torch._dynamo  # noqa: F401  (forked ranks build optimizers, which import it: 5-10 s each)
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import minidist
from minidist.data_parallel import BucketedDDP
from minidist.checkpoint_io import newest
from minidist.data_parallel.checkpoint import FILE, load_checkpoint, save_checkpoint
from minidist.data_parallel.evaluate import evaluate
from minidist.data_parallel.sampler import DistributedSampler
from minidist.data_parallel.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm
from minidist.models import MLP


# ----------------------------------------------------------------------------- sampler
@pytest.mark.parametrize("n", [0, 1, 7, 10, 12])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("drop_last", [False, True])
def test_sampler_matches_torch_and_covers_disjointly(n, world, drop_last):
    for epoch in (0, 3):
        shards = []
        for rank in range(world):
            ours = DistributedSampler(n, world, rank, seed=5, drop_last=drop_last)
            ref = torch.utils.data.DistributedSampler(range(n), world, rank, seed=5,
                                                      drop_last=drop_last)
            ours.set_epoch(epoch)
            ref.set_epoch(epoch)
            shards.append(list(ours))
            assert shards[-1] == list(ref) and len(ours) == len(ref)
        flat = [i for s in shards for i in s]
        assert len({len(s) for s in shards}) <= 1  # equal steps on every rank
        if drop_last:
            assert len(set(flat)) == len(flat) == (n // world) * world  # disjoint
        else:
            assert set(flat) == set(range(n))                            # covers
            assert len(flat) - len(set(flat)) == (-n) % world if n else True  # padding only


def test_sampler_order_changes_with_epoch_and_repeats_with_seed():
    s = DistributedSampler(100, 2, 1, seed=0)
    e0 = list(s)
    s.set_epoch(1)
    e1 = list(s)
    assert e0 != e1 and sorted(e0) != sorted(range(100))
    again = DistributedSampler(100, 2, 1, seed=0)
    assert list(again) == e0
    assert list(DistributedSampler(100, 2, 1, seed=1)) != e0
    with pytest.warns(UserWarning, match="set_epoch"):
        list(again)  # second pass in the same epoch


# ----------------------------------------------------------------------------- evaluation
def _eval(rank, world, n):
    torch.manual_seed(0)
    model = MLP(12, (16,), 5)
    g = torch.Generator().manual_seed(1)
    ds = TensorDataset(torch.randn(n, 12, generator=g), torch.randint(0, 5, (n,), generator=g))
    return evaluate(BucketedDDP(model) if world > 1 else model, ds, batch_size=3)


@pytest.mark.parametrize("n", [10, 13])
def test_evaluation_counts_every_sample_once(n):
    single = minidist.run(_eval, 1, n, timeout=30)[0]
    assert single["count"] == n and 0 < single["correct"] < n
    for world in (2, 3, 4):
        for r in minidist.run(_eval, world, n, timeout=30):
            assert r["count"] == n and r["correct"] == single["correct"]
            assert r["accuracy"] == single["accuracy"]  # exactly
            assert abs(r["loss"] - single["loss"]) < 1e-6


# ----------------------------------------------------------------------------- SyncBatchNorm
def _bn_data(sizes, shape=(3,), seed=0):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(n, *shape, generator=g) * 3 + 1 for n in sizes]
    ws = [torch.randn(n, *shape, generator=g) for n in sizes]  # loss weights
    return xs, ws


def _sync_bn(rank, world, sizes, shape, momentum):
    xs, ws = _bn_data(sizes, shape)
    bn = SyncBatchNorm(shape[0], momentum=momentum)
    with torch.no_grad():
        bn.weight.copy_(torch.linspace(0.5, 1.5, shape[0]))
        bn.bias.copy_(torch.linspace(-1, 1, shape[0]))
    out = []
    for step in range(2):
        x = xs[rank].clone().requires_grad_()
        bn.weight.grad = bn.bias.grad = None
        y = bn(x * (step + 1))
        (y * ws[rank]).sum().backward()
        out.append((y.detach(), x.grad, bn.weight.grad.clone(), bn.bias.grad.clone()))
    return out, bn.running_mean.clone(), bn.running_var.clone(), int(bn.num_batches_tracked)


@pytest.mark.parametrize("sizes,shape,momentum", [
    ([4, 4], (3,), 0.1),
    ([2, 6], (3,), 0.1),           # unequal per-rank batches
    ([1, 3, 2], (2, 5), None),     # [N, C, L], cumulative average
    ([2, 1, 3, 2], (4, 2, 3), 0.3),  # [N, C, H, W], W=4
    ([3], (3,), 0.1),
])
def test_sync_batchnorm_equals_batchnorm_on_the_whole_batch(sizes, shape, momentum):
    world = len(sizes)
    res = minidist.run(_sync_bn, world, sizes, shape, momentum, timeout=30)
    xs, ws = _bn_data(sizes, shape)
    bn = {1: nn.BatchNorm1d, 2: nn.BatchNorm1d, 3: nn.BatchNorm2d}[len(shape)](shape[0],
                                                                              momentum=momentum)
    with torch.no_grad():
        bn.weight.copy_(torch.linspace(0.5, 1.5, shape[0]))
        bn.bias.copy_(torch.linspace(-1, 1, shape[0]))
    for step in range(2):
        x = torch.cat(xs).requires_grad_()
        bn.weight.grad = bn.bias.grad = None
        y = bn(x * (step + 1))
        (y * torch.cat(ws)).sum().backward()
        ys, xgrads = y.detach().split(sizes), x.grad.split(sizes)
        for r in range(world):
            y_r, xg_r, _, _ = res[r][0][step]
            assert torch.allclose(y_r, ys[r], atol=1e-5), (step, r)
            assert torch.allclose(xg_r, xgrads[r], atol=1e-5), (step, r)
        # weight/bias grads are local; their sum over ranks is the whole-batch grad (DDP averages)
        assert torch.allclose(sum(res[r][0][step][2] for r in range(world)), bn.weight.grad,
                              atol=1e-5)
        assert torch.allclose(sum(res[r][0][step][3] for r in range(world)), bn.bias.grad,
                              atol=1e-5)
    for _, rm, rv, nbt in res:
        assert torch.allclose(rm, bn.running_mean, atol=1e-6)
        assert torch.allclose(rv, bn.running_var, atol=1e-5)
        assert nbt == 2


def _d3(rank, world, values):
    bn = SyncBatchNorm(1, momentum=1.0)
    bn(torch.tensor(values[rank]).view(-1, 1))
    return float(bn.running_mean), float(bn.running_var)


def test_failure_case_d3_numbers():
    for mean, var in minidist.run(_d3, 2, [[0.0] * 4, [10.0] * 4], timeout=30):
        assert mean == pytest.approx(5.0) and var == pytest.approx(28.5714, abs=1e-4)
    for mean, var in minidist.run(_d3, 2, [[0.0] * 2, [10.0] * 6], timeout=30):
        assert mean == pytest.approx(7.5) and var == pytest.approx(21.4286, abs=1e-4)


def test_convert_keeps_state_and_eval_uses_running_stats():
    m = MLP(6, (4,), 3, batchnorm=True)
    m.net[1].running_mean.fill_(0.5)
    s = convert_sync_batchnorm(m)
    assert isinstance(s.net[1], SyncBatchNorm) and torch.equal(s.net[1].running_mean,
                                                               torch.full((4,), 0.5))
    s.eval()
    x = torch.randn(5, 6)
    m.eval()
    assert torch.allclose(s(x), m(x))  # no process group needed in eval mode
    with pytest.raises(ValueError, match="expected 4 channels"):
        s.net[1](torch.randn(2, 5))


# ----------------------------------------------------------------------------- checkpoints
def _train(rank, world, path, steps, save_at=None, resume=False):
    torch.manual_seed(rank)
    model = MLP(12, (16,), 5)
    ddp = BucketedDDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    start = 0
    if resume:
        start = load_checkpoint(path, ddp, opt)["step"]
    for step in range(start, steps):
        x = torch.randn(4, 12, generator=torch.Generator().manual_seed(100 * step + rank))
        opt.zero_grad()
        F.cross_entropy(ddp(x), torch.arange(4) % 5).backward()
        opt.step()
        if save_at is not None and step + 1 == save_at:
            save_checkpoint(path, ddp, opt, extra={"step": step + 1})
            return None
    ddp.close()
    return [p.detach() for p in model.parameters()]


def test_resume_equals_uninterrupted_run(tmp_path):
    path = tmp_path / "ckpt.pt"
    straight = minidist.run(_train, 2, path, 5, timeout=30)
    minidist.run(_train, 2, path, 5, 2, timeout=30)
    assert os.listdir(path) == ["gen-000001"], os.listdir(path)   # one complete generation
    assert sorted(os.listdir(newest(path))) == ["checkpoint.pt", "manifest.json", "rank00000.pt",
                                                 "rank00001.pt"]      # each rank's generators
    state = torch.load(os.path.join(newest(path), FILE), weights_only=True)
    assert not any(k.startswith("module.") for k in state["model"])  # saved unwrapped
    resumed = minidist.run(_train, 2, path, 5, None, True, timeout=30)
    for a, b in zip(straight[0], resumed[0]):
        assert torch.equal(a, b)  # bit-identical
    # loads into the bare model, strict, and a module.-prefixed dict loads too
    bare = MLP(12, (16,), 5)
    load_checkpoint(path, bare)
    torch.save({"module." + k: v for k, v in bare.state_dict().items()}, tmp_path / "wrapped.pt")
    load_checkpoint(tmp_path / "wrapped.pt", MLP(12, (16,), 5))
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        load_checkpoint(tmp_path / "missing.pt", bare)


# ----------------------------------------------------------------------------- SyncBN inside DDP
def _cnn_step(model, x, y, opt):
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()


def _syncbn_ddp(rank, world, steps):
    from minidist_course.data import load_digits
    from minidist.models import SmallCNN

    x, y = load_digits(image=True)[0].tensors
    torch.manual_seed(0)
    model = convert_sync_batchnorm(SmallCNN(width=4))
    ddp = BucketedDDP(model, bucket_cap_mb=1e-9)  # many buckets in flight during SyncBN backward
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    n = 8
    for step in range(steps):
        sl = slice(16 * step + n * rank, 16 * step + n * (rank + 1))
        _cnn_step(ddp, x[sl], y[sl], opt)
    ddp.close()
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_sync_batchnorm_inside_bucketed_ddp_equals_batchnorm_on_the_global_batch():
    from minidist_course.data import load_digits
    from minidist.models import SmallCNN

    steps = 3
    res = minidist.run(_syncbn_ddp, 2, steps, timeout=60)
    x, y = load_digits(image=True)[0].tensors
    torch.manual_seed(0)
    ref = SmallCNN(width=4)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        _cnn_step(ref, x[16 * step: 16 * step + 16], y[16 * step: 16 * step + 16], opt)
    want = ref.state_dict()
    for state in res:
        assert set(state) == set(want)
        for k in want:
            if want[k].is_floating_point():
                assert torch.allclose(state[k], want[k], atol=2e-5), k
            else:
                assert torch.equal(state[k], want[k]), k
    assert not torch.allclose(want["features.0.1.running_mean"], torch.zeros(4))


# ----------------------------------------------------------------------------- loss convention
def _unequal(rank, world, weighted):
    a = [torch.tensor([[1.0], [2.0], [3.0]]), torch.tensor([[10.0]])][rank]
    model = nn.Linear(1, 1, bias=False)
    ddp = BucketedDDP(model)
    loss = ddp(a).mean()  # L = w·a: dL/dw is this rank's mean of a
    if weighted:  # weight every sample equally: scale by W · n_rank / n_global
        loss = loss * world * len(a) / 4
    loss.backward()
    ddp.close()
    return float(model.weight.grad)


def test_unequal_batches_average_ranks_unless_losses_are_weighted():
    assert minidist.run(_unequal, 2, False, timeout=30) == [6.0, 6.0]   # average of rank means
    assert minidist.run(_unequal, 2, True, timeout=30) == [4.0, 4.0]    # global mean
