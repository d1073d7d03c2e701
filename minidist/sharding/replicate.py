"""Replicated units (torch's composable ``replicate``): parameters whole on every rank, broadcast at
wrap, gradients all-reduced at the end of backward with a used-flag per parameter; e.g. norms
beside sharded linears. A unit above leaves them out; :mod:`.fsdp_state` covers them.
Design notes: docs/design/sharding.md
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from ..communicator import Communicator
from .fsdp_unit import _tensors
from .ownership import _CLAIMED, _claim
from .hsdp import resolve

__all__ = ["ReplicateUnit", "replicate", "replicated_units"]


def replicated_units(module: nn.Module) -> list["ReplicateUnit"]:
    """Every replicated unit in ``module`` (itself included)."""
    return [cast(ReplicateUnit, m._replicate) for m in module.modules()
            if getattr(m, "_replicate", None) is not None]


class ReplicateUnit:
    """``module._replicate``: ``params`` (whole), ``names``, ``comms`` (all-reduced over in turn), ``sync``."""

    def __init__(self, module: nn.Module, comms: list[Communicator]):
        self.module, self.comms = module, comms
        self.rank = comms[-1].rank
        seen: dict = {}
        for name, p in module.named_parameters():
            seen.setdefault(id(p), (name, p))
        self.names = [n for n, _ in seen.values()]
        self.params = [p for _, p in seen.values()]
        for p, n in zip(self.params, self.names):
            ref, owner = _CLAIMED.get(id(p), (None, None))
            if ref is not None and ref() is p:
                raise ValueError(f"replicate (rank {self.rank}): parameter {n} of "
                                 f"{type(module).__name__} already belongs to unit {owner}: "
                                 "replicate a module before fully_shard of any module above it, "
                                 "and keep a tied parameter inside one unit")
        _claim(self.params, self.names, type(module).__name__)
        self.sync, self.requires_all_reduce, self._queued = True, True, False
        with torch.no_grad():
            tensors = self.params + [b for b in module.buffers()]
            for dtype in sorted({t.dtype for t in tensors}, key=str):
                same = [t for t in tensors if t.dtype == dtype]
                flat = torch.cat([t.detach().reshape(-1) for t in same])
                for c in comms[::-1]:          # replicate group first, then shard: rank 0's
                    c.broadcast(flat, 0)
                o = 0
                for t in same:
                    t.copy_(flat[o:o + t.numel()].view(t.shape))
                    o += t.numel()

    def post_forward(self, module, args, output):
        if torch.is_grad_enabled():
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(self._hook)
        return output

    def _hook(self, grad):
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    @torch.no_grad()
    def _finish(self) -> None:
        """End of backward: average every trainable parameter's gradient over the group."""
        self._queued = False
        if not (self.sync and self.requires_all_reduce):
            return
        trainable = [p for p in self.params if p.requires_grad]
        for dtype in sorted({p.dtype for p in trainable}, key=str):
            ps = [p for p in trainable if p.dtype == dtype]
            flat = torch.cat([p.grad.reshape(-1) if p.grad is not None else
                              torch.zeros(p.numel(), dtype=dtype, device=p.device) for p in ps]
                             + [torch.tensor([float(p.grad is not None) for p in ps],
                                             dtype=dtype, device=ps[0].device)])
            for c in self.comms:
                c.all_reduce(flat, "avg")
            used, o = flat[-len(ps):].tolist(), 0
            for p, u in zip(ps, used):
                g = flat[o:o + p.numel()].view(p.shape)
                o += p.numel()
                if u <= 0:
                    continue
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.copy_(g)


def replicate(module: nn.Module, *, group=None, mesh=None, collectives: str = "hand-built",
              algorithm: str = "auto") -> nn.Module:
    """Make ``module`` a replicated unit and return it (before ``fully_shard`` of a module above).
    Gradients averaged over ``group`` (default the world) or ``mesh``'s groups; broadcasts from rank 0.
    Raises ``ValueError`` for a module already sharded or replicated, containing a unit, or a
    parameter owned by a unit."""
    name = type(module).__name__
    if getattr(module, "_replicate", None) is not None or getattr(module, "_fsdp", None) is not None:
        raise ValueError(f"replicate: {name} is already a unit (sharded or replicated)")
    inner = [n for n, m in module.named_modules() if n and (getattr(m, "_fsdp", None) is not None
                                                            or getattr(m, "_replicate", None))]
    if inner:
        raise ValueError(f"replicate: {name} contains units {inner}; replicate the modules "
                         "that are not sharded, not a module above sharded ones")
    if mesh is not None:
        shard, rep = resolve(mesh, None, None)
        groups = [shard] + ([rep] if rep is not None else [])
    else:
        groups = [group]
    comms = [Communicator(collectives, g, where="replicate", algorithm=algorithm) for g in groups]
    unit = ReplicateUnit(module, comms)
    object.__setattr__(module, "_replicate", unit)   # a plain attribute (not a submodule)
    module.register_forward_hook(unit.post_forward)
    return module
