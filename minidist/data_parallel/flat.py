"""DDP, version 2: every gradient packed into one flat buffer (``reduce_dtype``), one all-reduce.
Communication still waits for backward (:mod:`.bucketed` overlaps it).
Design notes: docs/design/data_parallel.md
"""

from __future__ import annotations

import torch

from .base import DataParallelBase
from ..communicator import Communicator

__all__ = ["FlatDDP", "average_flat"]


def average_flat(tensors: list[torch.Tensor], comm: Communicator,
                 dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """New tensors (same shapes, dtype ``dtype`` or the first's): each input averaged over ``comm``'s
    group by ONE all-reduce of their concatenation. Same shapes and order on every rank."""
    if not tensors:
        return []
    dtype = dtype or tensors[0].dtype
    flat = torch.cat([t.reshape(-1).to(dtype) for t in tensors])
    comm.all_reduce(flat, "avg")
    return [piece.view_as(t) for piece, t in zip(flat.split([t.numel() for t in tensors]), tensors)]


class FlatDDP(DataParallelBase):
    """All gradients in one buffer, one all-reduce, called explicitly with :meth:`sync_gradients`."""

    def sync_gradients(self) -> None:
        plan = self._begin_sync()
        if plan is None or not self.params:
            return
        grads, anywhere = plan
        averaged = average_flat(grads, self.communicator, self.reduce_dtype)
        for p, avg, used in zip(self.params, averaged, anywhere):
            if used:
                p.grad = avg.to(p.dtype).clone()
