"""The GPT's causal self-attention on a context-parallel group (used by :mod:`minidist.hybrid`).

ParallelSelfAttention's layout, with ring or Ulysses attention over the CP group: ``[b, S/cp, h]``
in and out (with sequence parallelism ``[b, S/(cp·tp), h]``). Attention-probability dropout is not supported under CP (``ValueError``).
Design notes: docs/design/context_parallel.md
"""

from __future__ import annotations

import torch

from ..tensor_parallel import accounting
from ..tensor_parallel.attention import ParallelSelfAttention
from ..comm.p2p import group_rank_world
from .ring import ring_attention
from .ulysses import ulysses_attention

__all__ = ["ContextParallelSelfAttention"]


class ContextParallelSelfAttention(ParallelSelfAttention):
    """``ParallelSelfAttention`` whose attention is ring (or Ulysses) attention over ``cp_group``."""

    METHODS = {"ring": ring_attention, "ulysses": ulysses_attention}

    def __init__(self, hidden: int, n_head: int, attn_dropout: float = 0.0,
                 resid_dropout: float = 0.0, group=None, sequence_parallel: bool = False,
                 cp_group=None, split: str = "zigzag", method: str = "ring"):
        rank, world = group_rank_world(cp_group)
        if method not in self.METHODS:
            raise ValueError(f"ContextParallelSelfAttention (CP rank {rank} of {world}): method "
                             f"must be one of {sorted(self.METHODS)}, got {method!r}")
        if attn_dropout:
            raise ValueError(f"ContextParallelSelfAttention (CP rank {rank} of {world}): "
                             f"attention dropout ({attn_dropout}) is not supported with context "
                             "parallelism; set attn_dropout=0")
        super().__init__(hidden, n_head, attn_dropout, resid_dropout, group, sequence_parallel)
        self.cp_group, self.split, self.method = cp_group, split, method

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with accounting.scope("attn"):
            qkv = self.qkv(x)                                   # [b, s, 3·h/tp]
            b, s, _ = qkv.shape
            q, k, v = qkv.view(b, s, self.local_heads, 3, self.head_dim).permute(3, 0, 2, 1, 4)
            _, world = group_rank_world(self.cp_group)
            y, _ = self.METHODS[self.method](q, k, v, self.cp_group, self.split, s * world,
                                             causal=True)
            y = y.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim)
            return self.resid_drop(self.proj(y))
