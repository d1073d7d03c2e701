"""A small multilayer perceptron for the digits (64 inputs, 10 classes) and for tests.

``MLP(in_features=64, hidden=(64,), num_classes=10)``: Linear → ReLU per hidden width, then a Linear
head. Input [B, in_features] (or any [B, ...] that flattens to it); output logits [B, num_classes].
``batchnorm=True`` puts a BatchNorm1d after each hidden Linear (the SyncBatchNorm lesson converts it)."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["MLP"]


class MLP(nn.Module):
    def __init__(self, in_features: int = 64, hidden: tuple[int, ...] | int = (64,),
                 num_classes: int = 10, batchnorm: bool = False):
        super().__init__()
        hidden = (hidden,) if isinstance(hidden, int) else tuple(hidden)
        layers: list[nn.Module] = []
        width = in_features
        for h in hidden:
            layers.append(nn.Linear(width, h))
            if batchnorm:
                layers.append(nn.BatchNorm1d(h))
            layers.append(nn.ReLU())
            width = h
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.flatten(1))
