"""The tiny GPT of :mod:`minidist.models.gpt`, tensor-parallel (Megatron-LM, Shoeybi et al. 2019).

:class:`GPTStage` is a pipeline stage of it; ``TPGPT`` is the one stage holding everything, with
the single-process model's parameter names and (after the same seed) its full weights; a tied
head (``tie_embeddings=True``) is refused (``ValueError``).
Design notes: docs/design/tensor_parallel.md
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..comm.p2p import group_rank_world
from ..models.gpt import Block, GPTConfig
from . import accounting, regions as R
from .attention import ParallelSelfAttention
from .cross_entropy import vocab_parallel_cross_entropy
from .layers import ColumnParallelLinear, VocabParallelEmbedding, mark_parameter, pad_to_multiple
from .mlp import ParallelMLP
from .random import Dropout
from .sequence import (allreduce_sequence_parallel_grads, mark_sequence_parallel,
                       track_sequence_parallel_grads)

__all__ = ["GPTStage", "TPGPT", "LayerDict", "use_tracker_dropout"]


class LayerDict(nn.ModuleDict):
    """Blocks by their global layer index (``blocks[5]``); iterating yields the blocks."""

    def __getitem__(self, key):
        return super().__getitem__(str(key))

    def __setitem__(self, key, module):
        super().__setitem__(str(key), module)

    def __contains__(self, key) -> bool:
        return super().__contains__(str(key))

    def __iter__(self):
        return iter(self.values())


class GPTStage(nn.Module):
    """Stage ``index`` of ``n_stages``: blocks ``layers``, the embeddings on the first stage and
    ``ln_f`` + head on the last. ``run_block``: None or ``f(block, x) -> y`` (recomputation)."""

    run_block: Callable | None = None

    def __init__(self, cfg: GPTConfig, index: int, n_stages: int, layers: range, group=None,
                 sequence_parallel: bool = False):
        super().__init__()
        self._build(cfg, index, n_stages, layers, group, sequence_parallel)

    def make_attention(self, cfg: GPTConfig, group, sequence_parallel: bool) -> nn.Module:
        """Each block's attention (a subclass swaps it: context parallelism's ring attention)."""
        return ParallelSelfAttention(cfg.n_embd, cfg.n_head, cfg.attn_dropout, cfg.dropout, group,
                                     sequence_parallel)

    def positions(self, s: int, device) -> tuple[int, torch.Tensor]:
        """Stage 0: ``(full sequence length, position ids [s])`` of this rank's tokens."""
        return s, torch.arange(s, device=device)

    def _build(self, cfg: GPTConfig, index: int, n_stages: int, layers: range, group,
               sequence_parallel: bool) -> None:
        sp = sequence_parallel
        self.cfg, self.index, self.group, self.sequence_parallel = cfg, index, group, sp
        self.is_first, self.is_last = index == 0, index == n_stages - 1
        self.tp_rank, self.tp_size = group_rank_world(group)
        if self.is_first:
            self.tok_emb = VocabParallelEmbedding(cfg.vocab_size, cfg.n_embd, group, sp)
            self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
            mark_parameter(self.pos_emb.weight, sequence_parallel=sp)
            self.drop = Dropout(cfg.dropout, "replicated", group, sp)
        self.blocks = LayerDict()
        for i in layers:
            attn = self.make_attention(cfg, group, sp)
            mlp = ParallelMLP(cfg.n_embd, 4 * cfg.n_embd, cfg.dropout, group, sp)
            self.blocks[str(i)] = block = Block(cfg, attn, mlp)
            if sp:
                mark_sequence_parallel(block.ln1), mark_sequence_parallel(block.ln2)
        if self.is_last:
            self.ln_f = nn.LayerNorm(cfg.n_embd)
            self.head = ColumnParallelLinear(cfg.n_embd, cfg.vocab_size, bias=False, group=group,
                                             sequence_parallel=sp,
                                             padded_out_features=pad_to_multiple(cfg.vocab_size,
                                                                                 self.tp_size))
            if sp:
                mark_sequence_parallel(self.ln_f)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            s, pos_ids = self.positions(x.shape[1], x.device)
            if s > self.cfg.block_size:
                raise ValueError(f"GPTStage 0 (TP rank {self.tp_rank}): sequence length {s} "
                                 f"exceeds block_size {self.cfg.block_size}")
            with accounting.scope("embed"):
                tok = self.tok_emb(x)
                pos = self.pos_emb(pos_ids)
                if self.sequence_parallel:
                    pos = R.split_along(pos, 0, self.group, "GPTStage sequence split")
                x = self.drop(tok + pos)
        for i, block in self.blocks.items():
            with accounting.scope(f"block{i}"):
                x = block(x) if self.run_block is None else self.run_block(block, x)
        if self.is_last:
            with accounting.scope("head"):
                x = self.head(self.ln_f(x))
        return x


class TPGPT(GPTStage):
    """ids ``[b, s]`` -> this rank's logits ``[b, s, Vp/W]``, split over the TP ``group``.

    With ``sequence_parallel=True`` (``s`` divisible by W) call :meth:`finish_grads` after backward."""

    def __init__(self, cfg: GPTConfig, group=None, sequence_parallel: bool = False):
        if cfg.tie_embeddings:   # an untied head would silently differ from GPT(cfg)
            raise ValueError(f"TPGPT (rank {group_rank_world(group)[0]}): tie_embeddings=True is "
                             "not supported: its head is a ColumnParallelLinear of its own; "
                             "minidist.hybrid.HybridGPT ties the two (its embedding group sums "
                             "their gradients)")
        # same construction order as GPT (embeddings, blocks, ln_f, head): the same RNG calls
        super().__init__(cfg, 0, 1, range(cfg.n_layer), group, sequence_parallel)
        self.padded_vocab = pad_to_multiple(cfg.vocab_size, self.tp_size)
        if sequence_parallel:
            track_sequence_parallel_grads(self)  # finish_grads may follow every micro-batch

    def forward(self, ids, targets=None, label_smoothing: float = 0.0):
        s = ids.shape[1]
        if self.sequence_parallel and s % self.tp_size:
            raise ValueError(f"TPGPT (rank {self.tp_rank}): sequence parallelism needs the sequence "
                             f"length ({s}) divisible by the tensor-parallel size {self.tp_size}")
        logits = super().forward(ids)            # [b, s, Vp/W]
        if targets is None:
            return logits, None
        with accounting.scope("head"):
            loss = vocab_parallel_cross_entropy(logits, targets, self.cfg.vocab_size,
                                                label_smoothing, group=self.group)
        return logits, loss

    def finish_grads(self) -> None:
        """Sum the sequence-parallel parameters' partial gradients (no-op without SP)."""
        if self.sequence_parallel:
            allreduce_sequence_parallel_grads(self, self.group)


def use_tracker_dropout(model: nn.Module) -> nn.Module:
    """Swap a single-process model's ``nn.Dropout`` for the tracker's, as in :class:`TPGPT`
    (in place; returns ``model``): to compare with a TP run with dropout on."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Dropout):
                region = "model-parallel" if name == "attn_drop" else "replicated"
                setattr(parent, name, Dropout(child.p, region))
    return model
