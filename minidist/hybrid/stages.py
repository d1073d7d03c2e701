"""This rank's pipeline stages of the tensor-parallel GPT: the model of 3-D (DP x TP x PP) training.

The tiny GPT (:class:`minidist.models.gpt.GPT`) is cut into ``P·v`` pipeline stages (``P`` the
pipeline size, ``v`` model chunks per rank for the interleaved schedule): its ``n_layer`` blocks
are split as evenly as possible (:func:`minidist.pipeline_parallel.partition.balanced_bounds`),
stage 0 also holds the token and position embeddings, the last stage ``ln_f`` and the head.
Inside a stage every layer is tensor-parallel over the grid's TP group: each stage is a
:class:`minidist.tensor_parallel.gpt.GPTStage` (VocabParallelEmbedding, ParallelSelfAttention and
ParallelMLP in the plain ``Block``, a vocabulary-parallel head; optionally sequence parallelism),
the same code :class:`~minidist.tensor_parallel.gpt.TPGPT` is (one stage holding every layer).
Rank ``r`` holds stages ``r, r+P, ...`` (chunk order) of its pipeline, or with ``placement="v"``
(two chunks, the V-shaped schedules ZB-V and DualPipe-V) stages ``r`` and ``2P-1-r``: rank 0 then
holds the first and the last stage. Narayanan et al. 2021,
"Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", §2-3.

Weights: every rank builds the full ``GPT(cfg)`` after ``torch.manual_seed(seed)`` and keeps its
shards of its stages' parameters (:func:`~minidist.tensor_parallel.sharding.shard_state_dict`), so
the distributed model equals the one-process model exactly, by construction. Parameter names are
the GPT's (``blocks.5.attn.qkv.weight``), so gathered gradients compare key by key.

Tied embeddings (``cfg.tie_embeddings``): the head reuses the token embedding. When one stage holds
both (``P·v == 1``) it is one parameter; otherwise the last stage holds a copy (same TP shard
layout: rows of the padded vocabulary), and after backward the two copies' gradients are summed
(:meth:`HybridGPT.allreduce_tied_grads`, over the grid's embedding group, as Megatron-LM's
``_allreduce_word_embedding_grads``), so they get the same update and stay identical.

Shapes: stage 0 takes ids ``[b, s]``; between stages the hidden state ``[b, s, h]`` (``[b, s/tp, h]``
with sequence parallelism); the last stage returns this rank's logits ``[b, s, Vp/tp]``.

Context parallelism (a grid with ``cp > 1``): each rank holds ``s/cp`` positions of every sample,
cut by the zigzag split (:mod:`minidist.context_parallel.sharding`); stage 0 embeds them at their
*global* positions, attention is ring attention over the CP group
(:class:`~minidist.context_parallel.attention.ContextParallelSelfAttention`), everything else is
per token and unchanged. ``s`` must divide by ``2·cp``; no attention dropout with CP. With
sequence parallelism too, each rank's ``s/cp`` positions are cut again over TP between the
attention blocks (``s/cp`` must divide by ``tp``), as torchtitan runs TP with SP beside CP.
"""

from __future__ import annotations

import contextlib
from typing import cast

import torch
import torch.utils.checkpoint
from torch import nn

from .. import collectives as C
from ..comm.p2p import group_rank_world
from ..context_parallel.attention import ContextParallelSelfAttention
from ..context_parallel.sharding import SPLITS as CP_SPLITS
from ..context_parallel.sharding import positions as cp_positions
from ..expert_parallel.dispatch import local_experts
from ..models.gpt import GPT, GPTConfig
from ..pipeline_parallel.partition import balanced_bounds
from ..sharding.recompute import checkpoint
from ..tensor_parallel.gpt import GPTStage
from ..tensor_parallel.random import get_rng_tracker
from ..trace import span
from ..tensor_parallel.sequence import allreduce_sequence_parallel_grads
from ..sharding.fsdp_state import full_gradients, full_state_dict
from ..tensor_parallel.sharding import gather_state_dict, gather_tensors, shard_state_dict
from .moe import check_moe, global_names, install_experts, local_full_state

__all__ = ["GPTStage", "CPGPTStage", "HybridGPT", "stage_bounds", "check_grid", "RECOMPUTE"]



def torch_checkpoint(fn, *args):
    """torch's non-reentrant checkpoint, as minidist's own checkpoint behaves: without early stop
    (every rank recomputes the whole block, so the collectives inside it — TP's all-reduces, MoE's
    all-to-alls — match across ranks) and with the tensor-parallel dropout tracker's generators
    replayed (torch restores its own generators only: the recomputed dropout masks would differ,
    and with experts so would the routing; Megatron-LM's ``checkpoint`` replays the tracker too)."""
    state = get_rng_tracker().state_dict()

    def contexts():
        return contextlib.nullcontext(), _TrackerReplayed(state)
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False,
                                                 context_fn=contexts)


