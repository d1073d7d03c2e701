"""Attention on one (query block, key block) pair with its log-sum-exp, and the exact merge of
partial results (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022, §3.1).

Layout ``[b, heads, s, d]``; K/V may have fewer heads (grouped-query); bf16/fp16 computed in fp32.
Design notes: docs/design/context_parallel.md
"""

from __future__ import annotations

import math

import torch

__all__ = ["log_add_exp", "naive_log_add_exp", "merge", "block_forward", "block_backward",
           "compute_dtype", "expand_kv", "reduce_kv", "attention_reference"]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for bf16/fp16 inputs, else the input's own dtype (fp32, fp64)."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def log_add_exp(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``log(exp(a) + exp(b))`` without overflow (``-inf`` is the identity), as ``torch.logaddexp``."""
    m = torch.maximum(a, b)
    m_safe = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)
    d = -(a - b).abs()
    d = torch.where(torch.isnan(d), torch.full_like(d, -math.inf), d)   # both -inf
    return torch.where(torch.isinf(m) & (m < 0), m, m_safe + torch.log1p(torch.exp(d)))


def naive_log_add_exp(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The unstable ``a + log(1 + exp(b - a))``, kept to be shown failing."""
    return a + torch.log(1 + torch.exp(b - a))


def _finite(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isinf(x) & (x < 0), torch.zeros_like(x), x)


def merge(out_a, lse_a, out_b, lse_b):
    """Merge two partial results over disjoint keys: ``(out [b, h, s, d], lse [b, h, s])``."""
    lse = log_add_exp(lse_a, lse_b)
    wa = torch.exp(lse_a - _finite(lse)).unsqueeze(-1)
    wb = torch.exp(lse_b - _finite(lse)).unsqueeze(-1)
    return wa * out_a + wb * out_b, lse


def expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """K or V ``[b, h_kv, s, d]`` repeated to ``[b, heads, s, d]`` (grouped-query attention)."""
    h_kv = x.shape[1]
    if h_kv == heads:
        return x
    if heads % h_kv:
        raise ValueError(f"context_parallel: {heads} query heads are not a multiple of the "
                         f"{h_kv} key/value heads")
    return x.repeat_interleave(heads // h_kv, dim=1)


def reduce_kv(dx: torch.Tensor, h_kv: int) -> torch.Tensor:
    """The adjoint of :func:`expand_kv`: ``[b, heads, s, d]`` summed back to ``[b, h_kv, s, d]``."""
    b, heads, s, d = dx.shape
    if heads == h_kv:
        return dx
    return dx.view(b, h_kv, heads // h_kv, s, d).sum(2)


def _scores(q, k, q_pos, k_pos, kind, scale):
    s = (q @ expand_kv(k, q.shape[1]).transpose(-2, -1)) * scale
    if kind == "diagonal":
        mask = k_pos.view(1, -1) <= q_pos.view(-1, 1)
        s = s.masked_fill(~mask.to(s.device), -math.inf)
    return s


def block_forward(q, k, v, q_pos, k_pos, kind: str, scale: float):
    """``(out, lse)`` of ``q`` ``[b, h, s_q, d]`` on one block ``k``/``v`` ``[b, h_kv, s_k, d]``;
    ``kind`` from :func:`.sharding.block_kind`. A row with no visible key: lse ``-inf``, out 0."""
    s = _scores(q, k, q_pos, k_pos, kind, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - _finite(lse).unsqueeze(-1))
    return p @ expand_kv(v, q.shape[1]), lse


def block_backward(q, k, v, do, lse, delta, q_pos, k_pos, kind: str, scale: float):
    """``(dq, dk, dv)`` of one block from the global ``lse`` and ``delta = Σ dO·O``
    (FlashAttention-2, Dao 2023, Algorithm 2)."""
    h, h_kv = q.shape[1], k.shape[1]
    s = _scores(q, k, q_pos, k_pos, kind, scale)
    p = torch.exp(s - _finite(lse).unsqueeze(-1))
    ke, ve = expand_kv(k, h), expand_kv(v, h)
    dv = p.transpose(-2, -1) @ do
    ds = p * (do @ ve.transpose(-2, -1) - delta.unsqueeze(-1))
    dq = (ds @ ke) * scale
    dk = (ds.transpose(-2, -1) @ q) * scale
    return dq, reduce_kv(dk, h_kv), reduce_kv(dv, h_kv)


def attention_reference(q, k, v, causal: bool = True, scale: float | None = None):
    """One process, plain autograd: ``(out, lse)`` over ``[b, h, S, d]`` (the tests' reference)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = (q @ expand_kv(k, q.shape[1]).transpose(-2, -1)) * scale
    if causal:
        n = q.shape[2]
        s = s.masked_fill(~torch.ones(n, k.shape[2], dtype=torch.bool, device=q.device).tril(),
                          -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    return torch.softmax(s, dim=-1) @ expand_kv(v, q.shape[1]), lse
