"""The router of a mixture-of-experts layer: scores, top-k choice, capacity, dropping, aux losses.

Shapes: ``T`` tokens (batch x sequence flattened), ``h`` the model width, ``E`` experts, ``k``
experts per token. Everything here runs in fp32 whatever the model's dtype: the router's softmax
decides which expert a token goes to. Switch Transformer (Fedus et al. 2021, §2.4 "selective
precision") computes the router in fp32 because a bf16 router trained unstably; ST-MoE (Zoph et
al. 2022, §3.4) shows bf16 roundoff in the router's exponentials changing the routing.

* :func:`route` — logits → softmax → top-k. **Ties go to the lower expert index** (a stable
  descending sort), so every process and every reference makes the same choice.
* :func:`expert_capacity` — ``ceil(T · k · capacity_factor / E)``, rounded **up**: the formula of
  Megatron-LM's ``get_capacity`` (``megatron/core/transformer/moe/moe_utils.py``). minidist
  computes it exactly (the factor is read as the decimal it prints as, so 1.1 is 11/10): 100
  tokens over 2 experts at 1.1 is 55 rows. Megatron-LM computes it in floats,
  ``ceil((100/2)·1.1)``, and gets 56.
* :func:`keep_mask` — which (token, choice) assignments fit. ``"position"`` (GShard, Lepikhin et
  al. 2020, Algorithm 1): all first choices in token order, then all second choices. (Megatron's
  ``moe_token_drop_policy="position"`` differs for k > 1: it keeps each expert's earliest tokens,
  first and second choices alike.) ``"probs"`` (Megatron's default policy): highest router
  probability first, ties by the same (choice, token) order.
* :func:`load_balancing_loss` — Switch/GShard ``α · E · Σ_i f_i · P_i`` with ``f_i`` the fraction of
  the ``T·k`` assignments routed to expert i (before dropping, as Megatron-LM's
  ``switch_load_balancing_loss_func``) and ``P_i`` the mean router probability of expert i.
* :func:`z_loss` — ST-MoE's router z-loss (Zoph et al. 2022, §3.3, eq. 5):
  ``coeff · mean_t logsumexp²``.
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
    """``logits [T, E]`` → ``(probs [T, E] fp32, experts [T, k] int64, weights [T, k] fp32)``.

    ``experts[t, j]`` is token t's j-th choice; ties in probability go to the lower expert index.
    ``weights`` are the chosen probabilities, renormalised to sum to 1 per token if ``normalize``
    (Mixtral, GShard top-2); else the raw softmax probabilities (Switch; Megatron-core with
    ``moe_router_pre_softmax=True``). Megatron-core's default (``moe_router_pre_softmax=False``)
    takes the top-k of the logits and softmaxes over those k: the ``normalize=True`` weights, up to
    rounding (``topk_routing_with_score_function`` in ``megatron/core/transformer/moe/moe_utils.py``;
    ``topk_softmax_with_capacity`` before core_v0.14).

    Raises:
        ValueError: ``k`` not in ``1..E``.
    """
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
    """Tokens one expert accepts from ``num_tokens`` tokens: ``ceil(T · k · factor / E)``.

    Megatron-LM's ``moe_utils.get_capacity(num_tokens * topk, num_experts, capacity_factor)``
    computes the same formula in floats, ``ceil((T·k / E) · factor)``, and can round up once too
    often: T=100, E=2, factor 1.1 gives 56 there, since ``50 * 1.1`` is 55.00000000000001. This is
    the exact value (rational arithmetic on the factor's decimal repr, rounded up): 55. Raises
    ValueError for a factor <= 0.
    """
    f = Fraction(repr(float(capacity_factor)))
    if f <= 0:
        raise ValueError(f"expert_capacity: capacity_factor must be > 0, got {capacity_factor!r}")
    return math.ceil(Fraction(num_tokens * top_k) * f / num_experts)


def keep_mask(experts: torch.Tensor, probs_chosen: torch.Tensor, num_experts: int,
              capacity: int | None, policy: str = "position") -> torch.Tensor:
    """``[T, k]`` bool: which assignments an expert of capacity ``capacity`` accepts.

    ``capacity=None``: dropless, all True. The priority order is described in the module text;
    an assignment is kept iff fewer than ``capacity`` assignments to the same expert come before
    it. Raises ValueError for an unknown policy.
    """
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
    """``coeff · E · Σ_i f_i · P_i`` (Switch Transformer eq. 4–6), a 0-dim fp32 tensor.

    ``probs [T, E]``: this process's router probabilities (``P_i`` is their mean over its ``T``
    tokens; the gradient flows through it). ``routed_counts [E]``: assignments per expert before
    dropping, over the tokens the statistic is taken on (this rank's, or summed over a group);
    ``routed_total``: their number (``T·k`` summed the same way), so ``f_i = counts_i / total``.
    """
    E = probs.shape[-1]
    f = routed_counts.to(torch.float32) / max(int(routed_total), 1)
    P = probs.float().mean(dim=0) if probs.shape[0] else probs.float().sum(dim=0)
    return coeff * E * (f * P).sum()


def z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """``coeff · mean_t (logsumexp_i logits[t, i])²`` (ST-MoE, Zoph et al. 2022, eq. 5)."""
    if logits.shape[0] == 0:
        return logits.float().sum() * 0.0
    return coeff * torch.logsumexp(logits.float(), dim=-1).square().mean()
