"""Position information under a sequence split: every token keeps its global position.

:func:`rotary` (RoFormer, Su et al. 2021, §3.4; GPT-NeoX layout) and :func:`learned`.
Design notes: docs/design/context_parallel.md
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["rotary", "learned"]


def rotary(x: torch.Tensor, pos: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotate ``x`` ``[b, h, s, d]`` (``d`` even) by positions ``pos`` ``[s]`` (fp64 inside)."""
    d = x.shape[-1]
    if d % 2:
        raise ValueError(f"rotary: head_dim must be even, got {d}")
    if pos.numel() != x.shape[-2]:
        raise ValueError(f"rotary: {pos.numel()} positions for a sequence of {x.shape[-2]}")
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float64, device=x.device) / d)
    ang = pos.to(device=x.device, dtype=torch.float64).unsqueeze(-1) * inv        # [s, d/2]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def learned(table: nn.Embedding, pos: torch.Tensor) -> torch.Tensor:
    """``table(pos)`` ``[s, h]`` with a clear error when a position is past the table."""
    if pos.numel() and int(pos.max()) >= table.num_embeddings:
        raise ValueError(f"learned positions: position {int(pos.max())} is past the table of "
                         f"{table.num_embeddings} (block_size)")
    return table(pos.to(table.weight.device))
