"""The tensor-parallel MLP block (Megatron-LM, Shoeybi et al. 2019, §3, Fig. 3a).

``Y = dropout(GeLU(X A) B)``: A is split by columns (ColumnParallelLinear, f on its input), so each
rank applies GeLU to its own slice with no communication — GeLU is elementwise, which is why A is
split by columns and not rows — then B is split by rows (RowParallelLinear, g on its output).
One all-reduce forward (g), one backward (f).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from . import accounting
from .layers import ColumnParallelLinear, RowParallelLinear
from .random import Dropout

__all__ = ["ParallelMLP"]


class ParallelMLP(nn.Module):
    """``[b, s, h] -> [b, s, h]`` (sequence shards ``[b, s/W, h]`` with ``sequence_parallel``).

    ``ffn_hidden`` must be divisible by the TP size. Parameter names (``fc1``, ``fc2``) match the
    single-process ``minidist.models.gpt.MLP``.
    """

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
