"""Tensor parallelism: Megatron-LM's f and g operators and the two parallel linear layers.

A column-parallel layer splits the weight's output features over the W ranks of the TP group: its
input must be replicated, so f (identity forward, all-reduce backward) leads into it, because each
rank's backward only sees its shard's part of dL/dx. A row-parallel layer splits the input
features: each rank computes a partial sum of the output, and g (all-reduce forward, identity
backward) sums them. Column then row (an MLP, attention) costs one f and one g.
Source: Shoeybi et al. 2019 (Megatron-LM) §3; megatron/core/tensor_parallel/mappings.py, layers.py.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def _all_reduce(x, group):
    x = x.contiguous().clone()   # a new tensor: autograd's inputs are never written in place
    dist.all_reduce(x, group=group)
    return x


class CopyToTensorParallelRegion(torch.autograd.Function):
    """f: identity forward, all-reduce (sum) of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class ReduceFromTensorParallelRegion(torch.autograd.Function):
    """g: all-reduce (sum) forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tensor_parallel_region(x, group=None):
    """f, at the input of a column-parallel layer."""
    return CopyToTensorParallelRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x, group=None):
    """g, at the output of a row-parallel layer."""
    return ReduceFromTensorParallelRegion.apply(x, group)


def _my_shard(full, dim, group):
    """This rank's contiguous 1/W of ``full`` along ``dim``."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    return nn.Parameter(full.chunk(world, dim)[rank].clone())


class ColumnParallelLinear(nn.Module):
    """``y_r = x A_r^T + b_r``: x ``[..., in]`` replicated -> ``[..., out/W]``, my output features.
    Built as the full ``nn.Linear`` (one process's initialisation); keeps rows ``r·out/W ..``."""

    def __init__(self, in_features, out_features, bias=True, group=None):
        super().__init__()
        full = nn.Linear(in_features, out_features, bias=bias)
        self.weight = _my_shard(full.weight.data, 0, group)
        self.bias = _my_shard(full.bias.data, 0, group) if bias else None
        self.group = group

    def forward(self, x):
        x = copy_to_tensor_parallel_region(x, self.group)   # f
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``y = sum_r x_r A_r^T + b``: x ``[..., in/W]``, my input features -> ``[..., out]`` replicated.
    Keeps columns ``r·in/W ..`` of the full ``nn.Linear``'s weight; the whole bias, added after g."""

    def __init__(self, in_features, out_features, bias=True, group=None):
        super().__init__()
        full = nn.Linear(in_features, out_features, bias=bias)
        self.weight = _my_shard(full.weight.data, 1, group)
        self.bias = nn.Parameter(full.bias.data.clone()) if bias else None
        self.group = group

    def forward(self, x):
        y = reduce_from_tensor_parallel_region(F.linear(x, self.weight), self.group)   # g
        return y + self.bias if self.bias is not None else y
