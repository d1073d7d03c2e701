"""The region operators of tensor parallelism, with Megatron-LM's names (Shoeybi et al. 2019, §3).

A tensor-parallel layer moves activations between two kinds of region: *replicated* (every rank of
the TP group holds the same full tensor) and *parallel* (each rank holds its own shard or partial
sum). Each crossing is an autograd Function whose backward is the conjugate collective:

==================================================  ===========================  ========================
operator                                            forward                      backward
==================================================  ===========================  ========================
``copy_to_tensor_model_parallel_region`` (f)        identity                     all-reduce (sum)
``reduce_from_tensor_model_parallel_region`` (g)    all-reduce (sum)             identity
``scatter_to_tensor_model_parallel_region``         keep my slice of last dim    all-gather last dim
``gather_from_tensor_model_parallel_region``        all-gather last dim          keep my slice
``scatter_to_sequence_parallel_region``             keep my slice of seq dim     all-gather seq dim
``gather_from_sequence_parallel_region``            all-gather seq dim           reduce-scatter seq dim
``reduce_scatter_to_sequence_parallel_region``      reduce-scatter seq dim       all-gather seq dim
==================================================  ===========================  ========================

Why f's backward all-reduces: a replicated input ``x`` feeds W shards, and each rank's backward
only sees its shard's contribution to dL/dx; the true gradient is the sum. Why g's backward is the
identity: the all-reduced output is replicated, so every rank already has the full dL/dy.

Shapes: the last dimension (tensor regions) or ``seq_dim`` (sequence regions, default 1 for
``[batch, seq, hidden]``) must be divisible by the TP size when split: ``ValueError`` naming the
rank and the op otherwise. ``group=None`` is the world. With a TP size of 1 all are the identity.
Collectives are minidist's own (:mod:`minidist.collectives`), reported to :mod:`.accounting`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import collectives as C
from ..comm import autograd as comm_autograd, p2p
from . import accounting

__all__ = [
    "copy_to_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region",
    "scatter_to_tensor_model_parallel_region", "gather_from_tensor_model_parallel_region",
    "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region", "tp_rank_world", "split_along",
]


def tp_rank_world(group=None) -> tuple[int, int]:
    """``(rank, world_size)`` of the TP group; ``(0, 1)`` when no process group is initialised."""
    if not dist.is_initialized():
        if group is not None:
            raise RuntimeError("a TP group was given but torch.distributed is not initialised")
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _run(op: str, phase: str, where: str, payload: int, fn):
    with p2p.count_traffic() as sent:
        out = fn()
    accounting.record(where, op, phase, payload, sent.bytes_sent)
    return out


def _all_reduce(x, group, phase, where):
    _, world = tp_rank_world(group)
    if world == 1:
        return x
    return _run("all_reduce", phase, where, _bytes(x),
                lambda: C.all_reduce(x.contiguous().clone(), "sum", group=group))


def split_along(x: torch.Tensor, dim: int, group=None, what: str = "split") -> torch.Tensor:
    """This rank's contiguous slice of ``x`` along ``dim`` (sizes must divide by the TP size)."""
    rank, world = tp_rank_world(group)
    if world == 1:
        return x
    if x.shape[dim] % world:
        raise ValueError(f"{what} (rank {rank}): dimension {dim} of shape {tuple(x.shape)} has "
                         f"size {x.shape[dim]}, not divisible by the tensor-parallel size {world}")
    return x.chunk(world, dim=dim)[rank].contiguous()


def _all_gather(x, dim, group, phase, where):
    _, world = tp_rank_world(group)
    if world == 1:
        return x
    return _run("all_gather", phase, where, _bytes(x) * world,
                lambda: comm_autograd.gather_along(x, dim, group))


def _reduce_scatter(x, dim, group, phase, where):
    _, world = tp_rank_world(group)
    if world == 1:
        return x
    return _run("reduce_scatter", phase, where, _bytes(x),
                lambda: comm_autograd.reduce_scatter_along(x, dim, group))


class _Copy(torch.autograd.Function):  # f
    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.where = group, accounting.current_scope()
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group, "backward", ctx.where), None


class _Reduce(torch.autograd.Function):  # g
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group, "forward", accounting.current_scope())

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group, ctx.where = dim, group, accounting.current_scope()
        return split_along(x, dim, group, "scatter_to_region")

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group, "backward", ctx.where), None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group, "forward", accounting.current_scope())

    @staticmethod
    def backward(ctx, grad):
        return split_along(grad, ctx.dim, ctx.group, "gather_from_region backward"), None, None


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group, ctx.where = dim, group, accounting.current_scope()
        return _all_gather(x, dim, group, "forward", ctx.where)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.dim, ctx.group, "backward", ctx.where), None, None


class _ReduceScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group, ctx.where = dim, group, accounting.current_scope()
        return _reduce_scatter(x, dim, group, "forward", ctx.where)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group, "backward", ctx.where), None, None


def copy_to_tensor_model_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """f: identity forward, all-reduce (sum) of the gradient backward. Input of a column layer."""
    return _Copy.apply(x, group)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """g: all-reduce (sum) forward, identity backward. Output of a row layer."""
    return _Reduce.apply(x, group)


def scatter_to_tensor_model_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Keep this rank's slice of the last dimension; backward all-gathers the gradient."""
    return _Scatter.apply(x, -1, group)


def gather_from_tensor_model_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """All-gather along the last dimension (rank order); backward keeps this rank's slice."""
    return _Gather.apply(x, -1, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group=None, seq_dim: int = 1):
    """Keep this rank's slice of the sequence; backward all-gathers (sequence parallelism)."""
    return _Scatter.apply(x, seq_dim, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, group=None, seq_dim: int = 1):
    """All-gather the sequence shards (replaces f); backward reduce-scatters the gradient."""
    return _GatherSeq.apply(x, seq_dim, group)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group=None, seq_dim: int = 1):
    """Sum the partial outputs and keep my sequence shard (replaces g); backward all-gathers."""
    return _ReduceScatterSeq.apply(x, seq_dim, group)
