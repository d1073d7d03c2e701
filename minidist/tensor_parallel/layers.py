"""Tensor-parallel layers: ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding.

Megatron-LM (Shoeybi et al. 2019, §3). ``Y = X A`` with ``A`` split by columns ``[A_1 .. A_W]``:
rank r computes ``X A_r`` (its slice of Y's last dimension) — a *column-parallel* layer, whose
input must be replicated and whose input gradient is a partial sum (f all-reduces it). With ``A``
split by rows and ``X`` split by columns, rank r computes the partial sum ``X_r A_r`` and g
all-reduces: a *row-parallel* layer. Column then row (an MLP, attention) needs one f and one g.

Initialisation: each layer builds the *full* weight exactly as ``torch.nn.Linear`` /
``torch.nn.Embedding`` would (same calls on the global generator, in the same order), then keeps
its shard. So a TP model and the single-process model built after the same ``torch.manual_seed``
hold the same full weights (Megatron's ``_initialize_affine_weight_cpu``). Every rank of the TP
group must construct with the same seed.

Each parameter carries ``tensor_model_parallel`` (bool), ``partition_dim`` (0 or 1, or None when
replicated), ``full_size`` (the unpadded size along that dimension) and ``sequence_parallel``
(True when its gradient is partial over sequence shards and must be all-reduced, see
:func:`minidist.tensor_parallel.sequence.allreduce_sequence_parallel_grads`); the sharding helpers
in :mod:`.sharding` read them.
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
    """``Y = X A^T + b`` with the output features split across the TP group.

    Args:
        in_features, out_features: sizes of the full layer (``out_features`` divisible by the TP
            size, unless ``padded_out_features`` is given: the full weight gets that many rows,
            the extra ones zero, e.g. a vocabulary padded to a multiple of the TP size).
        gather_output: all-gather the output so every rank holds the full Y; else Y's shard.
        sequence_parallel: the input is a sequence shard ``[b, s/W, in]``: all-gather it (instead
            of f), and reduce-scatter its gradient in backward.
        group: the TP process group (default: the world).

    Shapes: input ``[..., in_features]`` replicated; output ``[..., out_local]`` with
    ``out_local = out/W`` (or ``[..., out]`` with ``gather_output``). Weight shard
    ``[out/W, in]`` = rows ``r·out/W .. (r+1)·out/W`` of the full weight.
    """

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
    """``Y = X A^T + b`` with the input features split across the TP group.

    Args:
        in_features (divisible by the TP size), out_features: sizes of the full layer.
        input_is_parallel: the input already is this rank's shard ``[..., in/W]`` (the output of a
            ColumnParallelLinear); else the full input is split here.
        sequence_parallel: reduce-scatter the partial outputs along ``seq_dim`` (instead of g), so
            each rank ends with a sequence shard; the bias is then marked ``sequence_parallel``.

    Shapes: output ``[..., out]`` replicated (or ``[b, s/W, out]`` with sequence parallelism).
    Weight shard ``[out, in/W]``; the bias is replicated and added after the reduction.
    """

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
    """Embedding table split by rows (vocabulary) across the TP group.

    The vocabulary is padded to a multiple of the TP size with zero rows (never looked up). Rank
    r owns ids ``[r·Vp/W, (r+1)·Vp/W)``: it looks up those, writes zeros for the others, and g
    all-reduces (or, with ``sequence_parallel``, reduce-scatters along ``seq_dim``).

    Shapes: ids ``[...]`` (int64, in ``[0, num_embeddings)``: ``ValueError`` otherwise) ->
    ``[..., embedding_dim]``. Weight shard ``[Vp/W, embedding_dim]``.
    """

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
