"""Mixture-of-experts blocks inside the pipeline stages of the hybrid GPT: expert parallelism as the
fifth axis of 3-D training.

``HybridGPT(cfg, grid, moe=dict(num_experts=E, top_k=k, ...))`` replaces every block's MLP by a
:class:`~minidist.expert_parallel.layer.MoE` whose experts are sharded over ``grid.ep_group``
(EP folded over the DP×CP ranks of the same pipeline stage and TP rank, as Megatron-core folds
it). Here: the weights (every rank builds the one-process model and keeps its experts), the aux
losses' weights through the pipeline, the capacity per rank, the expert gradients (averaged over
their expert-DP group, divided by ``ep``) and the DP mode HSDP refuses. What composing with each
axis takes, and why: docs/design/hybrid.md.
"""

from __future__ import annotations

import re
from typing import cast

import torch
from torch import nn

from ..comm.p2p import LOCAL
from ..expert_parallel.gpt import MoEGPT, is_expert
from ..expert_parallel.layer import MoE
from ..models.gpt import GPTConfig
from ..tensor_parallel.gpt import use_tracker_dropout
from ..tensor_parallel.sequence import mark_sequence_parallel
from .dp_pipeline import average_params

__all__ = ["MOE_OPTIONS", "check_moe", "install_experts", "local_full_state", "global_names", "local_names",
           "aux_weight", "average_gradients", "average_expert_gradients", "refuse_expert_dp_mode"]

MOE_OPTIONS = ("num_experts", "top_k", "capacity_factor", "drop_policy", "normalize_topk",
               "aux_loss_coeff", "z_loss_coeff")
_EXPERT = re.compile(r"^(blocks\.\d+\.mlp\.experts\.)(\d+)(\..*)$")


def check_moe(moe: dict | None, grid, who: str) -> None:
    """Raise ``ValueError`` (every rank, before any communication) for an unknown option, EP
    without experts."""
    if moe is None:
        if grid.ep_size > 1:
            raise ValueError(f"{who}: the grid has ep={grid.ep_size}, but the GPT's MLPs are dense "
                             "(no experts to shard); pass moe=dict(num_experts=...) or use ep=1")
        return
    unknown = sorted(set(moe) - set(MOE_OPTIONS))
    if unknown or "num_experts" not in moe:
        raise ValueError(f"{who}: moe takes {MOE_OPTIONS} (num_experts required), got "
                         f"{sorted(moe)}")


def install_experts(stage: nn.Module, moe: dict, grid, sequence_parallel: bool = False) -> list[MoE]:
    """Replace the MLP of every block of ``stage`` by an EP-sharded :class:`MoE` (in place);
    return the layers. Their weights come from :func:`local_full_state` afterwards."""
    dp_cp = grid.dp_cp_group if len(grid.dp_cp_ranks) > 1 else LOCAL
    sp = sequence_parallel and grid.tp_size > 1     # each TP rank routes its own positions
    stats = (dp_cp, grid.tp_group) if sp else dp_cp
    layers = []
    blocks, cfg = cast(nn.ModuleList, stage.blocks), cast(GPTConfig, stage.cfg)
    for block in blocks:
        block.mlp = MoE(cfg, ep_group=grid.ep_group,   # LOCAL at ep == 1 (the grid says so)
                        stats_group=stats, **moe)
        use_tracker_dropout(block.mlp)   # the TP ranks' copies of an expert draw the same masks
        if sp:
            mark_sequence_parallel(block.mlp)   # gradients summed over TP after the pipeline
        layers.append(block.mlp)
    return layers


def local_full_state(cfg, moe: dict, seed: int, expert_ids: list[int]) -> dict:
    """The one-process :class:`MoEGPT`'s state dict (built after ``torch.manual_seed(seed)``) with
    only this rank's experts, renumbered as the stage holds them (``expert_ids[j]`` → ``j``)."""
    torch.manual_seed(seed)
    full = MoEGPT(cfg, **moe).state_dict()
    local = {g: j for j, g in enumerate(expert_ids)}
    out = {}
    for k, v in full.items():
        m = _EXPERT.match(k)
        if m is None:
            out[k] = v
        elif int(m.group(2)) in local:
            out[f"{m.group(1)}{local[int(m.group(2))]}{m.group(3)}"] = v
    return out


