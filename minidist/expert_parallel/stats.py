"""Imbalance made visible: what one MoE forward routed, dropped, received and moved (this rank).
Design notes: docs/design/expert_parallel.md
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["MoEStats", "a2a_bytes_formula", "imbalance"]


@dataclass
class MoEStats:
    """``tokens`` T, ``routed [E]`` / ``kept [E]`` per expert, ``received [L]``, ``capacity``,
    ``send_splits``/``recv_splits``, ``a2a_bytes_sent``, ``expert_ids`` (all this rank's)."""

    tokens: int
    routed: torch.Tensor
    kept: torch.Tensor
    received: torch.Tensor
    capacity: int | None
    send_splits: list
    recv_splits: list
    a2a_bytes_sent: int
    expert_ids: list = field(default_factory=list)

    @property
    def dropped_fraction(self) -> float:
        """Share of this rank's T·k assignments dropped for capacity."""
        total = int(self.routed.sum())
        return 0.0 if total == 0 else 1.0 - int(self.kept.sum()) / total


def imbalance(tokens_per_expert) -> float:
    """max / mean of a count vector: 1.0 is perfect balance, E is everything on one expert."""
    t = torch.as_tensor(tokens_per_expert, dtype=torch.float64)
    return float(t.max() / t.mean()) if t.numel() and t.sum() > 0 else 1.0


def a2a_bytes_formula(send_splits, recv_splits, rank: int, num_experts: int, num_local: int,
                      width: int, element_size: int) -> int:
    """Bytes EP rank ``rank`` sends in one forward: count exchange + dispatch + combine."""
    rows_out = sum(n for j, n in enumerate(send_splits) if j != rank)
    rows_back = sum(n for j, n in enumerate(recv_splits) if j != rank)
    return 8 * (num_experts - num_local) + (rows_out + rows_back) * width * element_size
