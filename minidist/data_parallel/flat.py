"""DDP, version 2: pack every gradient into one flat buffer and all-reduce it once.

One collective instead of one per parameter: the per-message latency is paid once, and a
bandwidth-optimal ring gets a long message to pipeline. Still, communication starts only after
backward has finished; :mod:`.bucketed` overlaps it with backward.

The flat buffer is in ``reduce_dtype`` (fp32 by default), so bf16 gradients are averaged in fp32.
Shapes: the buffer holds sum(p.numel()) elements, parameters in registration order.
:func:`average_flat` is the one flatten / average / unflatten of the library (the pipeline engine
averages over its data-parallel replicas with it too).
"""

from __future__ import annotations

import torch

from .base import DataParallelBase
from ..communicator import Communicator

__all__ = ["FlatDDP", "average_flat"]


def average_flat(tensors: list[torch.Tensor], comm: Communicator,
                 dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """The average over ``comm``'s group of each tensor, computed as ONE all-reduce of their
    concatenation (with ``comm``'s implementation and algorithm).

    Returns new tensors (same shapes, dtype ``dtype`` or the first tensor's); the inputs are not
    modified. Every rank must pass the same shapes in the same order.
    """
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
