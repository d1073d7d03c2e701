"""Sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", §4.2.2).

Plain TP leaves LayerNorm, dropout and the residual adds *replicated*: every rank does the same
work on the full ``[b, s, h]`` activation and stores it. Sequence parallelism shards them along
the sequence instead (``[b, s/W, h]`` per rank) and swaps the collectives at the borders:

* g (all-reduce after a row-parallel layer) becomes a **reduce-scatter** along the sequence;
* f (identity before a column-parallel layer) becomes an **all-gather** along the sequence
  (its backward a reduce-scatter).

An all-reduce *is* a reduce-scatter followed by an all-gather, so the bytes on the wire are
the same; what shrinks is the activation memory of those regions (by W).

One new duty: parameters used inside the sequence-sharded region (LayerNorm weight and bias,
row-parallel biases, the position embedding) see only their shard's tokens, so their gradients
are partial sums: :func:`allreduce_sequence_parallel_grads` sums them over the TP group after
backward (Megatron does the same before the optimizer step). With gradient accumulation the
learner may call it after every micro-batch or once before the step: a model passed to
:func:`track_sequence_parallel_grads` (``TPGPT`` is) notes each backward's contribution, so only
what has not been summed yet is summed (summing ``.grad`` again would count the earlier
micro-batches W times).
"""

from __future__ import annotations

import weakref

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
    """Note each backward's gradient contribution to the sequence-parallel parameters, so that
    :func:`allreduce_sequence_parallel_grads` sums only what it has not summed yet (gradient
    accumulation). ``zero_grad`` (to None or to zeros) starts afresh. Returns ``model``."""
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
    """Sum the gradients of sequence-parallel parameters over the TP group; returns how many.

    All ranks of the group must call it after ``backward()`` and before the optimizer step. On a
    tracked model (:func:`track_sequence_parallel_grads`) it may also be called after every
    micro-batch: each contribution is summed once.
    """
    _, world = group_rank_world(group)
    n = 0
    for _, p in model.named_parameters():
        if getattr(p, "sequence_parallel", False) and p.grad is not None:
            if hasattr(p, "_sp_pending"):
                pending, p._sp_pending = p._sp_pending, None
                if pending is None:
                    continue  # nothing new since the last call (the same on every TP rank)
                if world > 1:
                    C.all_reduce(pending, "sum", group=group)
                # base + the new sum, so TP ranks hold bit-identical values (no g + (S - g))
                p.grad.copy_(pending if p._sp_base is None else p._sp_base + pending)
                p._sp_base = p.grad.clone()
            elif world > 1:
                C.all_reduce(p.grad, "sum", group=group)
            n += 1
    return n
