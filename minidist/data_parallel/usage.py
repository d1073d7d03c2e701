"""Which ranks gave each parameter a gradient: one all-reduce of a [world_size, P] usage mask, so
every rank acts on a skipped parameter together (as torch DDP's ``local_used_map``).
Design notes: docs/design/data_parallel.md
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["gradient_users"]


def gradient_users(locally_used: list[bool], rank: int, world_size: int, group=None,
                   device: torch.device | None = None) -> list[list[int]]:
    """Per parameter, the ranks of ``group`` (ascending) that gave it a gradient. Collective: one
    all-reduce of W·P floats on ``device``; same P on every rank."""
    mask = torch.zeros(world_size, len(locally_used), device=device)
    mask[rank] = torch.tensor([1.0 if u else 0.0 for u in locally_used], device=device)
    if world_size > 1:
        dist.all_reduce(mask, group=group)
    return [[r for r in range(world_size) if mask[r, k] > 0] for k in range(len(locally_used))]
