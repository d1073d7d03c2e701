"""Data parallelism, bucketed and overlapped with backward: PyTorch DDP's reducer.

Every rank holds the whole model (rank 0's, broadcast at wrapping) and its own slice of the batch;
after backward each gradient must be the average over the W ranks. The gradients are packed into
buckets, flat buffers of about ``bucket_cap_mb``, in REVERSE registration order, the order backward
produces them. A hook per parameter copies its gradient into its bucket's slot; when a bucket's
last gradient is in, its all-reduce is launched (async) while backward computes the earlier
layers' gradients. Buckets are launched in bucket order on every rank, so the collectives match.
At the end of backward: wait for every bucket, divide the sums by W, copy them into ``.grad``.
Source: Li et al. 2020 (PyTorch Distributed, VLDB) §3.2-3.3; torch/nn/parallel/distributed.py,
torch/csrc/distributed/c10d/reducer.cpp (compute_bucket_assignment_by_size).
"""

import torch
import torch.distributed as dist
from torch import nn


def assign_buckets(params, cap_bytes):
    """``params`` (registration order) -> lists of them, reversed, cut by ``cap_bytes`` as torch
    does: a bucket is closed once it holds at least the cap (no parameter is split, so a bucket
    can pass the cap by its last parameter)."""
    buckets, current, size = [], [], 0
    for p in reversed(params):
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= cap_bytes:
            buckets.append(current)
            current, size = [], 0
    return buckets + [current] if current else buckets


class Bucket:
    """One all-reduce: ``params`` and their gradients' slots, views of one flat ``buffer``
    (``sum(p.numel())`` elements, the parameters' dtype)."""

    def __init__(self, params):
        self.params = params
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype,
                                  device=params[0].device)
        pieces = self.buffer.split([p.numel() for p in params])
        self.slots = {p: piece.view_as(p) for p, piece in zip(params, pieces)}
        self.arrived = 0      # gradients copied in during this backward
        self.work = None      # the all-reduce in flight

    @property
    def full(self):
        return self.arrived == len(self.params)


class DDP(nn.Module):
    """``module`` replicated over ``group`` (default: the world); after ``loss.backward()`` each
    ``p.grad`` that requires one is the average over ranks. Every such parameter must get a
    gradient in every backward (torch's ``find_unused_parameters=False``)."""

    def __init__(self, module, bucket_cap_mb=25, group=None):
        super().__init__()
        self.module, self.group = module, group
        self.world = dist.get_world_size(group)
        for t in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(t.detach(), group_src=0, group=group)   # rank 0's replica everywhere
        params = [p for p in module.parameters() if p.requires_grad]
        self.buckets = [Bucket(ps) for ps in assign_buckets(params, int(bucket_cap_mb * 2**20))]
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        self.next_launch, self.in_backward = 0, False
        for p in params:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _grad_ready(self, p):
        """Autograd's hook, once ``p.grad`` holds this backward's gradient."""
        if not self.in_backward:    # the first gradient of this backward: finish at its end
            self.in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        bucket = self.bucket_of[p]
        bucket.slots[p].copy_(p.grad)
        bucket.arrived += 1
        # launch in bucket order: a full bucket waits for the buckets before it
        while self.next_launch < len(self.buckets) and self.buckets[self.next_launch].full:
            b = self.buckets[self.next_launch]
            b.work = dist.all_reduce(b.buffer, group=self.group, async_op=True)   # sum
            self.next_launch += 1

    @torch.no_grad()
    def _finish_backward(self):
        """End of backward: wait for each bucket, divide its sum by W, copy back into ``.grad``."""
        for b in self.buckets:
            b.work.wait()
            b.buffer.div_(self.world)
            for p in b.params:
                p.grad.copy_(b.slots[p])
            b.arrived, b.work = 0, None
        self.next_launch, self.in_backward = 0, False
