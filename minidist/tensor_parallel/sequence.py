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
backward (Megatron does the same before the optimizer step).
"""

from __future__ import annotations

from torch import nn

from .. import collectives as C
from . import regions as R
from .layers import mark_parameter

__all__ = ["mark_sequence_parallel", "allreduce_sequence_parallel_grads"]


def mark_sequence_parallel(module: nn.Module) -> nn.Module:
    """Mark every parameter of ``module`` (e.g. a LayerNorm) as used on sequence shards."""
    for p in module.parameters():
        mark_parameter(p, getattr(p, "partition_dim", None), getattr(p, "full_size", None), True)
    return module


def allreduce_sequence_parallel_grads(model: nn.Module, group=None) -> int:
    """Sum the gradients of sequence-parallel parameters over the TP group; returns how many.

    All ranks of the group must call it after ``backward()`` and before the optimizer step.
    """
    _, world = R.tp_rank_world(group)
    n = 0
    for _, p in model.named_parameters():
        if getattr(p, "sequence_parallel", False) and p.grad is not None:
            if world > 1:
                C.all_reduce(p.grad, "sum", group=group)
            n += 1
    return n
