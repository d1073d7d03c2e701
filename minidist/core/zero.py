"""ZeRO stages 1 and 2: the optimizer state (P_os), then the gradients too (P_os+g), sharded over DP.

The trainable parameters become views of one flat buffer, in backward's order (last layer first),
padded with zeros to W·S elements, S = ceil(numel / W); rank r owns elements [r·S, (r+1)·S) and
builds the inner optimizer (SGD, AdamW: element-wise) on an fp32 copy of that slice only, so it
keeps 1/W of the optimizer state. Stage 1 all-reduces the whole flat gradient, as DDP does, and
keeps its slice; stage 2 copies each gradient into a flat buffer from a post-accumulate-grad hook,
frees ``p.grad`` and reduce-scatters the buffer (async, overlapping the end of backward), so only
the slice of the averaged gradient outlives backward. After the inner step an all-gather of the
slices rebuilds every rank's full parameters: reduce-scatter + all-gather move what DDP moves.
Sources: Rajbhandari et al. 2020 (ZeRO) §5.1-5.2; DeepSpeed's runtime/zero/stage_1_and_2.py;
torch.distributed.optim.ZeroRedundancyOptimizer.
"""

import torch
import torch.distributed as dist

# torch renamed the flat collectives (the old names warn); keep torch >= 2.4 working
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class ZeroOptimizer:
    """ZeRO-1/2 around ``optimizer_class(params, **defaults)`` (torch's ZeroRedundancyOptimizer's
    arguments). ``params``: a list of tensors (those not requiring grad are left alone); ``stage``
    1 or 2; ``group``: the data-parallel group (default the world). ``p.grad``: this rank's local
    gradient from one backward per step; step() averages them over the group."""

    def __init__(self, params, optimizer_class, stage=1, group=None, **defaults):
        self.stage, self.group = stage, group
        self.rank, self.W = dist.get_rank(group), dist.get_world_size(group)
        self.params = [p for p in reversed(list(params)) if p.requires_grad]   # backward's order
        self.where, n = {}, 0                       # parameter -> (offset, numel) in the flat buffer
        for p in self.params:
            self.where[p], n = (n, p.numel()), n + p.numel()
        self.S = max(1, -(-n // self.W))            # shard numel: ceil(n / W)
        self.flat = self.params[0].new_zeros(self.W * self.S)   # [W·S], the padding stays zero
        with torch.no_grad():
            for p, (o, k) in self.where.items():
                self.flat[o:o + k].copy_(p.reshape(-1))
                p.data = self.flat[o:o + k].view_as(p)  # the parameters live in the flat buffer
        mine = self.flat[self.rank * self.S:(self.rank + 1) * self.S]
        self.master = mine.detach().clone().float()    # [S] fp32: all the optimizer ever sees
        self.optim = optimizer_class([self.master], **defaults)
        self.grad = self.handle = None              # stage 2: the flat gradient, in flight
        if stage == 2:
            self.hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]

    @torch.no_grad()
    def _on_grad(self, p):
        """Stage 2: ``p.grad`` into the flat gradient and freed; the last one launches the
        reduce-scatter while the rest of backward goes on (DeepSpeed cuts the flat gradient into
        buckets of ``reduce_bucket_size``, launched as each fills, so not even it is whole)."""
        if self.grad is None:
            self.grad, self.filled = torch.zeros_like(self.flat), 0
        o, k = self.where[p]
        self.grad[o:o + k].copy_(p.grad.reshape(-1))
        p.grad = None
        self.filled += 1
        if self.filled == len(self.params):
            self._launch_reduce_scatter()

    def _launch_reduce_scatter(self):
        if self.grad is None:                       # no gradient at all on this rank: zeros
            self.grad = torch.zeros_like(self.flat)
        self.reduced = self.flat.new_empty(self.S)  # [S] my slice of the sum
        self.handle = _reduce_scatter(self.reduced, self.grad, group=self.group, async_op=True)

    @torch.no_grad()
    def _my_averaged_grad(self):
        """[S]: my slice of the gradient summed over the group, then divided by W."""
        if self.stage == 1:
            grad = torch.zeros_like(self.flat)      # a parameter without .grad counts as zeros
            for p, (o, k) in self.where.items():
                if p.grad is not None:
                    grad[o:o + k].copy_(p.grad.reshape(-1))
            dist.all_reduce(grad, group=self.group)  # every rank gets the whole sum, as in DDP
            return grad[self.rank * self.S:(self.rank + 1) * self.S].div_(self.W)
        if self.handle is None:                     # some parameter got no gradient here
            self._launch_reduce_scatter()
        self.handle.wait()
        reduced, self.grad = self.reduced.div_(self.W), None
        self.reduced = self.handle = None
        return reduced

    @torch.no_grad()
    def step(self):
        """Average the gradient of my slice, step it, all-gather the parameters of every rank."""
        self.master.grad = self._my_averaged_grad().float()
        self.optim.step()
        self.master.grad = None
        _all_gather(self.flat, self.master.to(self.flat.dtype), group=self.group)

    def zero_grad(self):
        for p in self.params:
            p.grad = None
