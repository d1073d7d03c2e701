"""Data-parallel training on the handwritten digits: the loop the practice chapter and the demo use.

Each rank draws its shard with :class:`DistributedSampler` (``set_epoch`` every epoch), trains a
DDP-wrapped model (any of the three versions, or torch's for comparison), and evaluates with
:func:`evaluate` (every test sample counted once). The learning rate follows the linear scaling
rule (Goyal et al. 2017, "Accurate, Large Minibatch SGD", §2.1): ``lr = base_lr · global_batch /
base_batch`` — W ranks of b samples take one step on W·b samples, so they take W times fewer steps
per epoch and each step may be W times larger.

:func:`global_batches` gives, for one process, exactly the batches the W ranks see together at
each step (their shards concatenated), which is how the equality with a single-process run is
checked: same data, same steps, same parameters up to fp32 rounding.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F

from minidist import env
from ..data import load_digits
from minidist.models import MLP
from minidist.data_parallel.evaluate import evaluate
from minidist.data_parallel.sampler import DistributedSampler

__all__ = ["train_digits", "global_batches", "scaled_lr"]


def scaled_lr(base_lr: float, global_batch: int, base_batch: int = 32) -> float:
    """Linear scaling rule: ``base_lr · global_batch / base_batch``."""
    return base_lr * global_batch / base_batch


def _rank_batches(n, rank, world, epoch, batch_size, seed):
    sampler = DistributedSampler(n, world, rank, shuffle=True, seed=seed, drop_last=True)
    sampler.set_epoch(epoch)
    idx = list(sampler)
    return [idx[i: i + batch_size] for i in range(0, len(idx) - batch_size + 1, batch_size)]


def global_batches(n: int, world_size: int, epoch: int, batch_size: int, seed: int = 0) -> list[list[int]]:
    """The index lists one process should train on to match ``world_size`` ranks of ``batch_size``."""
    per_rank = [_rank_batches(n, r, world_size, epoch, batch_size, seed) for r in range(world_size)]
    return [sum((per_rank[r][s] for r in range(world_size)), []) for s in range(len(per_rank[0]))]


def _wrap(model, version: str, collectives: str, hook, hook_state, ddp_kwargs) -> tuple:
    """``(the model to train, whether sync_gradients() must be called after backward)``."""
    from minidist.data_parallel import VERSIONS

    if version == "single":
        return model, False
    if version == "torch":
        return torch.nn.parallel.DistributedDataParallel(model, **ddp_kwargs), False
    ddp = VERSIONS[version](model, collectives=collectives, **ddp_kwargs)
    if hook is not None:
        ddp.register_comm_hook(hook_state, hook)
    return ddp, True


def _epoch(ddp, opt, x_all, y_all, batches, sync: bool, autocast_dtype) -> list[float]:
    """One pass over ``batches`` (index lists): the local loss of every step."""
    losses = []
    for idx in batches:
        opt.zero_grad()
        ctx = (torch.autocast(x_all.device.type, dtype=autocast_dtype)
               if autocast_dtype is not None else contextlib.nullcontext())
        with ctx:
            loss = F.cross_entropy(ddp(x_all[idx]), y_all[idx])
        loss.backward()
        if sync:
            ddp.sync_gradients()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def train_digits(rank: int, world_size: int, version: str = "bucketed", epochs: int = 5,
                 batch_size: int = 32, base_lr: float = 0.05, momentum: float = 0.9,
                 seed: int = 0, collectives: str = "hand-built", model_fn=None, autocast_dtype=None,
                 hook=None, hook_state=None, progress: bool = False, **ddp_kwargs) -> dict:
    """Train ``model_fn()`` (default MLP 64→64→10) on the digits with DDP on this rank.

    Args:
        version: "naive", "flat", "bucketed" (minidist) or "torch" (torch's DDP); "single" trains
            one process on :func:`global_batches` of ``world_size`` ranks (call it with rank 0).
        batch_size: per-rank micro-batch; the global batch is ``world_size · batch_size`` and the
            learning rate ``scaled_lr(base_lr, world_size · batch_size)``.
        autocast_dtype: e.g. ``torch.bfloat16`` for mixed precision on the CPU.
        hook, hook_state: a communication hook for the bucketed version (compression).
        progress: a tqdm bar on rank 0.

    Returns:
        ``{"losses": [per-step local loss], "accuracy", "test_loss", "params", "lr",
        "steps", "bytes_sent"}``.
    """
    if version == "single" and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError("train_digits(version='single') runs one process: call it outside "
                         "minidist.run (or with world size 1), passing the world to imitate")
    train, test = load_digits(seed=seed)
    device = env.device()  # cuda:LOCAL_RANK under nccl, else the CPU
    x_all, y_all = (t.to(device) for t in train.tensors)
    torch.manual_seed(seed)
    model = (model_fn() if model_fn is not None else MLP(64, (64,), 10)).to(device)
    ddp, sync = _wrap(model, version, collectives, hook, hook_state, ddp_kwargs)
    lr = scaled_lr(base_lr, world_size * batch_size)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=momentum)
    losses = []
    from minidist.comm import p2p
    bar = None
    if progress and rank == 0:
        from tqdm.auto import tqdm
        bar = tqdm(total=epochs, desc=f"{version} W={world_size}", unit="epoch")
    with p2p.count_traffic() as traffic:
        for epoch in range(epochs):
            if version == "single":
                batches = global_batches(len(x_all), world_size, epoch, batch_size, seed)
            else:
                batches = _rank_batches(len(x_all), rank, world_size, epoch, batch_size, seed)
            losses += _epoch(ddp, opt, x_all, y_all, batches, sync, autocast_dtype)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{losses[-1]:.3f}")
    if bar is not None:
        bar.close()
    metrics = evaluate(ddp, test, autocast_dtype=autocast_dtype)
    if hasattr(ddp, "close"):
        ddp.close()
    return {"losses": losses, "accuracy": metrics["accuracy"], "test_loss": metrics["loss"],
            "params": [p.detach().clone() for p in model.parameters()], "lr": lr,
            "steps": len(losses), "bytes_sent": traffic.bytes_sent}
