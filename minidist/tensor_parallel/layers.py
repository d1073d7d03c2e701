"""Tensor-parallel layers: ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding.

Megatron-LM (Shoeybi et al. 2019, §3). Each layer builds the full weight as ``nn.Linear`` /
``nn.Embedding`` would, then keeps its shard, and marks its parameters for :mod:`.sharding`.
Design notes: docs/design/tensor_parallel.md
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..comm.p2p import group_rank_world
from . import regions as R
from .sharding import pad_and_split

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "pad_to_multiple",
           "mark_parameter"]


def pad_to_multiple(n: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= ``n`` (vocabulary padding)."""
    return int(math.ceil(n / multiple) * multiple)


def mark_parameter(p: nn.Parameter, partition_dim=None, full_size=None, sequence_parallel=False):
    """Attach the TP metadata the sharding and gradient helpers read."""
    p.tensor_model_parallel = partition_dim is not None
    p.partition_dim = partition_dim
    p.full_size = full_size
    p.sequence_parallel = sequence_parallel
    return p


def _shard(full: torch.Tensor, dim: int, padded: int, group, what: str) -> nn.Parameter:
    return nn.Parameter(pad_and_split(full, dim, padded, group, what))


def _check_divisible(n: int, group, what: str, name: str) -> None:
    rank, world = group_rank_world(group)
    if n % world:
        raise ValueError(f"{what} (rank {rank}): {name}={n} is not divisible by the tensor-parallel "
                         f"size {world}")


class ColumnParallelLinear(nn.Module):
    """``Y = X A^T + b`` with the output features split: ``[..., in]`` -> ``[..., out/W]``.

    ``padded_out_features``: rows of the full weight (extra ones zero); ``gather_output``: all-gather
    to ``[..., out]``; ``sequence_parallel``: the input is ``[b, s/W, in]`` and is all-gathered."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 gather_output: bool = False, group=None, sequence_parallel: bool = False,
                 seq_dim: int = 1, padded_out_features: int | None = None):
        super().__init__()
        padded = padded_out_features or out_features
        if padded < out_features:
            raise ValueError(f"padded_out_features={padded} < out_features={out_features}")
        _check_divisible(padded, group, "ColumnParallelLinear", "out_features")
        self.in_features, self.out_features, self.padded_out_features = in_features, out_features, padded
        self.gather_output, self.group = gather_output, group
        self.sequence_parallel, self.seq_dim = sequence_parallel, seq_dim
        full = nn.Linear(in_features, out_features, bias=bias)  # same RNG calls as the reference
        self.weight = mark_parameter(_shard(full.weight.data, 0, padded, group, "ColumnParallelLinear"),
                                     0, out_features)
        if bias:
            self.bias = mark_parameter(_shard(full.bias.data, 0, padded, group, "ColumnParallelLinear"),
                                       0, out_features)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x = R.gather_from_sequence_parallel_region(x, self.group, self.seq_dim)
        else:
            x = R.copy_to_tensor_model_parallel_region(x, self.group)  # f
        y = F.linear(x, self.weight, self.bias)
        return R.gather_from_tensor_model_parallel_region(y, self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features} (local {self.weight.shape[0]}), "
                f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """``Y = X A^T + b`` with the input features split: ``[..., in/W]`` -> ``[..., out]``.

    ``input_is_parallel=False`` splits a full input here; ``sequence_parallel`` reduce-scatters
    the output to ``[b, s/W, out]``. The bias is replicated, added after the reduction."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 input_is_parallel: bool = True, group=None, sequence_parallel: bool = False,
                 seq_dim: int = 1):
        super().__init__()
        _check_divisible(in_features, group, "RowParallelLinear", "in_features")
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.group = input_is_parallel, group
        self.sequence_parallel, self.seq_dim = sequence_parallel, seq_dim
        full = nn.Linear(in_features, out_features, bias=bias)
        self.weight = mark_parameter(_shard(full.weight.data, 1, in_features, group, "RowParallelLinear"),
                                     1, in_features)
        if bias:
            self.bias = mark_parameter(nn.Parameter(full.bias.data.clone()),
                                       sequence_parallel=sequence_parallel)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = R.scatter_to_tensor_model_parallel_region(x, self.group)
        partial = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = R.reduce_scatter_to_sequence_parallel_region(partial, self.group, self.seq_dim)
        else:
            y = R.reduce_from_tensor_model_parallel_region(partial, self.group)  # g
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return (f"in={self.in_features} (local {self.weight.shape[1]}), out={self.out_features}, "
                f"input_is_parallel={self.input_is_parallel}, "
                f"sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(nn.Module):
    """Embedding split by vocabulary rows (padded to a multiple of W): ids ``[...]`` ->
    ``[..., embedding_dim]``. ``ValueError`` for ids outside ``[0, num_embeddings)``."""

    def __init__(self, num_embeddings: int, embedding_dim: int, group=None,
                 sequence_parallel: bool = False, seq_dim: int = 1):
        super().__init__()
        rank, world = group_rank_world(group)
        self.num_embeddings, self.embedding_dim, self.group = num_embeddings, embedding_dim, group
        self.sequence_parallel, self.seq_dim = sequence_parallel, seq_dim
        self.padded = pad_to_multiple(num_embeddings, world)
        per = self.padded // world
        self.vocab_start, self.vocab_end = rank * per, (rank + 1) * per
        full = nn.Embedding(num_embeddings, embedding_dim)  # N(0, 1), as the reference
        self.weight = mark_parameter(_shard(full.weight.data, 0, self.padded, group,
                                            "VocabParallelEmbedding"), 0, num_embeddings)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings):
            rank, _ = group_rank_world(self.group)
            raise ValueError(f"VocabParallelEmbedding (rank {rank}): ids must be in "
                             f"[0, {self.num_embeddings}), got min {int(ids.min())}, "
                             f"max {int(ids.max())}")
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        partial = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return R.reduce_scatter_to_sequence_parallel_region(partial, self.group, self.seq_dim)
        return R.reduce_from_tensor_model_parallel_region(partial, self.group)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings} (padded {self.padded}, local rows "
                f"{self.vocab_start}..{self.vocab_end}), {self.embedding_dim}, "
                f"sequence_parallel={self.sequence_parallel}")
