"""Tiny models used by the lessons and the tests: an MLP and a CNN (GPT lives in models/gpt.py).

``resnet18`` for the DDP benchmark comes from torchvision (``torchvision.models.resnet18``)."""

from . import cnn, mlp
from .cnn import SmallCNN
from .mlp import MLP

__all__ = ["cnn", "mlp", "SmallCNN", "MLP"]
