"""Attention on one (query block, key block) pair with its log-sum-exp, and the merge of partial
results: the arithmetic ring attention and Ulysses share (no communication here).

Layout ``[b, heads, s, d]`` (torch's ``scaled_dot_product_attention``). For a block,
``S = q kᵀ · scale`` (masked), ``lse = log Σ_k exp S`` ``[b, h, s_q]`` and ``out = softmax(S) v``.
Two partial results over disjoint key sets merge exactly (Milakov & Gimelshein 2018, "Online
normalizer calculation for softmax"; Dao et al. 2022, FlashAttention §3.1)::

    lse = log(exp(lse_a) + exp(lse_b))                       # log-add-exp
    out = exp(lse_a - lse) · out_a + exp(lse_b - lse) · out_b

:func:`log_add_exp` writes the first line as ``m + log1p(exp(-|a - b|))`` with ``m = max(a, b)``:
no exponential of a large number is ever taken. :func:`naive_log_add_exp` is the form
``a + log(1 + exp(b - a))`` that overflows (``inf`` for a=0, b=100 in fp32) — kept to show it.

Grouped-query attention: ``k``/``v`` may have fewer heads than ``q`` (``h % h_kv == 0``); each
K/V head serves ``h / h_kv`` consecutive query heads.

Half precision (bf16, fp16) is computed in fp32 (scores, softmax, accumulators), as
FlashAttention does; :func:`compute_dtype` says which.
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
    """``log(exp(a) + exp(b))`` element-wise without overflow: ``max + log1p(exp(-|a - b|))``;
    ``-inf`` (an empty block) is the identity. Equal to ``torch.logaddexp``."""
    m = torch.maximum(a, b)
    m_safe = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)
    d = -(a - b).abs()
    d = torch.where(torch.isnan(d), torch.full_like(d, -math.inf), d)   # both -inf
    return torch.where(torch.isinf(m) & (m < 0), m, m_safe + torch.log1p(torch.exp(d)))


def naive_log_add_exp(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The unstable form ``a + log(1 + exp(b - a))``: ``exp(b - a)`` overflows once ``b - a`` is
    above ~88.7 in fp32 (~709 in fp64). Do not use; it is here to be shown failing."""
    return a + torch.log(1 + torch.exp(b - a))


def _finite(x: torch.Tensor) -> torch.Tensor:
    """``-inf`` (a query that saw no key yet) replaced by 0, so ``exp(s - lse)`` stays 0, not nan."""
    return torch.where(torch.isinf(x) & (x < 0), torch.zeros_like(x), x)


def merge(out_a, lse_a, out_b, lse_b):
    """Merge two partial attention results over disjoint keys: ``(out, lse)``. ``out``
    ``[b, h, s, d]``, ``lse`` ``[b, h, s]``, same dtype. Either may be empty-handed (lse -inf)."""
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
    """``(out, lse)`` of queries ``q`` ``[b, h, s_q, d]`` on one key block ``k``/``v``
    ``[b, h_kv, s_k, d]`` in the compute dtype; ``kind`` from
    :func:`~minidist.context_parallel.sharding.block_kind` (``"diagonal"``: the causal mask by
    global positions ``q_pos``/``k_pos``). A query row with no visible key gets lse ``-inf``, out 0."""
    s = _scores(q, k, q_pos, k_pos, kind, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - _finite(lse).unsqueeze(-1))
    return p @ expand_kv(v, q.shape[1]), lse


def block_backward(q, k, v, do, lse, delta, q_pos, k_pos, kind: str, scale: float):
    """Gradients of one block given the *global* ``lse`` and ``delta = Σ_d dO·O`` ``[b, h, s_q]``
    (FlashAttention-2, Dao 2023, Algorithm 2): ``P = exp(S - lse)``, ``dV = Pᵀ dO``,
    ``dS = P ∘ (dO Vᵀ - delta)``, ``dQ = dS K · scale``, ``dK = dSᵀ Q · scale``.
    Returns ``(dq, dk, dv)``; ``dk``/``dv`` with ``k``'s head count."""
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
    """One process, the whole sequence, plain autograd: ``(out, lse)`` — the reference the
    parallel versions are tested against. ``[b, h, S, d]``; ``k``/``v`` may have fewer heads."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = (q @ expand_kv(k, q.shape[1]).transpose(-2, -1)) * scale
    if causal:
        n = q.shape[2]
        s = s.masked_fill(~torch.ones(n, k.shape[2], dtype=torch.bool, device=q.device).tril(),
                          -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    return torch.softmax(s, dim=-1) @ expand_kv(v, q.shape[1]), lse