def global_names(state: dict, expert_ids: list[int]) -> dict:
    """``state`` with local expert ``j`` renamed to the one-process index ``expert_ids[j]``."""
    out = {}
    for k, v in state.items():
        m = _EXPERT.match(k)
        out[k if m is None else f"{m.group(1)}{expert_ids[int(m.group(2))]}{m.group(3)}"] = v
    return out


def local_names(state: dict, expert_ids: list[int]) -> dict:
    """``state`` (one-process names) with this rank's experts renamed to their local index and
    the other ranks' experts left out (the inverse of :func:`global_names`)."""
    local = {g: j for j, g in enumerate(expert_ids)}
    out = {}
    for k, v in state.items():
        m = _EXPERT.match(k)
        if m is None:
            out[k] = v
        elif int(m.group(2)) in local:
            out[f"{m.group(1)}{local[int(m.group(2))]}{m.group(3)}"] = v
    return out


def aux_weight(loss_reduction: str, replica_samples: int, dp_cp: int, tokens: int,
               sp_shards: int = 1):
    """``f(b)``: the weight of a micro-batch of ``b`` samples' aux loss on one rank, such that after
    the step's reduction (docs/design/hybrid.md) the aux part of the gradient is ``Σ_m w_m·∇aux(m)``,
    ``w_m = b / replica_samples``. ``"mean"``: the DP×CP average divides by ``dp_cp`` already;
    ``"sum"``: the gradients are summed over the ``dp_cp`` ranks; ``"per_token"``: summed and
    divided by the ``tokens`` counted in the global batch. ``sp_shards``: the TP ranks whose
    sequence shards' gradients are summed (sequence parallelism), each a ``1/sp_shards`` share."""
    factor = {"mean": 1.0, "sum": 1.0 / dp_cp, "per_token": tokens / dp_cp}[loss_reduction]
    return lambda b: b / replica_samples * factor / sp_shards


def average_gradients(params: list[nn.Parameter], grid) -> None:
    """The DP×CP average of a model with experts: non-expert parameters averaged over the DP×CP
    group, expert ones over the expert-DP group and divided by ``ep`` (docs/design/hybrid.md)."""
    params = [p for p in params if p.requires_grad]
    average_params([p for p in params if not is_expert(p)], grid.dp_cp_group)
    average_expert_gradients(params, grid)


def average_expert_gradients(params: list[nn.Parameter], grid) -> None:
    """The expert parameters among ``params``: averaged over the expert-DP group (the ranks that
    hold the same experts) and divided by ``ep`` (docs/design/hybrid.md)."""
    experts = [p for p in params if p.requires_grad and is_expert(p)]
    average_params(experts, _expert_replicas(grid))
    if grid.ep_size > 1:
        for p in experts:
            if p.grad is not None:
                p.grad.div_(grid.ep_size)


def _expert_replicas(grid):
    """The group an expert's gradient is averaged over: the ranks that hold the same expert."""
    return grid.expert_dp_group


def refuse_expert_dp_mode(model, dp_mode: str, who: str) -> None:
    """``ValueError`` (every rank, before any communication) for HSDP with experts sharded over
    EP: the stage's unit replicates over DP, the experts' replicas are another group."""
    if dp_mode == "hsdp" and model.moe_layers and model.grid.ep_size > 1:
        raise ValueError(f"{who} (rank {model.grid.rank}): dp_mode={dp_mode!r} with expert "
                         f"parallelism (ep={model.grid.ep_size}) is not supported: HSDP shards "
                         "each stage over CP and replicates it over DP, but an expert is "
                         "replicated over its expert-DP group only, and the units under one "
                         "root share one replicate group (torchtitan builds a mesh of its own "
                         "for the experts, dp_shard_mod_ep, which minidist's HSDP does not); "
                         "use dp_mode='zero3', 'zero1', 'bucketed' or 'flat', or ep=1")
