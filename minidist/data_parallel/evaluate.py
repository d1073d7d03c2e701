"""Distributed evaluation that counts every sample exactly once: rank r takes r, r+W, ... (no
padding), counts and summed loss all-reduced, so accuracy is the single-process one for any W.
Design notes: docs/design/data_parallel.md
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
    """Accuracy and mean cross-entropy of ``model`` (bare or DDP) over ``dataset`` of ``(x, y)``.
    Collective. Returns ``{"accuracy", "loss", "correct", "count"}``, identical on every rank,
    ``count == len(dataset)``."""
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
