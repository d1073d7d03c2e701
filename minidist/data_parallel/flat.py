"""DDP, version 2: pack every gradient into one flat buffer and all-reduce it once.

One collective instead of one per parameter: the per-message latency is paid once, and a
bandwidth-optimal ring gets a long message to pipeline. Still, communication starts only after
backward has finished; :mod:`.bucketed` overlaps it with backward.

The flat buffer is in ``reduce_dtype`` (fp32 by default), so bf16 gradients are averaged in fp32.
Shapes: the buffer holds sum(p.numel()) elements, parameters in registration order.
"""

from __future__ import annotations

import torch

from .base import DataParallelBase

__all__ = ["FlatDDP"]


class FlatDDP(DataParallelBase):
    """All gradients in one buffer, one all-reduce, called explicitly with :meth:`sync_gradients`."""

    def sync_gradients(self) -> None:
        if not self._check_decision("sync_gradients()"):
            return
        used = [p.grad is not None for p in self.params]
        if not all(used) and not self.find_unused_parameters:
            raise self._unused_error([p for p, u in zip(self.params, used) if not u])
        # with find_unused_parameters every rank joins the usage all-reduce, also one that used
        # every parameter: otherwise ranks disagree on the collectives they issue (gloo aborts)
        used_anywhere = self._global_used(used) if self.find_unused_parameters else used
        if not self.params:
            return
        flat = torch.cat([(p.grad if u else torch.zeros_like(p)).reshape(-1).to(self.reduce_dtype)
                          for p, u in zip(self.params, used)])
        self.communicator.all_reduce_(flat, "avg")
        for p, piece, anywhere in zip(self.params, flat.split([p.numel() for p in self.params]),
                                      used_anywhere):
            if anywhere:
                p.grad = piece.view_as(p).to(p.dtype).clone()
