"""Differentiable collectives: the bricks of tensor parallelism.

torch.distributed's in-place collectives have no backward: ``y = all_reduce(x)`` followed by
``loss.backward()`` gives x.grad = the *local* upstream gradient only, which is silently wrong.
Each function here is an autograd Function whose backward is the conjugate collective:

=====================  ==============================  ===================================
forward                backward                        used by (Megatron-LM, Shoeybi 2019)
=====================  ==============================  ===================================
all_reduce (sum)       all_reduce (sum) of the grad    RowParallelLinear output ("g")
all_gather (dim)       reduce_scatter (sum) along dim  ColumnParallelLinear gather_output
reduce_scatter (dim)   all_gather along dim            sequence parallelism
=====================  ==============================  ===================================

Example (a plain collective has no backward, so the gradient would stay local): x = ones(3, requires_grad), y = all_reduce(x), loss = ((rank+1)*y).sum()
on 2 ranks gives x.grad = 3 = 1 + 2 on both ranks (a plain collective gives 1 or 2).

All are out of place: the input is not modified. Shapes: all_gather along ``dim`` multiplies that
dimension by W; reduce_scatter divides it by W (it must be divisible: ValueError otherwise).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import collectives as C

__all__ = ["all_reduce", "all_gather", "reduce_scatter", "gather_along", "reduce_scatter_along"]


def gather_along(x: torch.Tensor, dim: int, group=None, algorithm: str = "ring") -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (not differentiable; see :func:`all_gather`)."""
    world = dist.get_world_size(group)
    if world == 1:
        return x
    x = x.contiguous()
    pieces = [torch.empty_like(x) for _ in range(world)]
    C.all_gather(pieces, x, algorithm=algorithm, group=group)
    return torch.cat(pieces, dim=dim)


def reduce_scatter_along(x: torch.Tensor, dim: int, group=None, algorithm: str = "ring") -> torch.Tensor:
    """Sum ``x`` over ranks and keep this rank's slice of ``dim`` (not differentiable)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world == 1:
        return x
    if x.shape[dim] % world:
        raise ValueError(f"reduce_scatter (rank {rank}): dim {dim} has size {x.shape[dim]}, "
                         f"not divisible by the world size {world}")
    pieces = [p.contiguous() for p in x.chunk(world, dim=dim)]
    out = torch.empty_like(pieces[rank])
    C.reduce_scatter(out, pieces, op="sum", algorithm=algorithm, group=group)
    return out


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, algorithm):
        ctx.group, ctx.algorithm = group, algorithm
        return C.all_reduce(x.clone(), "sum", algorithm=algorithm, group=group)

    @staticmethod
    def backward(ctx, grad):
        return C.all_reduce(grad.clone(), "sum", algorithm=ctx.algorithm, group=ctx.group), None, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, algorithm):
        ctx.dim, ctx.group, ctx.algorithm = dim, group, algorithm
        return gather_along(x, dim, group, algorithm)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_along(grad, ctx.dim, ctx.group, ctx.algorithm), None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, algorithm):
        ctx.dim, ctx.group, ctx.algorithm = dim, group, algorithm
        return reduce_scatter_along(x, dim, group, algorithm)

    @staticmethod
    def backward(ctx, grad):
        return gather_along(grad, ctx.dim, ctx.group, ctx.algorithm), None, None, None


def all_reduce(x: torch.Tensor, group=None, algorithm: str = "ring") -> torch.Tensor:
    """Sum over ranks, differentiable: backward all-reduces the gradient (sum)."""
    return _AllReduce.apply(x, group, algorithm)


def all_gather(x: torch.Tensor, dim: int = -1, group=None, algorithm: str = "ring") -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (rank order); backward reduce-scatters (sum)."""
    return _AllGather.apply(x, dim, group, algorithm)


def reduce_scatter(x: torch.Tensor, dim: int = -1, group=None, algorithm: str = "ring") -> torch.Tensor:
    """Sum over ranks, keep slice ``rank`` of ``dim``; backward all-gathers along ``dim``."""
    return _ReduceScatter.apply(x, dim, group, algorithm)
