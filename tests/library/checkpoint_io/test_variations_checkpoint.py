"""Checkpoint and resume with dropout: bit-identical to the run that never stopped (issue 14).

Found by trying the product as users do: ranks draw different dropout masks, and a checkpoint that
holds one generator (rank 0's, written by rank 0, restored on every rank) does not continue the
run; before the fix ``save_checkpoint`` kept no random state at all. Now every rank's own CPU (and
CUDA) generator and its sampler's position are saved and restored. Bucketed DDP with several
buckets, W = 2 and 4, resumed at an epoch boundary and in the middle of an epoch.
"""

import os

import pytest
import torch
from torch import nn
import torch.nn.functional as F

import minidist
from minidist.data_parallel import BucketedDDP
from minidist.checkpoint_io import newest, rank_name
from minidist.data_parallel.checkpoint import load_checkpoint, save_checkpoint
from minidist.data_parallel.sampler import DistributedSampler

N, BATCH, TOTAL_STEPS = 96, 8, 10


def _fit(rank, world, ckpt, stop_at=None, resume=False, with_sampler=False):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 4))
    ddp = BucketedDDP(model, bucket_cap_mb=0.001)  # one bucket per parameter or so
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    torch.manual_seed(1000 + rank)  # each rank's own dropout stream, as learners seed them
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(N, 16, generator=g), torch.randint(0, 4, (N,), generator=g)
    sampler = DistributedSampler(N, seed=3)
    step = epoch = 0
    if resume:
        extra = load_checkpoint(ckpt, ddp, opt, **({"states": {"sampler": sampler}} if with_sampler else {}))
        step, epoch = extra["step"], extra["epoch"]
    while step < TOTAL_STEPS:
        sampler.set_epoch(epoch)
        it = iter(sampler)
        while step < TOTAL_STEPS:
            idx = [i for _, i in zip(range(BATCH), it)]
            if not idx:
                break
            opt.zero_grad()
            F.cross_entropy(ddp(x[idx]), y[idx]).backward()
            opt.step()
            step += 1
            if step == stop_at:
                done = step % (N // world // BATCH) == 0  # the epoch's last step
                save_checkpoint(ckpt, ddp, opt, extra={"step": step, "epoch": epoch + done},
                                **({"states": {"sampler": sampler}} if with_sampler else {}))
                ddp.close()
                return None
        epoch += 1
    ddp.close()
    return [p.detach().clone() for p in ddp.module.parameters()]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("where", ["epoch-boundary", "mid-epoch"])
def test_resume_with_dropout_is_bit_identical(world, where, tmp_path):
    steps_per_epoch = N // world // BATCH
    stop_at = steps_per_epoch if where == "epoch-boundary" else steps_per_epoch + 1
    assert stop_at < TOTAL_STEPS
    with_sampler = where == "mid-epoch"
    ckpt = str(tmp_path / "ckpt.pt")
    straight = minidist.run(_fit, world, ckpt, timeout=120)
    minidist.run(_fit, world, ckpt, stop_at, False, with_sampler, timeout=120)
    resumed = minidist.run(_fit, world, ckpt, None, True, with_sampler, timeout=120)
    for rank in range(world):
        for a, b in zip(straight[rank], resumed[rank]):
            assert torch.equal(a, b), f"rank {rank}: resumed run differs by {(a - b).abs().max()}"
    gen = newest(ckpt)
    ranks = [torch.load(os.path.join(gen, rank_name(r)), weights_only=True) for r in range(world)]
    assert not torch.equal(ranks[0]["rng"]["cpu"], ranks[1]["rng"]["cpu"])   # each rank its own


def _other_world(rank, world, ckpt):
    import warnings
    model = nn.Linear(3, 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_checkpoint(ckpt, model)
    return [str(w.message) for w in caught]


def test_resume_on_another_world_size_warns(tmp_path):
    ckpt = str(tmp_path / "c.pt")

    def save(rank, world):
        save_checkpoint(ckpt, nn.Linear(3, 3))

    minidist.run(save, 2, timeout=60)
    msgs = minidist.run(_other_world, 3, ckpt, timeout=60)
    assert all(any("holds the random state of 2 ranks, this job has 3" in m for m in ms)
               for ms in msgs), msgs


def test_sampler_state_resumes_mid_epoch():
    a = DistributedSampler(50, num_replicas=3, rank=1, seed=4)
    a.set_epoch(2)
    it = iter(a)
    seen = [next(it) for _ in range(5)]
    b = DistributedSampler(50, num_replicas=3, rank=1, seed=0)
    b.load_state_dict(a.state_dict())
    b.set_epoch(2)
    assert len(b) == len(a) - 5
    full = DistributedSampler(50, num_replicas=3, rank=1, seed=4)
    full.set_epoch(2)
    assert seen + list(b) == list(full)
    b.set_epoch(3)  # the next epoch starts from its beginning
    assert len(b) == len(a)
