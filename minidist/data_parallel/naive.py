"""DDP, version 1: after backward, all-reduce (average) every gradient, one collective per parameter.
Simple but slow: latency paid per parameter, nothing overlaps (Li et al. 2020, §3.2).
Design notes: docs/design/data_parallel.md
"""

from __future__ import annotations

from .base import DataParallelBase

__all__ = ["NaiveDDP"]


class NaiveDDP(DataParallelBase):
    """One all-reduce per parameter, called explicitly with :meth:`sync_gradients`."""

    def sync_gradients(self) -> None:
        plan = self._begin_sync()
        if plan is None:
            return  # forward ran inside no_sync(): keep accumulating locally
        for p, grad, used in zip(self.params, *plan):
            if not used:
                continue  # unused on every rank: leave grad None, like torch's DDP
            buf = grad.to(self.reduce_dtype)
            self.communicator.all_reduce(buf, "avg")
            p.grad = buf.to(p.dtype) if buf is not grad else buf
