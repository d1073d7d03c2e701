"""The course GPT with MoE MLPs, trained expert-parallel x data-parallel on a process grid.

``MoEGPT(cfg, num_experts, top_k, grid=grid)``: loss = cross-entropy + every layer's aux losses;
:func:`sync_grads` averages non-expert gradients over DP and expert ones over expert-DP / D.
Design notes: docs/design/expert_parallel.md
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from ..comm.p2p import LOCAL
from ..collectives import all_reduce
from ..models.gpt import Block, GPTConfig
from .layer import MoE

__all__ = ["MoEGPT", "clip_grad_norm_", "global_grad_norm", "is_expert", "sync_grads"]


def is_expert(p) -> bool:
    """True for a parameter of an expert (replicated only over the expert-DP group)."""
    return bool(getattr(p, "expert_parallel", False))


class MoEGPT(nn.Module):
    """GPT with ``n_layer`` MoE blocks (``moe_kwargs`` go to every MoE). ``ValueError`` for a bad
    ``aux_stats``, a grid with PP/TP/CP, and what GPT / MoE raise."""

    def __init__(self, cfg: GPTConfig, num_experts: int, top_k: int = 1, grid=None,
                 aux_stats: str = "global", recompute: bool = False, **moe_kwargs):
        super().__init__()
        if aux_stats not in ("global", "local"):
            raise ValueError(f"MoEGPT: aux_stats must be 'global' or 'local', got {aux_stats!r}")
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"MoEGPT: n_embd={cfg.n_embd} is not divisible by n_head={cfg.n_head}")
        self.cfg, self.grid, self.recompute = cfg, grid, recompute
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        groups = {}
        if grid is not None:
            other = [f"{k}={v}" for k, v in (("pp", grid.pp_size), ("tp", grid.tp_size),
                                              ("cp", grid.cp_size)) if v > 1]
            if other:
                raise ValueError(f"MoEGPT (rank {grid.rank}): expert parallelism composes with "
                                 f"data parallelism here, not with {', '.join(other)}: MoEGPT is "
                                 "one module, not pipeline stages, and its attention and MLPs "
                                 "are not tensor- or context-parallel")
            groups = dict(ep_group=grid.ep_group,
                          stats_group=grid.dp_group if aux_stats == "global" else LOCAL)
        self.blocks = nn.ModuleList(
            Block(cfg, mlp=MoE(cfg, num_experts, top_k, **groups, **moe_kwargs))
            for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:  # one parameter, as GPT's (drawn after the head's: same RNG calls)
            self.head.weight = self.tok_emb.weight
        self.aux_loss = None

    def __getstate__(self):   # as MoE's: the last forward's aux loss is not copied
        state = dict(super().__getstate__())
        state["aux_loss"] = None
        return state

    def moe_layers(self) -> list[MoE]:
        return [b.mlp for b in self.blocks]

    def tokens_per_expert(self) -> torch.Tensor:
        """``[n_layer, E]``: this rank's assignments per expert in the last forward."""
        return torch.stack([m.stats.routed for m in self.moe_layers()])

    def forward(self, ids, targets=None):
        s = ids.shape[1]
        if s > self.cfg.block_size:
            raise ValueError(f"MoEGPT: sequence length {s} exceeds block_size {self.cfg.block_size}")
        x = self.drop(self.tok_emb(ids) + self.pos_emb(torch.arange(s, device=ids.device)))
        for block in self.blocks:
            if self.recompute and torch.is_grad_enabled():
                # no early stop: every rank recomputes the whole block, so the collectives inside
                # (count exchange, both all-to-alls, the stats all-reduce) match across ranks
                with set_checkpoint_early_stop(False):
                    x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.head(self.ln_f(x))
        self.aux_loss = sum(m.aux_loss for m in self.moe_layers())
        if targets is None:
            return logits, None
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return logits, ce + self.aux_loss


def _flat_all_reduce(grads: list[torch.Tensor], op: str, group) -> None:
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    all_reduce(flat, op=op, group=group)
    for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(piece.view_as(g))


def sync_grads(model: MoEGPT, grid) -> None:
    """Average each kind of parameter's gradient over its group (collective; every rank calls it)."""
    dense = [p.grad for p in model.parameters() if p.grad is not None and not is_expert(p)]
    expert = [p.grad for p in model.parameters() if p.grad is not None and is_expert(p)]
    if grid.dp_size > 1:
        _flat_all_reduce(dense, "avg", grid.dp_group)
    if grid.expert_dp_size > 1:
        _flat_all_reduce(expert, "sum", grid.expert_dp_group)
    for g in expert:
        g.div_(grid.dp_size)


def global_grad_norm(model: MoEGPT, grid) -> float:
    """The 2-norm of the whole (one-process) model's gradient, on every rank (after sync_grads)."""
    device = next(model.parameters()).device
    dense = torch.zeros(1, dtype=torch.float64, device=device)
    expert = torch.zeros(1, dtype=torch.float64, device=device)
    for p in model.parameters():
        if p.grad is not None:
            (expert if is_expert(p) else dense).add_(p.grad.detach().double().pow(2).sum())
    if grid is not None and grid.ep_size > 1:
        all_reduce(expert, "sum", group=grid.ep_group)
    return float((dense + expert).sqrt())


def clip_grad_norm_(model: MoEGPT, grid, max_norm: float) -> float:
    """Scale every gradient by ``min(1, max_norm / (norm + 1e-6))`` as torch's; return the norm."""
    norm = global_grad_norm(model, grid)
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(coef)
    return norm
