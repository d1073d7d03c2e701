"""One training step of the GPT on a ``dp x pp x cp x tp`` grid (Narayanan et al. 2021, §2-3).

:func:`train_step` in three parts: the checks (:mod:`.check_step`, before any communication), the
step itself (below: the pipeline composed with data parallelism, then the sequence-parallel and
tied-embedding sums, clipping and the optimizer), and the loss every rank reports (:mod:`.loss`).
How gradients are averaged over DP is one small object per ``dp_mode`` (:mod:`.dp_modes`). The
DP average, the sequence-parallel sum and the tied sum are linear and act on different groups, so
their order does not change the result beyond fp32 rounding. More: docs/design/hybrid.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..context_parallel.sharding import shard
from ..pipeline_parallel.engine import StepResult
from ..trace import span
from .check_step import check_step
from .dp_modes import dp_mode_for
from .dp_pipeline import dp_pipeline_step
from .loss import AuxMeter, device_of, global_loss, make_loss_fn
from .moe import aux_weight

__all__ = ["StepOutput", "train_step"]


@dataclass
class StepOutput:
    """``loss``: the global batch's loss (every rank; with experts, the cross-entropy plus
    ``aux_loss``); ``grad_norm``: the global gradient norm before clipping (None without
    ``max_norm``); ``result``: the engine's :class:`StepResult` (timeline, peak activations);
    ``aux_loss``: with experts, ``Σ_m w_m·aux(m)`` summed over the layers (:mod:`.moe`), else
    None."""

    loss: float
    grad_norm: float | None
    result: StepResult
    aux_loss: float | None = None


def train_step(model, optimizer, modules: dict, ids: torch.Tensor, targets: torch.Tensor,
               microbatches: int, schedule: str | None = None, dp_mode: str = "flat",
               loss_reduction: str | None = None, max_norm: float | None = None,
               step: bool = True,
               autocast_dtype: torch.dtype | None = None) -> StepOutput:
    """One step on the global batch ``ids``/``targets`` ``[B, s]`` (the same on every rank).

    ``model``: a :class:`~.stages.HybridGPT`; ``modules``: :func:`~.dp_modes.wrap_stages` with the same
    ``dp_mode``; ``optimizer``: :func:`~.dp.make_optimizer`'s (None with ``step=False``: gradients
    averaged, clipped and left in ``.grad``); ``schedule``: one of
    :data:`~minidist.pipeline_parallel.catalog.SCHEDULES` that fits the model (None: 1F1B, or
    interleaved with chunks > 1); ``loss_reduction``: ``"mean"``, ``"sum"``, ``"per_token"`` or
    None (per-token when a target is -100); ``autocast_dtype``: forwards under ``torch.autocast``,
    the rest fp32. ``microbatches`` is gradient accumulation: weighted so that their sum is the
    global batch's loss, averaged over DP once. Under a :meth:`~minidist.trace.Timeline.observe`
    the step's phases are spans ("send", "recv", "dp_sync", "clip", ...). Raises ``ValueError`` on every rank before communicating
    (:func:`~.check_step.check_step` lists what).
    """
    sched, loss_reduction = check_step(model, optimizer, modules, ids, targets, microbatches,
                                       schedule, dp_mode, loss_reduction)
    grid, mode = model.grid, dp_mode_for(dp_mode, model, optimizer, modules)
    model.zero_grad()
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    x = ids.tensor_split(grid.dp_size)[grid.dp_rank]      # this replica's samples
    y = targets.tensor_split(grid.dp_size)[grid.dp_rank]
    if grid.cp_size > 1:                                   # this rank's positions of every sample
        x, y = (shard(t, model.cp_split, grid.cp_size, grid.cp_rank, dim=1) for t in (x, y))
    for layer in model.moe_layers:                         # the experts' aux losses' weight
        layer.aux_scale = aux_weight(loss_reduction, x.shape[0], len(grid.dp_cp_ranks),
                                     int((targets != -100).sum()),
                                     grid.tp_size if model.sequence_parallel else 1)
    with AuxMeter(model, x.shape[0]) as aux:
        result = dp_pipeline_step(sched, modules, x, y, make_loss_fn(model, loss_reduction),
                                  grid.pp_group, grid.dp_cp_group, loss_reduction=loss_reduction,
                                  average=mode.average(), scale=mode.scale(),
                                  backward_context=mode.backward_context(),
                                  device=device_of(model), autocast_dtype=autocast_dtype)
    model.finish_sequence_parallel_grads()
    model.allreduce_tied_grads()
    mode.after_backward()
    norm = None
    if max_norm is not None:
        with span("clip"):
            norm = mode.clip(max_norm)
    if step:
        with span("optimizer"):
            optimizer.step()
    aux_loss = aux.global_value() if model.moe_layers else None
    return StepOutput(global_loss(model, result) + (aux_loss or 0.0), norm, result, aux_loss)

