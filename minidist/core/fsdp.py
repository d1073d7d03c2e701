"""ZeRO-3 / FSDP: each parameter sharded on dim 0, whole only while its unit's forward or backward runs.

``shard(module)`` makes a unit. A parameter [d0, *rest] is padded to W·c rows (c = ⌈d0/W⌉); rank r
keeps rows [r·c, (r+1)·c) under its own name, and the optimizer steps that shard (FSDP2's layout).
Before the unit's forward the shards are all-gathered into one flat buffer and the module's names
bound to views of it; after it the buffer is freed, and gathered again into the same storage (which
autograd's saved views still point at) when backward reaches the unit's outputs. The full gradient
is reduce-scattered (sum, then / W) into the shards' ``.grad`` while backward goes on. Shard each
block, then the root (it owns what no block owns). Left out: prefetching the next unit, mixed
precision, no_sync, a rank-0 broadcast at wrap (every rank must build the same parameters).
Source: ZeRO §5.3 (P_os+g+p); Zhao et al. 2023 (PyTorch FSDP) §3; torch/distributed/fsdp/_fully_shard/.
"""

import math
from itertools import accumulate

import torch
import torch.distributed as dist

# all_gather_into_tensor / reduce_scatter_tensor, renamed in torch 2.14
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _own_modules(module):
    """``module`` and its submodules, stopping at units below it (they own theirs)."""
    yield module
    for child in module.children():
        if not hasattr(child, "_unit"):
            yield from _own_modules(child)


class Unit:
    """A unit's state (``module._unit``): ``params``, the shards [c_i, *rest_i]; ``slots``
    (submodule, name, index), where the module reads each; ``full`` [W·S], the gathered buffer,
    parameter-major (parameter i's W·c_i padded rows at W·o_i; S = Σ c_i·rest_i, o_i = Σ_{j<i})."""

    def __init__(self, module, group=None):
        self.group, self.W, rank = group, dist.get_world_size(group), dist.get_rank(group)
        index = {}                                    # a parameter tied within the unit: one shard
        self.slots = [(sub, name, index.setdefault(p, len(index))) for sub in _own_modules(module)
                      for name, p in sub._parameters.items() if p is not None]
        self.params, self.shapes = list(index), [p.shape for p in index]
        self.rows = [-(-s[0] // self.W) for s in self.shapes]                        # c_i
        self.numels = [c * math.prod(s[1:]) for c, s in zip(self.rows, self.shapes)]
        *self.offsets, self.S = accumulate(self.numels, initial=0)
        with torch.no_grad():
            for p, c in zip(self.params, self.rows):
                rows = torch.zeros((self.W * c, *p.shape[1:]), dtype=p.dtype, device=p.device)
                rows[:p.shape[0]] = p
                p.data = rows[rank * c:(rank + 1) * c].clone()
        like, trains = (self.params or [torch.empty(0)])[0], any(p.requires_grad for p in self.params)
        self.full = torch.zeros(self.W * self.S, dtype=like.dtype, device=like.device, requires_grad=trains)
        if trains:
            self.full.register_post_accumulate_grad_hook(self.post_backward)
        self.pending, self.queued = None, False
        self.free()

    def _piece(self, flat, i):
        """Parameter i's [W, c_i·rest_i] rows (row r: rank r's shard) in a parameter-major [W·S]."""
        o, k = self.offsets[i], self.numels[i]
        return flat[self.W * o:self.W * (o + k)].view(self.W, k)

    def gather(self):
        """All-gather every rank's shards [S] into [W, S] (rank-major), copy into ``full``."""
        if self.gathered:
            return
        self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())
        ranked = torch.empty(self.W * self.S, dtype=self.full.dtype, device=self.full.device)
        _all_gather(ranked, torch.cat([p.detach().reshape(-1) for p in self.params]), self.group)
        ranked = ranked.view(self.W, self.S)
        for i, o in enumerate(self.offsets):   # .data: no version bump for autograd's saved views
            self._piece(self.full.data, i).copy_(ranked[:, o:o + self.numels[i]])
        self.gathered = True

    def free(self):
        self.full.untyped_storage().resize_(0)
        self.gathered = False

    def pre_forward(self, module, args):
        """Gather; the module's names → views [d0, *rest] of ``full`` (detached if frozen)."""
        self.gather()
        for sub, name, i in self.slots:
            view = self._piece(self.full, i).view(-1, *self.shapes[i][1:])[:self.shapes[i][0]]
            sub._parameters[name] = view if self.params[i].requires_grad else view.detach()

    def post_forward(self, module, args, output):
        """Hook the outputs for backward; the names → the shards again; free."""
        for t in output if isinstance(output, (tuple, list)) else (output,):
            if torch.is_tensor(t) and t.requires_grad:
                t.register_hook(self.pre_backward)
        for sub, name, i in self.slots:
            sub._parameters[name] = self.params[i]
        self.free()

    def pre_backward(self, grad):
        """Backward reached an output: gather again; at the end of backward, finish."""
        self.gather()
        if not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)

    def post_backward(self, full):
        """The full gradient [W·S] is complete: start its reduce-scatter, free the parameters."""
        grad, full.grad = full.grad, None
        ranked = torch.cat([self._piece(grad, i) for i in range(len(self.params))], dim=1)
        out = torch.empty(self.S, dtype=grad.dtype, device=grad.device)
        work = _reduce_scatter(out, ranked.view(-1), group=self.group, async_op=True)
        self.pending = (work, out, ranked)             # ranked lives until the work is done
        self.free()

    def finish_backward(self):
        """Wait for the reduce-scatter; the average (sum / W) accumulates into each ``.grad``."""
        self.queued = False
        if self.pending is not None:
            work, out, _ = self.pending
            self.pending = None
            work.wait()
            out.div_(self.W)
            for p, o, k in zip(self.params, self.offsets, self.numels):
                if p.requires_grad:
                    g = out[o:o + k].view(p.shape)
                    p.grad = g.clone() if p.grad is None else p.grad.add_(g)
        self.free()                 # a frozen unit was gathered for its input gradient only


def shard(module, group=None):
    """Make ``module`` a unit over ``group`` (blocks first, then the root) and return it; its
    parameters become this rank's shards [c, *rest] in place: build the optimizer after."""
    unit = module._unit = Unit(module, group)
    if unit.params:
        module.register_forward_pre_hook(unit.pre_forward)
        module.register_forward_hook(unit.post_forward)
    return module
