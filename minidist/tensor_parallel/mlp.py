"""The tensor-parallel MLP (Megatron-LM, Shoeybi et al. 2019, §3, Fig. 3a): column then row.
Design notes: docs/design/tensor_parallel.md
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from . import accounting
from .layers import ColumnParallelLinear, RowParallelLinear
from .random import Dropout

__all__ = ["ParallelMLP"]


class ParallelMLP(nn.Module):
    """``[b, s, h] -> [b, s, h]`` (``[b, s/W, h]`` with ``sequence_parallel``); W divides ``ffn_hidden``."""

    def __init__(self, hidden: int, ffn_hidden: int, dropout: float = 0.0, group=None,
                 sequence_parallel: bool = False):
        super().__init__()
        self.fc1 = ColumnParallelLinear(hidden, ffn_hidden, group=group,
                                        sequence_parallel=sequence_parallel)
        self.fc2 = RowParallelLinear(ffn_hidden, hidden, input_is_parallel=True, group=group,
                                     sequence_parallel=sequence_parallel)
        self.drop = Dropout(dropout, "replicated", group, sequence_parallel)

    def forward(self, x):
        with accounting.scope("mlp"):
            return self.drop(self.fc2(F.gelu(self.fc1(x))))