class _TrackerReplayed:
    """The tracker at ``state`` inside the block (the recomputation), as it was outside after.
    Reusable: a split backward recomputes a block twice with the same context."""

    def __init__(self, state: dict):
        self.state = state
        self.outside: list[dict] = []

    def __enter__(self):
        tracker = get_rng_tracker()
        self.outside.append(tracker.state_dict())
        tracker.load_state_dict(self.state)

    def __exit__(self, *exc):
        get_rng_tracker().load_state_dict(self.outside.pop())


# how a stage runs each block: as is, or recomputed in backward (minidist's or torch's checkpoint)
RECOMPUTE = {"none": None, "minidist": checkpoint, "torch": torch_checkpoint}


def stage_bounds(n_layer: int, n_stages: int) -> list[tuple[int, int]]:
    """``[start, end)`` block ranges of the ``n_stages`` stages (sizes differ by at most one)."""
    return balanced_bounds([1.0] * n_layer, n_stages)


def check_grid(cfg: GPTConfig, dp: int, pp: int, tp: int, chunks: int = 1,
               sequence_parallel: bool = False, rank: int | None = None, seq_len: int | None = None,
               batch: int | None = None, microbatches: int | None = None, cp: int = 1,
               placement: str = "loop") -> None:
    """Raise ``ValueError`` (naming ``rank`` and what to change) when the grid does not divide the
    model or the batch: fewer layers than ``pp·chunks`` stages, ``n_head % tp``, ``seq_len % tp``
    with sequence parallelism, a global batch not divisible by ``dp``, fewer samples per replica
    than ``microbatches``, ``microbatches % pp`` with the interleaved schedule (``chunks > 1``,
    ``placement="loop"``), a ``placement`` other than ``"loop"``/``"v"``, ``"v"`` without 2 chunks;
    with ``cp > 1``: ``seq_len % (2·cp)`` (the zigzag split), attention dropout, and with sequence
    parallelism ``(seq_len / cp) % tp``.
    Every rank raises the same error before any communication, so nothing hangs."""
    who = f"hybrid GPT (rank {rank}, grid dp={dp} pp={pp} tp={tp} chunks={chunks}" + (
        f" cp={cp})" if cp > 1 else ")")
    if cp > 1:
        if cfg.attn_dropout:
            raise ValueError(f"{who}: attention dropout ({cfg.attn_dropout}) is not supported "
                             "with context parallelism; set attn_dropout=0")
        if seq_len is not None and seq_len % (2 * cp):
            raise ValueError(f"{who}: the zigzag split needs the sequence length ({seq_len}) "
                             f"divisible by 2·cp = {2 * cp}")
    if cfg.n_layer < pp * chunks:
        raise ValueError(f"{who}: {cfg.n_layer} layers cannot fill pp x chunks = {pp * chunks} "
                         f"stages (each needs a block); use n_layer >= {pp * chunks} or fewer "
                         "stages/chunks")
    if cfg.n_head % tp:
        raise ValueError(f"{who}: n_head={cfg.n_head} is not divisible by tp={tp}; choose tp "
                         f"among the divisors of {cfg.n_head}")
    if cfg.n_embd % cfg.n_head:
        raise ValueError(f"{who}: n_embd={cfg.n_embd} is not divisible by n_head={cfg.n_head}")
    if sequence_parallel and seq_len is not None and (seq_len // cp) % tp:
        held = f"the {seq_len // cp} positions each CP rank holds" if cp > 1 else \
            f"the sequence length ({seq_len})"
        raise ValueError(f"{who}: sequence parallelism needs {held} divisible by tp={tp}; "
                         "change the sequence length or turn it off")
    if batch is not None:
        if batch % dp:
            raise ValueError(f"{who}: the global batch of {batch} samples does not split evenly "
                             f"over dp={dp} replicas; use a multiple of {dp}")
        if microbatches is not None and batch // dp < microbatches:
            raise ValueError(f"{who}: each replica gets {batch // dp} samples, fewer than the "
                             f"{microbatches} micro-batches; use microbatches <= {batch // dp} or "
                             "a larger batch")
    if placement not in ("loop", "v") or (placement == "v" and chunks != 2):
        raise ValueError(f"{who}: placement must be 'loop' (rank r holds stages r, r+pp, ...) or "
                         f"'v' with chunks=2 (the V of ZB-V and DualPipe-V), got {placement!r}")
    if placement == "loop" and chunks > 1 and microbatches is not None and microbatches % pp:
        raise ValueError(f"{who}: the interleaved schedule needs microbatches ({microbatches}) to "
                         f"be a multiple of pp={pp}")


class CPGPTStage(GPTStage):
    """:class:`~minidist.tensor_parallel.gpt.GPTStage` on a context-parallel group: each block's
    attention is :class:`~minidist.context_parallel.attention.ContextParallelSelfAttention` (ring
    attention over ``cp_group``) and stage 0 embeds this rank's ``s/cp`` tokens at their global
    zigzag positions. Same parameters (names, shapes) as the plain stage."""

    def __init__(self, cfg: GPTConfig, index: int, n_stages: int, layers: range, group,
                 sequence_parallel: bool, cp_group, split: str = "zigzag", method: str = "ring"):
        nn.Module.__init__(self)        # cp_group first: make_attention needs it during the build
        self.cp_group, self.split, self.method = cp_group, split, method
        self._build(cfg, index, n_stages, layers, group, sequence_parallel)

    def make_attention(self, cfg: GPTConfig, group, sequence_parallel: bool) -> nn.Module:
        return ContextParallelSelfAttention(cfg.n_embd, cfg.n_head, cfg.attn_dropout, cfg.dropout,
                                            group, sequence_parallel, self.cp_group, self.split,
                                            self.method)

    def positions(self, s: int, device) -> tuple[int, torch.Tensor]:
        cp_rank, cp = group_rank_world(self.cp_group)   # this rank's positions of cp·s
        return s * cp, cp_positions(self.split, s * cp, cp, cp_rank).to(device)


class HybridGPT:
    """This rank's stages of ``GPT(cfg)`` on a :class:`minidist.grid.ProcessGrid`.

    Args: ``cfg``; ``grid`` (``ProcessGrid(dp, pp, tp)``, or ``(..., cp=c)``: context
    parallelism); ``chunks`` = ``v`` model chunks per rank (interleaved 1F1B);
    ``sequence_parallel``; ``seed`` for the full model's weights; ``placement``: ``"loop"`` or
    ``"v"`` (module docstring; the schedule's own ``placement``); ``recompute``: ``"none"``,
    ``"minidist"`` (:func:`minidist.sharding.recompute.checkpoint` around every block) or
    ``"torch"`` (``torch.utils.checkpoint``, non-reentrant) — activation recomputation: each
    block keeps its input and runs again in backward (in each backward: twice under a
    zero-bubble split); ``cp_attention``: ``"ring"`` or ``"ulysses"`` and ``cp_split``:
    ``"zigzag"``, ``"contiguous"`` or ``"striped"`` — how the sequence is cut over the CP ranks
    and how their attention meets (:mod:`minidist.context_parallel`; used when ``cp > 1``);
    ``moe``: None (dense MLPs) or the options of a mixture of experts in every block
    (``num_experts`` and :class:`~minidist.expert_parallel.layer.MoE`'s ``top_k``,
    ``capacity_factor``, ``drop_policy``, ``normalize_topk``, ``aux_loss_coeff``,
    ``z_loss_coeff``), its experts sharded over the grid's EP group (:mod:`.moe`).

    Attributes: ``stages`` {stage index: :class:`GPTStage`, a :class:`CPGPTStage` with cp > 1}
    (this rank's), ``n_stages`` = pp·v,
    ``bounds`` (block ranges per stage), ``tied`` (tied embeddings held as two copies),
    ``moe_layers`` (this rank's MoE layers, stage order; empty when dense).

    Raises ``ValueError`` from :func:`check_grid` and :func:`.moe.check_moe`.
    """

    def __init__(self, cfg: GPTConfig, grid, chunks: int = 1, sequence_parallel: bool = False,
                 seed: int = 0, placement: str = "loop", recompute: str = "none",
                 cp_attention: str = "ring", cp_split: str = "zigzag", moe: dict | None = None):
        cp = grid.cp_size
        check_moe(moe, grid, f"HybridGPT (rank {grid.rank})")
        if cp_attention not in ("ring", "ulysses") or cp_split not in CP_SPLITS:
            raise ValueError(f"HybridGPT (rank {grid.rank}): cp_attention must be 'ring' or "
                             f"'ulysses' and cp_split one of {CP_SPLITS}, got {cp_attention!r}, "
                             f"{cp_split!r}")
        if recompute not in RECOMPUTE:
            raise ValueError(f"HybridGPT (rank {grid.rank}): recompute must be one of "
                             f"{sorted(RECOMPUTE)}, got {recompute!r}")
        check_grid(cfg, grid.dp_size, grid.pp_size, grid.tp_size, chunks, sequence_parallel,
                   grid.rank, cp=cp, placement=placement)
        self.cfg, self.grid, self.chunks, self.sequence_parallel = cfg, grid, chunks, sequence_parallel
        self.placement, self.recompute, self.seed = placement, recompute, seed
        self.cp_attention, self.cp_split = cp_attention, cp_split
        self.n_stages = grid.pp_size * chunks
        self.bounds = stage_bounds(cfg.n_layer, self.n_stages)
        self.moe, self.moe_layers = moe, []
        if moe is None:
            torch.manual_seed(seed)
            full = GPT(cfg).state_dict()
        else:   # the one-process MoEGPT, with this rank's experts renumbered as the stages hold them
            full = local_full_state(cfg, moe, seed, self.expert_ids)
        self.stages = {}
        P, r = grid.pp_size, grid.pp_rank
        for c in range(chunks):
            s = 2 * P - 1 - r if placement == "v" and c == 1 else c * P + r
            layers = range(*self.bounds[s])
            stage = (CPGPTStage(cfg, s, self.n_stages, layers, grid.tp_group, sequence_parallel,
                                grid.cp_group, cp_split, cp_attention) if cp > 1 else
                     GPTStage(cfg, s, self.n_stages, layers, grid.tp_group, sequence_parallel))
            if moe is not None:
                self.moe_layers += install_experts(stage, moe, grid, sequence_parallel)
            stage.load_state_dict(shard_state_dict(full, stage, grid.tp_group))
            stage.run_block = RECOMPUTE[recompute]
            self.stages[s] = stage
        last, first = self.n_stages - 1, 0
        self.shared = cfg.tie_embeddings and self.n_stages == 1
        self.tied = cfg.tie_embeddings and self.n_stages > 1
        if self.shared:   # one stage holds both: one parameter, as in the one-process model
            self.stages[0].head.weight = self.stages[0].tok_emb.weight
        self.first, self.last = self.stages.get(first), self.stages.get(last)

    # ------------------------------------------------------------------ parameters
    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters, each once (stage order)."""
        seen, out = set(), []
        for s in sorted(self.stages):
            for p in self.stages[s].parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    @property
    def expert_ids(self) -> list[int]:
        """The experts (one-process indices) this rank holds in every MoE layer."""
        if self.moe is None:
            return []
        return local_experts(self.moe["num_experts"], self.grid.ep_size, self.grid.ep_rank)

    def is_tied_copy(self, p: nn.Parameter) -> bool:
        """True for the last stage's copy of a tied embedding (count it once: in the embedding)."""
        return self.tied and self.last is not None and p is self.last.head.weight

    def zero_grad(self) -> None:
        for p in self.parameters():
            p.grad = None

    # ------------------------------------------------------------------ gradient duties
    def finish_sequence_parallel_grads(self) -> None:
        """Sum the partial gradients of sequence-sharded parameters over the TP group (Korthikanti
        et al. 2022 §4.2.2). Call once, after every micro-batch's backward (it commutes with the DP
        average, so before or after it)."""
        if self.sequence_parallel:
            with span("sp grads"):
                for s in sorted(self.stages):
                    allreduce_sequence_parallel_grads(self.stages[s], self.grid.tp_group)

    def allreduce_tied_grads(self) -> None:
        """Sum the gradients of the tied embedding's two copies (first and last stage)."""
        if not self.tied:
            return
        if self.first is not None and self.last is not None:   # pp == 1, chunks > 1: same rank
            a, b = self.first.tok_emb.weight, self.last.head.weight
            total = _grad(a) + _grad(b)
            a.grad, b.grad = total, total.clone()
            return
        if self.grid.embedding_group is None or (self.first is None and self.last is None):
            return   # a middle stage (with placement "v", rank pp-1 is one, in the group or not)
        p = (self.first.tok_emb.weight if self.first is not None else
             cast(GPTStage, self.last).head.weight)
        p.grad = _grad(p)
        with span("tied grads"):
            C.all_reduce(p.grad, "sum", group=self.grid.embedding_group)

    # ------------------------------------------------------------------ inspection
    def gather(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """Full (unpadded) parameters or gradients of this rank's stages, by GPT name; the tied
        copy is returned as ``head.weight``; experts by their one-process index (this rank's
        experts only); ZeRO-3 gradients gathered over DP×CP first. A collective over the TP
        group (and DP×CP)."""
        out = {}
        for s in sorted(self.stages):
            stage = self.stages[s]
            if hasattr(stage, "_fsdp"):   # ZeRO-3 shards: first over DP x CP
                full = full_gradients(stage) if grads else full_state_dict(stage)
                out.update(gather_tensors(stage, full, self.grid.tp_group))
            else:
                out.update(gather_state_dict(stage, self.grid.tp_group, grads=grads))
        return out if self.moe is None else global_names(out, self.expert_ids)


def _grad(p: nn.Parameter) -> torch.Tensor:
    return p.grad if p.grad is not None else torch.zeros_like(p)


