"""The router of a mixture-of-experts layer: scores, top-k choice, capacity, dropping, aux losses.

``T`` tokens, ``E`` experts, ``k`` per token; all in fp32 (Switch §2.4). Ties go to the lower
expert index, so every process and reference chooses alike.
Design notes: docs/design/expert_parallel.md
"""

from __future__ import annotations

import math
from fractions import Fraction

import torch

__all__ = [
    "DROP_POLICIES",
    "expert_capacity",
    "keep_mask",
    "load_balancing_loss",
    "route",
    "z_loss",
]

DROP_POLICIES = ("position", "probs")


def route(logits: torch.Tensor, k: int, normalize: bool = False):
    """``logits [T, E]`` -> ``(probs [T, E], experts [T, k], weights [T, k])``; ``normalize``: weights
    sum to 1 per token. ``ValueError`` unless ``1 <= k <= E``."""
    E = logits.shape[-1]
    if not isinstance(k, int) or not 1 <= k <= E:
        raise ValueError(f"route: top_k must be an int in 1..{E} (the number of experts), got {k!r}")
    probs = logits.float().softmax(dim=-1)
    experts = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :k]
    weights = probs.gather(1, experts)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return probs, experts, weights


def expert_capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor) -> int:
    """``ceil(T · k · factor / E)``, exact (1.1 read as 11/10); ``ValueError`` for a factor <= 0."""
    f = Fraction(repr(float(capacity_factor)))
    if f <= 0:
        raise ValueError(f"expert_capacity: capacity_factor must be > 0, got {capacity_factor!r}")
    return math.ceil(Fraction(num_tokens * top_k) * f / num_experts)


def keep_mask(experts: torch.Tensor, probs_chosen: torch.Tensor, num_experts: int,
              capacity: int | None, policy: str = "position") -> torch.Tensor:
    """``[T, k]`` bool: the assignments within ``capacity`` (None: all), by ``policy`` "position" or
    "probs". ``ValueError`` for an unknown policy."""
    if policy not in DROP_POLICIES:
        raise ValueError(f"keep_mask: drop policy must be one of {DROP_POLICIES}, got {policy!r}")
    T, k = experts.shape
    if capacity is None:
        return torch.ones(T, k, dtype=torch.bool, device=experts.device)
    flat = experts.t().reshape(-1)                      # slot-major: (choice j, token t) at j*T + t
    if policy == "position":
        order = torch.arange(flat.numel(), device=flat.device)
    else:  # highest probability first; the stable sort keeps (choice, token) order among ties
        order = torch.sort(probs_chosen.t().reshape(-1), descending=True, stable=True).indices
    onehot = torch.nn.functional.one_hot(flat[order], num_experts)
    position = (onehot.cumsum(0) * onehot).sum(1) - 1     # place in its expert's queue
    kept = torch.empty_like(flat, dtype=torch.bool)
    kept[order] = position < capacity
    return kept.view(k, T).t()


def load_balancing_loss(probs: torch.Tensor, routed_counts: torch.Tensor, routed_total: int,
                        coeff: float) -> torch.Tensor:
    """``coeff · E · Σ_i f_i · P_i`` (Switch eq. 4-6), 0-dim fp32; ``f_i = routed_counts_i / routed_total``."""
    E = probs.shape[-1]
    f = routed_counts.to(torch.float32) / max(int(routed_total), 1)
    P = probs.float().mean(dim=0) if probs.shape[0] else probs.float().sum(dim=0)
    return coeff * E * (f * P).sum()


def z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """``coeff · mean_t (logsumexp_i logits[t, i])²`` (ST-MoE, Zoph et al. 2022, eq. 5)."""
    if logits.shape[0] == 0:
        return logits.float().sum() * 0.0
    return coeff * torch.logsumexp(logits.float(), dim=-1).square().mean()
