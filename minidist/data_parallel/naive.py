"""DDP, version 1: after backward, all-reduce (average) every gradient, one collective per parameter.

    model = NaiveDDP(MLP())            # rank 0's weights are broadcast to every rank
    loss_fn(model(x_local), y_local).backward()
    model.sync_gradients()             # p.grad = mean over ranks of the local gradients
    optimizer.step()                   # identical update on every rank: replicas stay identical

Correct and simple, but slow: one all-reduce per parameter tensor (latency paid P times), and all
communication waits until backward has finished (nothing overlaps). :mod:`.flat` fixes the first
problem, :mod:`.bucketed` both. Reference: Li et al. 2020, "PyTorch Distributed: Experiences on
Accelerating Data Parallel Training" (VLDB), §3.2.
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
