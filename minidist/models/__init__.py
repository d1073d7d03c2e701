"""Tiny models used by the lessons and the tests: an MLP and a CNN (GPT lives in models/gpt.py).

``resnet18`` for the DDP benchmark comes from torchvision (``torchvision.models.resnet18``).
"""

from . import cnn, mlp  # noqa: F401
from .cnn import SmallCNN  # noqa: F401
from .mlp import MLP  # noqa: F401
