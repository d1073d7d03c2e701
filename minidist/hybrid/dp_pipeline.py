"""Data parallelism composed with the pipeline: D replicas of one pipeline, each on its shard.

The pipeline engine (:func:`minidist.pipeline_parallel.engine.pipeline_step`) knows stages and
micro-batches only. :func:`dp_pipeline_step` runs it on this replica's shard of the batch and then
makes the replicas one step on the global batch:

* ``"mean"`` (over samples, equal shards): each replica's gradients are its shard's mean; their
  average over the DP group is the global mean.
* ``"sum"``: each replica backpropagates its shard's sum; the gradients are multiplied by D before
  the average, so the result is the gradient of the global sum; the loss is summed over replicas.
* ``"per_token"`` (``loss_fn`` returns ``(sum, count)``): each replica backpropagates its sum; the
  counted tokens are summed over the pipeline and the replicas (N), and the gradients multiplied by
  D / N, so the average is the gradient of the global token mean — right even when replicas count
  different numbers of tokens, or one counts none (Megatron-Core's ``calculate_per_token_loss``;
  averaging per-replica means instead is wrong whenever their counts differ).

The DP average (``average=True``): all of the rank's stages' gradients as one flat buffer after its
last backward, the point where they are final (:func:`sync_gradients`; Narayanan et al. 2021 do the
same for PipeDream-Flush). ``average=False`` when something else averages them (the bucketed
wrappers' hooks during the last backward, ZeRO-1's reduce-scatter): the scaling is linear, so it
may come before or after that average.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from .. import collectives as C
from ..communicator import Communicator
from ..data_parallel.flat import average_flat
from ..pipeline_parallel.engine import StepResult, pipeline_step, scale_gradients
from ..trace import span

__all__ = ["dp_pipeline_step", "sync_gradients", "average_params"]


def sync_gradients(modules: dict[int, nn.Module], dp_group) -> None:
    """Average every parameter gradient of ``modules`` over ``dp_group``, as one flat buffer
    (:func:`minidist.data_parallel.flat.average_flat`, as FlatDDP does): :func:`average_params`
    of the stages' parameters."""
    average_params([p for s in sorted(modules) for p in modules[s].parameters()], dp_group)


def average_params(params: list[nn.Parameter], group) -> None:
    """Average the gradients of ``params`` (those that require one) over ``group`` as one flat
    buffer. A parameter with no gradient counts as zero (so replicas stay in step); one that no
    replica used keeps ``grad=None``, as in one process (a zero gradient would still move it under
    momentum or weight decay). The usage mask travels in the same buffer: no extra collective."""
    params = [p for p in params if p.requires_grad]
    if not params or dist.get_world_size(group) == 1:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    used = torch.tensor([float(p.grad is not None) for p in params], device=params[0].device)
    *averaged, anywhere = average_flat(grads + [used], Communicator("hand-built", group))
    for p, avg, a in zip(params, averaged, anywhere.tolist()):
        if a > 0:
            p.grad = avg.clone()


def dp_pipeline_step(schedule, modules: dict[int, nn.Module], inputs, targets, loss_fn,
                     pp_group, dp_group, loss_reduction: str = "mean", average: bool | Callable[[], None] = True,
                     device=None, prefetch: bool | None = None,
                     backward_context=None, autocast_dtype=None, scale=None) -> StepResult:
    """One pipeline step on this replica's shard ``inputs``/``targets`` (``[N/D, ...]``), composed
    with data parallelism over ``dp_group`` (module docstring).

    Arguments as :func:`~minidist.pipeline_parallel.engine.pipeline_step` (``pp_group`` is its
    ``group``), plus ``dp_group`` (the replicas of this pipeline rank) and ``average`` (False when
    a DDP wrapper or ZeRO averages the gradients; a function of no argument to average them
    another way: experts over their own group, :func:`minidist.hybrid.moe.average_gradients`) and
    ``scale`` (``scale(factor)`` multiplies the gradients, default every ``.grad`` of ``modules``:
    a ZeRO-2 holds them in its slices). Returns the engine's :class:`StepResult`; for
    ``"sum"``/``"per_token"`` its ``global_loss`` is the global batch's loss on every rank and
    ``tokens`` (``"per_token"``) the global count. The average is a ``"dp_sync"`` span.

    Raises ``ValueError`` as the engine does, and when ``loss_reduction="per_token"`` and
    ``loss_fn`` does not return ``(sum, count)``.
    """
    counts: list[float] = []
    fn = loss_fn
    if loss_reduction == "per_token":   # the engine backpropagates the sums; the count is ours
        def fn(y, t):
            out = loss_fn(y, t)
            if not (isinstance(out, (tuple, list)) and len(out) == 2):
                raise ValueError(f"dp_pipeline_step (rank {dist.get_rank()}): loss_reduction="
                                 f"'per_token' needs loss_fn to return (sum, count), got "
                                 f"{type(out).__name__}")
            counts.append(float(out[1]))
            return out[0]
    result = pipeline_step(schedule, modules, inputs, targets, fn, group=pp_group,
                           device=device, prefetch=prefetch, backward_context=backward_context,
                           autocast_dtype=autocast_dtype,
                           loss_reduction="sum" if loss_reduction == "per_token" else loss_reduction)
    if loss_reduction != "mean":
        _over_replicas(result, modules, pp_group, dp_group, loss_reduction, sum(counts), device,
                       scale or (lambda factor: scale_gradients(modules, factor)))
    if average:
        with span("dp_sync"):
            average() if callable(average) else sync_gradients(modules, dp_group)
    return result


def _over_replicas(result: StepResult, modules, pp_group, dp_group, reduction: str, count: float,
                   device, scale_by) -> None:
    """Sum the loss (and the count: over the pipeline first, only the last stage counts) over the
    replicas; scale the gradients by D ("sum") or D / N ("per_token") for the average that follows
    (``scale_by(factor)``: the stages' ``.grad``, or the slices a ZeRO-2 keeps them in)."""
    dp = dist.get_world_size(dp_group)
    if device is None:
        params = [p for m in modules.values() for p in m.parameters()]
        device = params[0].device if params else torch.device("cpu")
    local = result.loss
    if reduction == "per_token" and dist.get_world_size(pp_group) > 1:
        n = torch.tensor([count], dtype=torch.float64, device=device)
        C.all_reduce(n, "sum", group=pp_group)
        count_pp = n.item()
    else:
        count_pp = count
    loss_sum, tokens = _sum_over(dp_group, result.global_loss, count_pp, device)
    if reduction == "sum":
        scale, result.global_loss = float(dp), loss_sum
    else:  # no counted token anywhere: nan, as F.cross_entropy's mean
        scale = dp / tokens if tokens else float("nan")
        result.global_loss = loss_sum / tokens if tokens else float("nan")
        result.tokens = tokens
        if local is not None:   # the last stage: this replica's own token mean
            result.loss = local / count if count else float("nan")
    if scale != 1.0:
        scale_by(scale)


def _sum_over(group, loss, count, device) -> list[float]:
    """``[Σ loss, Σ count]`` over ``group``, in one all-reduce (float64)."""
    stats = torch.tensor([loss, count], dtype=torch.float64, device=device)
    if dist.get_world_size(group) > 1:
        C.all_reduce(stats, "sum", group=group)
    return stats.tolist()
