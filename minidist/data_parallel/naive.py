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

import torch

from .base import DataParallelBase

__all__ = ["NaiveDDP"]


class NaiveDDP(DataParallelBase):
    """One all-reduce per parameter, called explicitly with :meth:`sync_gradients`."""

    def sync_gradients(self) -> None:
        if not self._check_decision("sync_gradients()"):
            return  # forward ran inside no_sync(): keep accumulating locally
        used = [p.grad is not None for p in self.params]
        if not all(used) and not self.find_unused_parameters:
            raise self._unused_error([p for p, u in zip(self.params, used) if not u])
        # with find_unused_parameters every rank joins the usage all-reduce, also one that used
        # every parameter: otherwise ranks disagree on the collectives they issue (gloo aborts)
        used_anywhere = self._global_used(used) if self.find_unused_parameters else used
        for i, p in enumerate(self.params):
            if not used[i] and not used_anywhere[i]:
                continue  # unused on every rank: leave grad None, like torch's DDP
            grad = p.grad if used[i] else torch.zeros_like(p)
            buf = grad.to(self.reduce_dtype)
            self.communicator.all_reduce_(buf, "avg")
            p.grad = buf.to(p.dtype) if buf is not grad else buf
