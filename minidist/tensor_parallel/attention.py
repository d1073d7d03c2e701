"""Tensor-parallel causal self-attention (Megatron-LM, Shoeybi et al. 2019, §3, Fig. 3b).

Each rank computes ``n_head / W`` whole heads: QKV column-parallel, output projection row-parallel.
Design notes: docs/design/tensor_parallel.md
"""

from __future__ import annotations

import torch
from torch import nn

from ..comm.p2p import group_rank_world
from ..models.gpt import causal_attention
from . import accounting
from .layers import ColumnParallelLinear, RowParallelLinear
from .random import Dropout

__all__ = ["ParallelSelfAttention"]


class ParallelSelfAttention(nn.Module):
    """``[b, s, h] -> [b, s, h]`` causal attention with the heads split across the TP group.

    Raises ``ValueError`` naming the rank unless W divides ``n_head`` and ``n_head`` divides ``hidden``."""

    def __init__(self, hidden: int, n_head: int, attn_dropout: float = 0.0,
                 resid_dropout: float = 0.0, group=None, sequence_parallel: bool = False):
        super().__init__()
        rank, world = group_rank_world(group)
        if hidden % n_head:
            raise ValueError(f"ParallelSelfAttention (rank {rank}): hidden={hidden} is not "
                             f"divisible by n_head={n_head}")
        if n_head % world:
            raise ValueError(f"ParallelSelfAttention (rank {rank}): n_head={n_head} is not divisible "
                             f"by the tensor-parallel size {world}: heads cannot be split across "
                             f"ranks; choose a TP size that divides {n_head}")
        self.n_head, self.local_heads, self.head_dim = n_head, n_head // world, hidden // n_head
        self.qkv = ColumnParallelLinear(hidden, 3 * hidden, group=group,
                                        sequence_parallel=sequence_parallel)
        self.proj = RowParallelLinear(hidden, hidden, input_is_parallel=True, group=group,
                                      sequence_parallel=sequence_parallel)
        self.attn_drop = Dropout(attn_dropout, "model-parallel", group)
        self.resid_drop = Dropout(resid_dropout, "replicated", group, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with accounting.scope("attn"):
            # the single-process model's attention on this rank's heads: [b, s, 3·h/W] -> [b, s, h/W]
            y = causal_attention(self.qkv(x), self.local_heads, self.head_dim, self.attn_drop)
            return self.resid_drop(self.proj(y))
