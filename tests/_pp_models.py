"""The pipeline tests' model: 8 × (Linear(width, width), Tanh), seeded, so that every schedule
(GPipe, 1F1B, interleaved, zero-bubble) splits the same layers (test_pp_engine,
test_pp_zero_bubble_engine)."""

import torch
from torch import nn


def make_model(width: int = 6, blocks: int = 8) -> nn.Sequential:
    torch.manual_seed(0)
    layers = []
    for _ in range(blocks):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers)
