"""A small convolutional network for 8x8 digits, 28x28 MNIST or 32x32 CIFAR-10.

``SmallCNN(in_channels=1, num_classes=10, width=16, batchnorm=True)``: two 3x3 conv blocks
(conv → BatchNorm2d → ReLU), a global average pool, a Linear head. Input [B, C, H, W] of any
H, W ≥ 3; output logits [B, num_classes]. Its BatchNorm layers are what SyncBatchNorm replaces."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["SmallCNN"]


class SmallCNN(nn.Module):
    def __init__(self, in_channels: int = 1, num_classes: int = 10, width: int = 16,
                 batchnorm: bool = True):
        super().__init__()

        def block(cin, cout):
            norm = nn.BatchNorm2d(cout) if batchnorm else nn.Identity()
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), norm, nn.ReLU())

        self.features = nn.Sequential(block(in_channels, width), block(width, 2 * width))
        self.head = nn.Linear(2 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))
