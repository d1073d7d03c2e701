"""ZeRO-2's backward (Rajbhandari et al. 2020, §5.2): a hook copies each gradient into its flat bucket
and frees ``p.grad``; full buckets are reduce-scattered on a communication thread while backward
continues; parameters no rank gave a gradient are refused at the end. Mixed into
:class:`~.zero.ShardedOptimizer`.
Design notes: docs/design/sharding.md
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..backward import in_nested_backward
from ..communicator import CommThread, Communicator
from ..data_parallel.usage import gradient_users

__all__: list[str] = []


class _Stage2Backward:
    """The stage-2 hooks of :class:`~.zero.ShardedOptimizer` (state lives on the optimizer)."""

    buckets: list
    comm: Communicator
    rank: int
    world_size: int
    worker: CommThread
    _where: dict
    _in_backward: bool
    _next: int
    _queued: bool

    if TYPE_CHECKING:
        def gradient_divisor(self) -> float: ...
        def _refuse_refrozen(self) -> None: ...

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self._in_backward:                        # the first gradient of a backward
            self._in_backward, self._next = True, 0
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_graph_task)
        b, i = self._where[p]
        if b.grad_flat is None:
            b.grad_flat, b.filled, b.seen = b.layout.empty(), 0, set()
        if i in b.seen:
            self._drop_backward()
            raise RuntimeError(
                f"ShardedOptimizer (rank {self.rank}): gradient of {b.names[i]} produced twice in "
                "one backward: it is used both inside and outside a torch.utils.checkpoint("
                "use_reentrant=True) region, or in two of them (each one's backward is a separate "
                "one), and its bucket may be reduce-scattered before the second part comes. Use "
                "checkpoint(..., use_reentrant=False)")
        o, k = b.layout.offsets[i], b.layout.numels[i]
        b.grad_flat[o:o + k].copy_(p.grad.reshape(-1))  # type: ignore[union-attr]
        p.grad = None                                    # the full gradient is not kept
        b.filled += 1
        b.seen.add(i)
        self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets):            # launch in bucket order on every rank
            nb = self.buckets[self._next]
            if not any(q.requires_grad for q in nb.params):   # frozen since: no gradient comes
                self._next += 1
                continue
            if nb.grad_flat is None or nb.filled < len(nb.params):
                break
            nb.reduced = torch.empty(nb.layout.shard_numel, dtype=nb.layout.dtype,
                                     device=nb.layout.device)
            nb.handle = self.worker.submit(f"ZeRO-2 reduce-scatter of bucket {self._next} "
                                           f"(rank {self.rank})", _reduce_scatter, nb.reduced,
                                           nb.grad_flat, self.gradient_divisor())
            self._next += 1

    def _end_of_graph_task(self) -> None:
        """A graph task ended; a reentrant checkpoint's nested one is not the end of backward."""
        self._queued = False
        if not in_nested_backward():
            self._finish_backward()

    def _finish_backward(self) -> None:
        """Wait for the reduce-scatters; missing gradients are zeros, none on any rank refused."""
        self._in_backward = False
        active = [b for b in self.buckets if any(q.requires_grad for q in b.params)]
        try:
            self._refuse_refrozen()   # the cause, if a parameter was frozen since (not "missing")
        except RuntimeError:
            self._drop_backward()
            raise
        for b in active:              # slots no gradient reached are zero (layout.empty())
            if b.grad_flat is None:
                b.grad_flat, b.seen = b.layout.empty(), set()
            b.filled = len(b.params)
        self._launch_ready()
        for b in active:
            b.handle.wait()
        used = [i in b.seen for b in active for i in range(len(b.params))]
        names = [n for b in active for n in b.names]
        users = gradient_users(used, self.rank, self.world_size, self.comm.group,
                               active[0].layout.device if active else None)
        nowhere = [n for n, u in zip(names, users) if not u]
        if nowhere:
            self._drop_backward()
            raise RuntimeError(f"ShardedOptimizer (rank {self.rank}): stage 2 got no gradient for "
                               f"{', '.join(nowhere)} on any rank in this backward; freeze them "
                               "(requires_grad=False) or use them in the loss")
        with torch.no_grad():
            for b in active:
                if b.shard.grad is None:
                    b.shard.grad = b.reduced
                else:
                    b.shard.grad.add_(b.reduced)
                b.grad_flat = b.reduced = b.handle = None

    def _drop_backward(self) -> None:
        self._in_backward = False
        for b in self.buckets[:self._next]:
            if b.handle is not None:
                b.handle.wait()
        for b in self.buckets:
            b.grad_flat = b.reduced = b.handle = None


def _reduce_scatter(comm: Communicator, out, flat, divisor) -> None:
    comm.reduce_scatter(out, flat, divisor=divisor)
