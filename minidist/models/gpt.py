"""A tiny character-level GPT in plain PyTorch, nanoGPT-style: the single-process reference.

Pre-LayerNorm blocks as GPT-2 / nanoGPT; head untied unless ``GPTConfig(tie_embeddings=True)``.
Shapes: ids ``[b, s]`` (s <= block_size) -> logits ``[b, s, V]``. The fused QKV rows are laid out
``[head][q|k|v][head_dim]`` (Megatron-LM), so a column split hands each rank whole heads;
:class:`minidist.tensor_parallel.gpt.TPGPT` reuses :func:`causal_attention` and :class:`Block`."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTConfig", "GPT", "Block", "CausalSelfAttention", "MLP", "causal_attention"]


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 96
    block_size: int = 32
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 32
    dropout: float = 0.0        # embedding and residual dropout
    attn_dropout: float = 0.0   # dropout on the attention probabilities
    tie_embeddings: bool = False  # head.weight is tok_emb.weight (Press & Wolf 2017; GPT-2)


def causal_attention(qkv: torch.Tensor, n_head: int, head_dim: int,
                     attn_drop: nn.Module | None = None) -> torch.Tensor:
    """Causal softmax attention (Vaswani et al. 2017, §3.2) of the ``n_head`` heads in ``qkv``.

    ``qkv``: ``[b, s, n_head · 3 · head_dim]``, laid out ``[head][q|k|v][head_dim]``; returns
    ``[b, s, n_head · head_dim]``. ``attn_drop`` applies to the probabilities."""
    b, s, _ = qkv.shape
    q, k, v = qkv.view(b, s, n_head, 3, head_dim).permute(3, 0, 2, 1, 4)   # each [b, nh, s, hd]
    att = (q @ k.transpose(-2, -1)) / math.sqrt(head_dim)
    causal = torch.ones(s, s, dtype=torch.bool, device=qkv.device).tril()
    att = att.masked_fill(~causal, float("-inf")).softmax(dim=-1)
    if attn_drop is not None:
        att = attn_drop(att)
    return (att @ v).transpose(1, 2).reshape(b, s, n_head * head_dim)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.n_embd // cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)   # rows: [head][q|k|v][head_dim]
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.attn_drop = nn.Dropout(cfg.attn_dropout)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        y = causal_attention(self.qkv(x), self.n_head, self.head_dim, self.attn_drop)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.fc2 = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        return self.drop(self.fc2(F.gelu(self.fc1(x))))


class Block(nn.Module):
    """``x + attn(ln1(x))``, then ``+ mlp(ln2(x))``; ``attn`` and ``mlp`` default to the plain ones."""

    def __init__(self, cfg: GPTConfig, attn: nn.Module | None = None, mlp: nn.Module | None = None):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = attn if attn is not None else CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = mlp if mlp is not None else MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """The single-process reference. ``forward(ids, targets=None) -> (logits, loss or None)``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"GPT: n_embd={cfg.n_embd} is not divisible by n_head={cfg.n_head}")
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:  # one parameter; drawn after the head's, so the RNG calls match
            self.head.weight = self.tok_emb.weight

    def forward(self, ids, targets=None, label_smoothing: float = 0.0):
        s = ids.shape[1]
        if s > self.cfg.block_size:
            raise ValueError(f"GPT: sequence length {s} exceeds block_size {self.cfg.block_size}")
        x = self.drop(self.tok_emb(ids) + self.pos_emb(torch.arange(s, device=ids.device)))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                               label_smoothing=label_smoothing)
        return logits, loss
