"""Sequence parallelism (Korthikanti et al. 2022, §4.2.2): the replicated regions on sequence shards.

Parameters used there see only their shard's tokens: :func:`allreduce_sequence_parallel_grads`
sums their gradients over the TP group after backward.
Design notes: docs/design/tensor_parallel.md
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from ..comm.p2p import group_rank_world
from .. import collectives as C
from .layers import mark_parameter

__all__ = ["mark_sequence_parallel", "allreduce_sequence_parallel_grads",
           "track_sequence_parallel_grads"]


def mark_sequence_parallel(module: nn.Module) -> nn.Module:
    """Mark every parameter of ``module`` (e.g. a LayerNorm) as used on sequence shards."""
    for p in module.parameters():
        mark_parameter(p, getattr(p, "partition_dim", None), getattr(p, "full_size", None), True)
    return module


def track_sequence_parallel_grads(model: nn.Module) -> nn.Module:
    """Make :func:`allreduce_sequence_parallel_grads` sum only what it has not summed yet
    (gradient accumulation). Returns ``model``."""
    for p in model.parameters():
        if getattr(p, "sequence_parallel", False) and not hasattr(p, "_sp_pending"):
            p._sp_pending, p._sp_base = None, None  # not summed yet / already summed, in p.grad
            p.register_hook(_noter(weakref.ref(p)))
    return model


def _noter(ref):
    def note(grad):
        p = ref()
        if p is None:
            return None
        if p.grad is None or not bool(p.grad.any()):  # zero_grad ran: nothing summed in p.grad
            p._sp_base, p._sp_pending = None, grad.detach().clone()
        else:
            p._sp_pending = (grad.detach().clone() if p._sp_pending is None
                             else p._sp_pending + grad.detach())
        return None
    return note


def allreduce_sequence_parallel_grads(model: nn.Module, group=None) -> int:
    """Sum the sequence-parallel parameters' gradients over the TP group; returns how many.
    Every rank calls it after backward (on a tracked model: after any micro-batch). The gradients
    travel as one flat buffer per dtype (one all-reduce, not one per parameter: they are small)."""
    _, world = group_rank_world(group)
    todo: list[tuple[Any, torch.Tensor, bool]] = []   # (parameter, tensor to sum, tracked)
    for _, p in model.named_parameters():
        if getattr(p, "sequence_parallel", False) and p.grad is not None:
            if hasattr(p, "_sp_pending"):
                pending, p._sp_pending = p._sp_pending, None
                if pending is not None:   # None: nothing new since the last call (on every TP rank)
                    todo.append((p, pending, True))
            else:
                todo.append((p, p.grad, False))
    if world > 1:
        for dtype in dict.fromkeys(t.dtype for _, t, _ in todo):
            parts = [t for _, t, _ in todo if t.dtype == dtype]
            flat = C.all_reduce(torch.cat([t.reshape(-1) for t in parts]), "sum", C.AUTO, group)
            for t, summed in zip(parts, flat.split([t.numel() for t in parts])):
                t.copy_(summed.view_as(t))
    for p, summed, tracked in todo:
        if tracked:   # base + the new sum, so TP ranks hold bit-identical values (no g + (S - g))
            p.grad.copy_(summed if p._sp_base is None else p._sp_base + summed)
            p._sp_base = p.grad.clone()
    return len(todo)
