"""Distributed evaluation that counts every sample exactly once (a training sampler's
padding would count some twice).

A training sampler pads shards to equal length with duplicates: with 10 samples on 4 ranks, 12
would be evaluated and the accuracy would depend on W. Here rank r evaluates indices r, r+W, ...
(shards differ in length by at most one, no duplicates), and the ranks all-reduce the integer
*counts* — number correct, number seen — and the summed loss. So accuracy = Σ correct / Σ count is
exactly the single-process accuracy for any W, and the mean loss equals it up to fp64 rounding.
Evaluation runs no backward, so unequal shard lengths cannot leave a rank waiting in DDP.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..communicator import Communicator
from .replicas import unwrap

__all__ = ["shard_indices", "evaluate"]


def shard_indices(n: int, rank: int, world_size: int) -> list[int]:
    """Rank ``rank``'s evaluation indices: ``range(rank, n, world)`` (no padding, no duplicates)."""
    return list(range(rank, n, world_size))


@torch.no_grad()
def evaluate(model, dataset, batch_size: int = 256, group=None, collectives: str = "hand-built",
             autocast_dtype: torch.dtype | None = None) -> dict:
    """Accuracy and mean cross-entropy of ``model`` over the whole ``dataset``, across ranks.

    Every rank must call it (it ends with one all-reduce). ``model`` may be a DDP wrapper: the
    bare module is evaluated (in eval mode, restored afterwards). ``dataset`` items are ``(x, y)``.

    Returns:
        ``{"accuracy": float, "loss": float, "correct": int, "count": int}`` — identical on every
        rank, and ``count == len(dataset)`` for any world size.
    """
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    module = unwrap(model)
    was_training = module.training
    module.eval()
    device = next(module.parameters()).device
    correct = count = 0
    loss_sum = 0.0
    idx = shard_indices(len(dataset), rank, world)
    for start in range(0, len(idx), batch_size):
        items = [dataset[i] for i in idx[start: start + batch_size]]
        x = torch.stack([torch.as_tensor(it[0]) for it in items]).to(device)
        y = torch.as_tensor([int(it[1]) for it in items], device=device)
        if autocast_dtype is not None:
            with torch.autocast(device.type, dtype=autocast_dtype):
                logits = module(x)
        else:
            logits = module(x)
        loss_sum += F.cross_entropy(logits.float(), y, reduction="sum").double().item()
        correct += int((logits.argmax(dim=1) == y).sum())
        count += len(items)
    module.train(was_training)
    totals = torch.tensor([float(correct), float(count), loss_sum], dtype=torch.float64,
                          device=device)  # on the model's device: nccl reduces GPU tensors only
    if world > 1:
        Communicator(collectives, group).all_reduce(totals, "sum")  # counts < 2^53: exact in float64
    correct, count = int(totals[0]), int(totals[1])
    return {"accuracy": correct / max(count, 1), "loss": float(totals[2].item()) / max(count, 1),
            "correct": correct, "count": count}
