"""Replicated units: parameters kept whole on every rank, gradients all-reduced (average).

The other kind of unit beside :func:`~.fsdp.fully_shard`'s: what torch's composable
``torch.distributed._composable.replicate`` does (DDP as a unit), and what FSDP setups do with
small parameters that are not worth sharding — LayerNorm gains and biases in Stanford CS336's
assignment 2 (linears and embeddings sharded, norms replicated). ``replicate(module)`` makes
``module`` such a unit:

* **at wrap**: its parameters (trainable and frozen) and buffers are broadcast from rank 0 of
  ``group``, so every replica starts equal (pytorch/pytorch#140183: HSDP replicas that were never
  synced train apart);
* **forward**: nothing (the parameters are there, whole);
* **end of backward** (an autograd callback queued by a hook on the module's outputs, so it runs
  once, after every gradient of the backward has been accumulated): every trainable parameter's
  ``.grad`` is all-reduced (average) over ``group`` in one flat buffer per dtype, with one flag per
  parameter appended (its average is > 0 iff some rank has a gradient): a parameter one rank used
  and another did not gets the average on both; one no rank used keeps ``grad`` None. Under
  :func:`~.fsdp.set_requires_gradient_sync` ``(False)`` nothing is reduced (the local sum
  accumulates; the next synced backward averages it: averaging a part that is already equal on
  every rank leaves it unchanged); nor under :func:`~.fsdp.set_requires_all_reduce` ``(False)``.

``group``: the whole data-parallel group (default the world); ``mesh``: an
:class:`~.hsdp.HSDPMesh` (or ``(replicate, shard)`` pair), all-reduced over the shard group then
the replicate group — the average over all R·S ranks, without a group of its own.

A fully_shard unit above does not take these parameters (``module._replicate`` marks the
module), and :mod:`.fsdp_state`'s full state dict, loading, optimizer state dict and
``clip_grad_norm_`` cover them: a replicated gradient is the same on every rank, so the global
norm adds it *once*, after the all-reduce of the sharded sums (FSDP1's ``clip_grad_norm_`` counted
NO_SHARD gradients W times until pytorch/pytorch#88955).

Every rank must run backward through the module's output in a synced step (the all-reduce is
collective). No mixed-precision policy: parameters and gradients stay in their dtype.
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
    """What :func:`replicate` attaches to a module as ``module._replicate``: ``params`` (whole,
    the module's own ``nn.Parameter`` objects), ``names`` (their qualified names in the module),
    ``comms`` (the all-reduce goes over each in turn), ``sync``."""

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
    """Make ``module`` a replicated unit (see the module doc) and return it: whole parameters on
    every rank, gradients all-reduced (average) over ``group`` (default the world) — or, with
    ``mesh`` (an :class:`~.hsdp.HSDPMesh`, as ``fully_shard``'s), over its shard group then its
    replicate group. Call it before ``fully_shard`` of any module above (the root then leaves
    these parameters out). Broadcasts parameters and buffers from rank 0.

    Raises ``ValueError`` for a module already sharded or replicated, one that contains a
    ``fully_shard`` unit, or a parameter already owned by a unit (tied across units)."""
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
