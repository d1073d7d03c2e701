"""A tiny character-level GPT: the single-process reference and its tensor-parallel twin.

``GPT`` is plain PyTorch (nn.Linear, nn.Embedding, F.cross_entropy): the reference every TP test
compares with. ``TPGPT`` is the same network built from :mod:`minidist.tensor_parallel`
(VocabParallelEmbedding, ParallelSelfAttention, ParallelMLP, a vocabulary-parallel head and
vocab-parallel cross-entropy), optionally with sequence parallelism. Both have the same parameter
names and, built after the same ``torch.manual_seed``, the same full weights; so
``gather_state_dict(tp_model)`` can be compared with ``gpt.state_dict()`` key by key.

Dropout in both models draws its masks from :mod:`minidist.tensor_parallel.random` (call
``model_parallel_seed(seed)`` first when dropout is on), so the residual dropout of a TP model
drops the same elements as the single-process one. Both are built on the CPU; move them with
``.to(minidist.env.device())``.

Pre-LayerNorm blocks as GPT-2 (Radford et al. 2019) / nanoGPT; the head is not tied to the
embedding; PyTorch's default initialisation. Shapes: ids ``[b, s]`` (s <= block_size) ->
logits ``[b, s, V]`` (TPGPT: this rank's ``[b, s, Vp/W]`` with Vp the padded vocabulary).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..tensor_parallel import accounting, regions as R
from ..tensor_parallel.attention import ParallelSelfAttention
from ..tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from ..tensor_parallel.layers import (ColumnParallelLinear, VocabParallelEmbedding, mark_parameter,
                                      pad_to_multiple)
from ..tensor_parallel.mlp import ParallelMLP
from ..tensor_parallel.random import Dropout
from ..tensor_parallel.sequence import allreduce_sequence_parallel_grads, mark_sequence_parallel

__all__ = ["GPTConfig", "GPT", "TPGPT"]


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 96
    block_size: int = 32
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 32
    dropout: float = 0.0        # embedding and residual dropout ("replicated" region under TP)
    attn_dropout: float = 0.0   # attention-probability dropout ("model-parallel" region)


# ------------------------------------------------------------------ single-process reference
class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.n_embd // cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)   # rows: [head][q|k|v][head_dim]
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.attn_drop = Dropout(cfg.attn_dropout, "model-parallel")
        self.resid_drop = Dropout(cfg.dropout, "replicated")

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, self.n_head, 3, self.head_dim).permute(3, 0, 2, 1, 4)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        att = self.attn_drop(att.masked_fill(~causal, float("-inf")).softmax(dim=-1))
        return self.resid_drop(self.proj((att @ v).transpose(1, 2).reshape(b, s, h)))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.fc2 = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.drop = Dropout(cfg.dropout, "replicated")

    def forward(self, x):
        return self.drop(self.fc2(F.gelu(self.fc1(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, attn=None, mlp=None):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = attn if attn is not None else CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = mlp if mlp is not None else MLP(cfg)

    def forward(self, x, name="block"):
        with accounting.scope(f"{name}.attn"):
            x = x + self.attn(self.ln1(x))
        with accounting.scope(f"{name}.mlp"):
            return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """The single-process reference. ``forward(ids, targets=None) -> (logits, loss or None)``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = Dropout(cfg.dropout, "replicated")
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, ids, targets=None, label_smoothing: float = 0.0):
        s = ids.shape[1]
        if s > self.cfg.block_size:
            raise ValueError(f"GPT: sequence length {s} exceeds block_size {self.cfg.block_size}")
        x = self.drop(self.tok_emb(ids) + self.pos_emb(torch.arange(s, device=ids.device)))
        for i, block in enumerate(self.blocks):
            x = block(x, f"block{i}")
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                               label_smoothing=label_smoothing)
        return logits, loss


# ------------------------------------------------------------------ tensor-parallel twin
class TPGPT(nn.Module):
    """:class:`GPT` split over the TP ``group`` (default: the world), Megatron-style.

    With ``sequence_parallel=True`` the LayerNorms, dropouts and residual stream work on sequence
    shards (``s`` must be divisible by the TP size) and, after ``loss.backward()``, you must call
    :meth:`finish_grads` (it all-reduces the partial gradients of those regions' parameters).
    """

    def __init__(self, cfg: GPTConfig, group=None, sequence_parallel: bool = False):
        super().__init__()
        self.cfg, self.group, self.sequence_parallel = cfg, group, sequence_parallel
        sp = sequence_parallel
        self.tp_rank, world = R.tp_rank_world(group)
        self.tp_size = world
        self.padded_vocab = pad_to_multiple(cfg.vocab_size, world)
        self.tok_emb = VocabParallelEmbedding(cfg.vocab_size, cfg.n_embd, group, sp)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        mark_parameter(self.pos_emb.weight, sequence_parallel=sp)
        self.drop = Dropout(cfg.dropout, "replicated", group, sp)
        self.blocks = nn.ModuleList()
        for _ in range(cfg.n_layer):    # same construction order as GPT: same RNG calls
            attn = ParallelSelfAttention(cfg.n_embd, cfg.n_head, cfg.attn_dropout, cfg.dropout,
                                         group, sp)
            mlp = ParallelMLP(cfg.n_embd, 4 * cfg.n_embd, cfg.dropout, group, sp)
            self.blocks.append(Block(cfg, attn, mlp))   # LayerNorms draw no random numbers
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = ColumnParallelLinear(cfg.n_embd, cfg.vocab_size, bias=False, group=group,
                                         sequence_parallel=sp, padded_out_features=self.padded_vocab)
        if sp:
            for block in self.blocks:
                mark_sequence_parallel(block.ln1), mark_sequence_parallel(block.ln2)
            mark_sequence_parallel(self.ln_f)

    def forward(self, ids, targets=None, label_smoothing: float = 0.0):
        s = ids.shape[1]
        if s > self.cfg.block_size:
            raise ValueError(f"TPGPT (rank {self.tp_rank}): sequence length {s} exceeds "
                             f"block_size {self.cfg.block_size}")
        if self.sequence_parallel and s % self.tp_size:
            raise ValueError(f"TPGPT (rank {self.tp_rank}): sequence parallelism needs the sequence "
                             f"length ({s}) divisible by the tensor-parallel size {self.tp_size}")
        with accounting.scope("embed"):
            tok = self.tok_emb(ids)              # [b, s, h], or [b, s/W, h] with SP
            pos = self.pos_emb(torch.arange(s, device=ids.device))
            if self.sequence_parallel:
                pos = R.split_along(pos, 0, self.group, "TPGPT sequence split")
            x = self.drop(tok + pos)
        for i, block in enumerate(self.blocks):
            x = block(x, f"block{i}")
        with accounting.scope("head"):
            logits = self.head(self.ln_f(x))     # [b, s, Vp/W]
            if targets is None:
                return logits, None
            loss = vocab_parallel_cross_entropy(logits, targets, self.cfg.vocab_size,
                                                label_smoothing, group=self.group)
        return logits, loss

    def finish_grads(self) -> None:
        """After backward: sum the sequence-parallel parameters' partial gradients (no-op without SP)."""
        if self.sequence_parallel:
            allreduce_sequence_parallel_grads(self, self.group)
