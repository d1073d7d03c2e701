"""Everything :func:`~.step.train_step` refuses, checked on every rank before any communication.

Each check raises ``ValueError`` naming the rank, the argument and what was expected, so that no
rank enters a collective the others will not join. The rules and their sources are in
docs/design/hybrid.md (the step).
"""

from __future__ import annotations

import torch

from ..pipeline_parallel.catalog import make_schedule
from .dp import SHARDED, PipelineBucketedDDP, check_sharding
from .moe import refuse_expert_dp_mode
from .stages import check_grid

__all__ = ["check_step", "loss_reduction_for"]


def check_step(model, optimizer, modules: dict, ids: torch.Tensor, targets: torch.Tensor,
               microbatches: int, schedule: str | None, dp_mode: str, loss_reduction: str | None):
    """``(schedule object, loss reduction)`` for one step of ``model`` (arguments as
    :func:`~.step.train_step`), or ``ValueError`` on every rank."""
    grid, cfg, who = model.grid, model.cfg, f"train_step (rank {model.grid.rank})"
    if dp_mode in ("zero1", "zero2") and optimizer is not None and \
            not hasattr(optimizer, "reduce_gradients"):
        raise ValueError(f"{who}: dp_mode={dp_mode!r} needs the ZeRO1Optimizer of "
                         f"make_optimizer(model, {dp_mode!r}, ...) (it averages the gradients)")
    wrapped = [isinstance(m, PipelineBucketedDDP) for m in modules.values()]
    if any(wrapped) != (dp_mode == "bucketed") or len(set(wrapped)) > 1:
        raise ValueError(f"{who}: modules do not match dp_mode={dp_mode!r}; build them with "
                         f"wrap_stages(model, {dp_mode!r})")
    refuse_expert_dp_mode(model, dp_mode, "train_step")
    sharded = [hasattr(m, "_fsdp") for m in model.stages.values()]
    if any(sharded) != (dp_mode in SHARDED):
        raise ValueError(f"{who}: the stages are{'' if any(sharded) else ' not'} fully_shard units "
                         f"but dp_mode={dp_mode!r}; build them with wrap_stages(model, {dp_mode!r})")
    if dp_mode in SHARDED:
        check_sharding(model, dp_mode, "train_step")
    check_grid(cfg, grid.dp_size, grid.pp_size, grid.tp_size, model.chunks,
               model.sequence_parallel, grid.rank, ids.shape[1], ids.shape[0], microbatches,
               grid.cp_size, model.placement)
    reduction = loss_reduction_for(grid, targets, microbatches, loss_reduction)
    if schedule is None:
        schedule = "interleaved" if model.chunks > 1 else "1f1b"
    sched = make_schedule(schedule, grid.pp_size, microbatches, v=model.chunks)
    if sched.v != model.chunks or sched.placement != model.placement:
        raise ValueError(f"{who}: schedule {schedule!r} runs {sched.v} chunk(s) per rank placed "
                         f"{sched.placement!r}, but the model was built with chunks={model.chunks}, "
                         f"placement={model.placement!r}; build HybridGPT(..., chunks={sched.v}, "
                         f"placement={sched.placement!r}) or pick a schedule for the model")
    return sched, reduction


def loss_reduction_for(grid, targets: torch.Tensor, microbatches: int, loss_reduction) -> str:
    """The reduction to run: ``"per_token"`` when any target is ignored (-100) and none was asked,
    else ``"mean"``; ``"mean"`` with ignored targets over several shards is refused (each shard
    would average over its own count of tokens). Decided from the global targets, which every
    rank holds, so every rank decides alike without communicating."""
    ignored = bool((targets == -100).any())
    if loss_reduction is None:
        return "per_token" if ignored else "mean"
    shards = grid.dp_size * grid.cp_size * microbatches
    if loss_reduction == "mean" and ignored and shards > 1:
        cut = ", ".join(f"{k}={v}" for k, v in (("dp", grid.dp_size), ("cp", grid.cp_size),
                                                ("microbatches", microbatches)) if v > 1)
        raise ValueError(f"train_step (rank {grid.rank}): loss_reduction='mean' with ignored "
                         f"targets (-100) over {shards} shards ({cut}): each shard would average "
                         "over its own count of tokens, which differs from one process's mean "
                         "over all of them; pass loss_reduction='per_token' (or None)")
    return loss_reduction
