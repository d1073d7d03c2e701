"""Independent references for DDP: one process on the global batch, and torch's own DDP.

Used by the tests, the exercise grader and ``minidist demo``. A training run here is a few SGD
steps of a small MLP on a seeded synthetic global batch; each rank trains on its contiguous shard
(``global_batch`` must be divisible by the world size: equal shards are what makes DDP's average of
per-rank means equal to the global mean; with unequal shards the average weights ranks, not
samples).

    ours  = train_ddp(rank, world, lambda m: BucketedDDP(m, bucket_cap_mb=0.001))
    torch_ = train_ddp(rank, world, torch_ddp)
    single = train_single()
    max_abs_diff(ours, single)  # ≤ 1e-6 in fp32 (sums in a different order), 0.0 across ranks
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from minidist.models import MLP

__all__ = ["make_model", "global_batch", "shard", "train_single", "train_ddp", "torch_ddp",
           "torch_ddp_buckets", "max_abs_diff"]


def make_model(seed: int = 0, batchnorm: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    return MLP(12, (16, 8), 5, batchnorm=batchnorm)


def global_batch(step: int, size: int = 12, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: x [size, 12] float32, y [size] int64 in 0..4."""
    g = torch.Generator().manual_seed(1000 * seed + step)
    return torch.randn(size, 12, generator=g), torch.randint(0, 5, (size,), generator=g)


def shard(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous piece of ``t`` along dim 0 (sizes differ by ≤ 1 if uneven)."""
    return torch.tensor_split(t, world_size)[rank]


def _optimizer(params, lr, momentum):
    return torch.optim.SGD(params, lr=lr, momentum=momentum)


def train_single(steps: int = 3, size: int = 12, lr: float = 0.1, momentum: float = 0.9,
                 accumulation: int = 1, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """One process, the whole global batch each step; returns the parameters after ``steps``."""
    model = make_model(0)
    opt = _optimizer(model.parameters(), lr, momentum)
    for step in range(steps):
        opt.zero_grad()
        for k in range(accumulation):
            x, y = global_batch(step * accumulation + k, size)
            with _autocast(dtype):
                loss = F.cross_entropy(model(x), y) / accumulation
            loss.backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _autocast(dtype):
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=dtype)


def train_ddp(rank: int, world_size: int, wrap, steps: int = 3, size: int = 12, lr: float = 0.1,
              momentum: float = 0.9, accumulation: int = 1, dtype: torch.dtype | None = None
              ) -> list[torch.Tensor]:
    """``wrap(model)`` on every rank (different initial values per rank: the wrapper must broadcast
    rank 0's), then the same steps as :func:`train_single` on this rank's shard of each batch.
    With ``accumulation`` k, the first k-1 micro-batches run inside ``no_sync()``."""
    model = make_model(rank)  # rank 0 holds the same initial values as train_single
    ddp = wrap(model)
    opt = _optimizer(ddp.parameters(), lr, momentum)
    for step in range(steps):
        opt.zero_grad()
        for k in range(accumulation):
            x, y = global_batch(step * accumulation + k, size)
            last = k == accumulation - 1
            with contextlib.nullcontext() if last else ddp.no_sync():
                with _autocast(dtype):
                    loss = F.cross_entropy(ddp(shard(x, rank, world_size)), shard(y, rank, world_size))
                (loss / accumulation).backward()
                if hasattr(ddp, "sync_gradients"):
                    ddp.sync_gradients()
        opt.step()
    if hasattr(ddp, "close"):
        ddp.close()
    return [p.detach().clone() for p in model.parameters()]


def torch_ddp(model: nn.Module, **kwargs) -> nn.Module:
    """torch.nn.parallel.DistributedDataParallel on the CPU (gloo) with the given settings."""
    return torch.nn.parallel.DistributedDataParallel(model, **kwargs)


def torch_ddp_buckets(model: nn.Module, bucket_cap_mb: float, x: torch.Tensor) -> list[list[str]]:
    """The parameter names of each bucket of torch's DDP around ``model`` with ``bucket_cap_mb``,
    first all-reduced first, as torch rebuilds them after its first backward (in the order the
    gradients arrived). Runs two forward/backward passes of ``model(x).sum()``; call inside a
    process group."""
    names = {p: n for n, p in model.named_parameters()}
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    for _ in range(2):
        ddp(x).sum().backward()
    return [[names[p] for p in b.parameters()] for b in ddp.reducer._get_zeros_like_grad_buckets()]


def max_abs_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    if len(a) != len(b):
        raise ValueError(f"max_abs_diff: {len(a)} tensors vs {len(b)}")
    return max(((x.double() - y.double()).abs().max().item() for x, y in zip(a, b) if x.numel()),
               default=0.0)
