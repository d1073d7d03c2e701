"""One training step of the GPT on a ``dp x pp x tp`` grid (Narayanan et al. 2021, §2-3).

:func:`train_step`, in order, on every rank:

1. zero the gradients;
2. take this replica's shard of the global batch (``tensor_split`` over ``dp``) and run the
   pipeline schedule over the PP group composed with data parallelism over the DP group
   (:func:`~.dp_pipeline.dp_pipeline_step` around the engine's 1F1B, interleaved 1F1B or GPipe);
   the loss is the vocabulary-parallel cross-entropy on the TP group, reduced as
   ``loss_reduction`` says; DP averaging as one flat buffer after the last backward
   (``"flat"``), by the bucketed wrappers during each stage's last backward (``"bucketed"``), by
   ZeRO-1's reduce-scatter after step 4 (``"zero1"``: recorded as ``"dp_sync"``), or by the
   ``fully_shard`` units' hooks during each stage's last backward (``"zero3"``, ``"zero3/keep"``:
   a reduce-scatter over DP×CP; ``"hsdp"``: over CP, then an all-reduce over DP; see :mod:`.dp`);
3. sum the sequence-parallel parameters' partial gradients over the TP group;
4. sum the tied embedding's two copies' gradients over the embedding group;
5. clip by the global norm (:mod:`.clip`; ZeRO-1: from its averaged slices; ZeRO-3 and HSDP:
   from the shards, each once) when ``max_norm`` is given;
6. the optimizer step (ZeRO-1: each replica steps its slice, then all-gathers).

With ``record=True`` steps 3-6 are Events on the engine's timeline too ("sp grads", "tied grads",
"clip", "optimizer"), for :mod:`minidist.hybrid.timeline`.

Context parallelism (``grid.cp_size > 1``): after the DP slice, each rank keeps its positions of
every sample (the model's ``cp_split``, zigzag by default;
:func:`minidist.context_parallel.sharding.shard`); the gradients and the loss are reduced over the DP×CP group (``grid.dp_cp_group``) where they were over DP: the
parameters are replicated over both. ``"per_token"`` is exact for any ignored tokens; ``"mean"``
averages equal-sized shards' means (exact without ignored tokens), as it does over DP replicas.

Steps 2's DP average, 3 and 4 are linear and act on different groups, so their order does not
change the result (beyond fp32 rounding). Returns a :class:`StepOutput` whose ``loss`` is the
global batch's loss on every rank.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import collectives as C
from ..context_parallel.sharding import shard
from ..pipeline_parallel.engine import StepResult
from ..pipeline_parallel.catalog import make_schedule
from ..trace import Event
from ..tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from .clip import clip_grad_norm_
from ..sharding.fsdp import set_requires_gradient_sync
from .dp import DP_MODES, SHARDED, PipelineBucketedDDP, check_sharding, refuse_zero2, shard_stages
from .dp_pipeline import dp_pipeline_step
from .moe import average_gradients, aux_weight, refuse_expert_dp_mode
from .stages import check_grid

__all__ = ["StepOutput", "train_step", "wrap_stages", "make_loss_fn"]


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


def make_loss_fn(model, loss_reduction: str = "mean", ignore_index: int = -100):
    """The last stage's loss on logits ``[b, s, Vp/tp]`` and targets ``[b, s]``: vocab-parallel
    cross-entropy over the TP group; ``"mean"`` over the micro-batch's counted tokens, ``"sum"``,
    or ``"per_token"``: ``(sum, number of targets != ignore_index)``."""
    V, group = model.cfg.vocab_size, model.grid.tp_group

    def ce(y, t, reduction):   # fp32 logits under mixed precision (Megatron-LM's default)
        return vocab_parallel_cross_entropy(y.float(), t, V, reduction=reduction, group=group,
                                            ignore_index=ignore_index)
    if loss_reduction == "per_token":
        return lambda y, t: (ce(y, t, "sum"), int((t != ignore_index).sum()))
    if loss_reduction in ("mean", "sum"):
        return lambda y, t: ce(y, t, loss_reduction)
    raise ValueError(f"make_loss_fn (rank {model.grid.rank}): loss_reduction must be 'mean', "
                     f"'sum' or 'per_token', got {loss_reduction!r}")


def wrap_stages(model, dp_mode: str = "flat", bucket_cap_mb: float = 0.004) -> dict:
    """{stage: module} the engine runs: the stages themselves, or (``"bucketed"``) each wrapped in a
    :class:`~.dp.PipelineBucketedDDP` on the DP group (a small ``bucket_cap_mb``: several buckets
    even for the tiny model); with ``"zero3"``/``"zero3/keep"`` each stage becomes a
    ``fully_shard`` unit over DP×CP, with ``"hsdp"`` one sharded over CP and replicated over DP
    (:mod:`.dp`) — build the optimizer after this. Collective over the DP (×CP) group for
    ``"bucketed"``, ZeRO-3 and HSDP."""
    if dp_mode not in DP_MODES:
        raise ValueError(f"wrap_stages (rank {model.grid.rank}): dp_mode must be one of "
                         f"{DP_MODES}, got {dp_mode!r}")
    refuse_zero2(model, dp_mode, "wrap_stages")
    refuse_expert_dp_mode(model, dp_mode, "wrap_stages")
    if dp_mode in SHARDED:
        shard_stages(model, dp_mode)
    if dp_mode != "bucketed":
        return dict(model.stages)
    return {s: PipelineBucketedDDP(m, group=model.grid.dp_cp_group, bucket_cap_mb=bucket_cap_mb)
            for s, m in sorted(model.stages.items())}


def train_step(model, optimizer, modules: dict, ids: torch.Tensor, targets: torch.Tensor,
               microbatches: int, schedule: str | None = None, dp_mode: str = "flat",
               loss_reduction: str | None = None, max_norm: float | None = None,
               record: bool = False, step: bool = True,
               autocast_dtype: torch.dtype | None = None) -> StepOutput:
    """One step on the global batch ``ids``/``targets`` ``[B, s]`` (the same on every rank).

    ``model``: a :class:`~.stages.HybridGPT`; ``modules``: from :func:`wrap_stages` with the same
    ``dp_mode``; ``optimizer``: from :func:`~.dp.make_optimizer` (or None with ``step=False``: the
    gradients are then averaged by one flat all-reduce, also for ``"zero1"``, whose optimizer
    otherwise reduce-scatters them: ``p.grad`` then stays this replica's, and
    ``optimizer.full_gradients_()`` writes the averaged, clipped ones back);
    ``schedule``: any of :data:`~minidist.pipeline_parallel.catalog.SCHEDULES` that fits the
    model's chunks and placement: ``"gpipe"``, ``"1f1b"``, ``"zb-h1"`` (one chunk),
    ``"interleaved"`` (chunks > 1), ``"zb-v"``, ``"dualpipe-v"`` (``placement="v"``); None:
    ``"1f1b"``, or ``"interleaved"`` when ``model.chunks > 1``.
    ``step=False`` stops after clipping (gradients left in ``.grad``, for checks).
    ``loss_reduction``: ``"mean"`` (each micro-batch's token mean, averaged: one process's mean
    only when every shard counts the same tokens), ``"sum"``, ``"per_token"`` (the global token
    mean, however the ignored targets fall), or None: ``"per_token"`` when any target is
    ``-100`` (ignored), else ``"mean"``.
    ``autocast_dtype``: mixed precision (e.g. ``torch.bfloat16``): every stage's forward runs under
    ``torch.autocast``, backwards outside it; parameters, gradients, their averaging and the
    optimizer stay fp32 (torch's AMP recipe); the logits are cast to fp32 for the cross-entropy
    (Megatron-LM's default, ``fp16_lm_cross_entropy=False``); recomputation replays the autocast
    state of the forward; MoE routers stay fp32.
    Gradient accumulation is ``microbatches``: the gradients of the micro-batches add up (weighted
    so the sum is the global batch's loss, :mod:`~minidist.pipeline_parallel.microbatch`, also
    when they differ in size by one) and are averaged over DP once, after the last.

    Raises ``ValueError`` (every rank, before communicating) when ``B`` does not split over dp,
    a replica gets fewer than ``microbatches`` samples, the grid does not fit the model, the
    modules were built for another ``dp_mode`` (ZeRO-3 units stepped as ``"hsdp"``: the norm would
    count the shards over the wrong group), the schedule does not fit the model's chunks and
    placement (naming both), a zero-bubble schedule meets ZeRO-3 or HSDP units, or
    ``loss_reduction="mean"`` meets ignored targets while the batch is cut into several shards
    (replicas, CP ranks or micro-batches): each shard would average over its own count of tokens
    and the result differ from one process (Megatron-LM warns of the same; pass
    ``"per_token"``).
    """
    grid, cfg = model.grid, model.cfg
    if dp_mode == "zero1" and optimizer is not None and not hasattr(optimizer, "reduce_gradients"):
        raise ValueError(f"train_step (rank {grid.rank}): dp_mode='zero1' needs the ZeRO1Optimizer "
                         "of make_optimizer(model, 'zero1', ...) (it averages the gradients)")
    wrapped = [isinstance(m, PipelineBucketedDDP) for m in modules.values()]
    if any(wrapped) != (dp_mode == "bucketed") or len(set(wrapped)) > 1:
        raise ValueError(f"train_step (rank {grid.rank}): modules do not match dp_mode="
                         f"{dp_mode!r}; build them with wrap_stages(model, {dp_mode!r})")
    refuse_zero2(model, dp_mode, "train_step")
    refuse_expert_dp_mode(model, dp_mode, "train_step")
    sharded = [hasattr(m, "_fsdp") for m in model.stages.values()]
    if any(sharded) != (dp_mode in SHARDED):
        raise ValueError(f"train_step (rank {grid.rank}): the stages are{'' if any(sharded) else ' not'}"
                         f" fully_shard units but dp_mode={dp_mode!r}; build them with "
                         f"wrap_stages(model, {dp_mode!r})")
    if dp_mode in SHARDED:
        check_sharding(model, dp_mode, "train_step")
    cp = grid.cp_size
    check_grid(cfg, grid.dp_size, grid.pp_size, grid.tp_size, model.chunks,
               model.sequence_parallel, grid.rank, ids.shape[1], ids.shape[0], microbatches, cp,
               model.placement)
    loss_reduction = _reduction(grid, targets, microbatches, loss_reduction, cp)
    if schedule is None:
        schedule = "interleaved" if model.chunks > 1 else "1f1b"
    sched = make_schedule(schedule, grid.pp_size, microbatches, v=model.chunks)
    if sched.v != model.chunks or sched.placement != model.placement:
        raise ValueError(f"train_step (rank {grid.rank}): schedule {schedule!r} runs {sched.v} "
                         f"chunk(s) per rank placed {sched.placement!r}, but the model was built "
                         f"with chunks={model.chunks}, placement={model.placement!r}; build "
                         f"HybridGPT(..., chunks={sched.v}, placement={sched.placement!r}) or pick "
                         "a schedule for the model")
    if dp_mode in SHARDED and sched.split(grid.pp_rank):
        kind = "HSDP" if dp_mode == "hsdp" else "ZeRO-3"
        raise ValueError(f"train_step (rank {grid.rank}): dp_mode={dp_mode!r} ({kind}, "
                         f"fully_shard per stage) with the zero-bubble schedule {schedule!r} is "
                         "not supported: its weight pass W runs as a backward of its own, outside "
                         "the backward whose hooks FSDP's reduce-scatter follows; use '1f1b', "
                         "'gpipe' or 'interleaved', or dp_mode='zero1'")
    model.zero_grad()
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    x = ids.tensor_split(grid.dp_size)[grid.dp_rank]
    y = targets.tensor_split(grid.dp_size)[grid.dp_rank]
    if cp > 1:   # this rank's positions of every sample
        x, y = (shard(t, model.cp_split, cp, grid.cp_rank, dim=1) for t in (x, y))
    bucketed, zero1 = dp_mode == "bucketed", dp_mode == "zero1" and optimizer is not None
    fsdp = dp_mode in SHARDED   # ZeRO-3 or HSDP: the units' hooks reduce the gradients
    ctx = ((lambda s, m, last: modules[s].backward_sync(last)) if bucketed else
           (lambda s, m, last: _gradient_sync(modules[s], last)) if fsdp else None)
    average: bool | Callable[[], None] = not (bucketed or zero1 or fsdp)
    if model.moe_layers:   # experts: their aux losses' weights, their own gradient average
        tokens = int((targets != -100).sum())
        weight = aux_weight(loss_reduction, x.shape[0], len(grid.dp_cp_ranks), tokens)
        for layer in model.moe_layers:
            layer.aux_scale = weight
        if average:
            average = lambda: average_gradients(model.parameters(), grid)   # noqa: E731
    with _AuxMeter(model, x.shape[0]) as aux:
        result = dp_pipeline_step(sched, modules, x, y, make_loss_fn(model, loss_reduction),
                                  grid.pp_group, grid.dp_cp_group, loss_reduction=loss_reduction,
                                  average=average, record=record, backward_context=ctx,
                                  device=_device(model), autocast_dtype=autocast_dtype)
    with _timed(result, record, "sp grads", grid.pp_rank, model.sequence_parallel):
        model.finish_sequence_parallel_grads()
    with _timed(result, record, "tied grads", grid.pp_rank, grid.embedding_group is not None
                and model.tied):
        model.allreduce_tied_grads()
    if zero1:   # the DP average: ZeRO-1's reduce-scatter (each rank its slice), then clip those
        with _timed(result, record, "dp_sync", grid.pp_rank):
            optimizer.reduce_gradients()
    with _timed(result, record, "clip", grid.pp_rank, max_norm is not None):
        norm = None
        if max_norm is not None:
            norm = (optimizer.clip_grad_norm_(max_norm) if zero1
                    else clip_grad_norm_(model, max_norm, dp_sharded=fsdp and dp_mode != "hsdp",
                                         cp_sharded=dp_mode == "hsdp"))
    with _timed(result, record, "optimizer", grid.pp_rank, step):
        if step:
            optimizer.step()
    loss = _global_loss(model, result, loss_reduction)
    aux_loss = aux.global_value() if model.moe_layers else None
    return StepOutput(loss + (aux_loss or 0.0), norm, result, aux_loss)


class _AuxMeter:
    """Sums this rank's aux losses over the step's micro-batches, each weighted ``b / samples``
    (a forward hook on every stage: a stage's forward runs once per micro-batch, while a
    recomputed block runs again in backward). :meth:`global_value`: summed over the pipeline,
    averaged over DP×CP (the TP ranks hold the same)."""

    def __init__(self, model, samples: int):
        self.model, self.samples, self.total = model, samples, 0.0
        self.handles: list = []

    def _hook(self, stage, args, out):
        layers = [b.mlp for b in stage.blocks]
        b = args[0].shape[0]
        self.total += b / self.samples * sum(float(m.aux_loss.detach()) for m in layers)

    def __enter__(self):
        if self.model.moe_layers:
            self.handles = [s.register_forward_hook(self._hook) for s in self.model.stages.values()]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()

    def global_value(self) -> float:
        grid = self.model.grid
        t = torch.tensor([self.total], dtype=torch.float64, device=_device(self.model))
        if grid.pp_size > 1:
            C.all_reduce(t, "sum", group=grid.pp_group)
        if len(grid.dp_cp_ranks) > 1:
            C.all_reduce(t, "avg", group=grid.dp_cp_group)
        return float(t)


@contextlib.contextmanager
def _gradient_sync(stage, sync: bool):
    """ZeRO-3 and HSDP: the backward inside reduce-scatters the accumulated gradient iff ``sync``
    (the stage's last micro-batch; HSDP then all-reduces the piece over DP), else keeps
    accumulating it unsharded."""
    set_requires_gradient_sync(stage, sync)
    try:
        yield
    finally:
        set_requires_gradient_sync(stage, True)


def _reduction(grid, targets: torch.Tensor, microbatches: int, loss_reduction, cp: int) -> str:
    """The loss reduction to run (see :func:`train_step`); decided from the global targets,
    which every rank holds, so every rank decides the same without communicating."""
    ignored = bool((targets == -100).any())
    if loss_reduction is None:
        return "per_token" if ignored else "mean"
    shards = grid.dp_size * cp * microbatches
    if loss_reduction == "mean" and ignored and shards > 1:
        cut = ", ".join(f"{k}={v}" for k, v in (("dp", grid.dp_size), ("cp", cp),
                                                ("microbatches", microbatches)) if v > 1)
        raise ValueError(f"train_step (rank {grid.rank}): loss_reduction='mean' with ignored "
                         f"targets (-100) over {shards} shards ({cut}): each shard would average "
                         "over its own count of tokens, which differs from one process's mean "
                         "over all of them; pass loss_reduction='per_token' (or None)")
    return loss_reduction


@contextlib.contextmanager
def _timed(result: StepResult, record: bool, name: str, rank: int, applies: bool = True):
    """With ``record``: the block becomes an Event ``name`` on the step's timeline (times from
    ``result.t0``, as the engine's; ``rank`` its pipeline rank), when it ``applies``."""
    start = time.perf_counter()
    yield
    if record and applies:
        result.events.append(Event(name, start - result.t0, time.perf_counter() - result.t0,
                                   rank=rank))


def _device(model):
    params = model.parameters()
    return params[0].device if params else None


def _global_loss(model, result: StepResult, loss_reduction: str) -> float:
    """"sum"/"per_token": dp_pipeline_step already reduced it. "mean": the last stage's replica mean,
    sent to every stage (a sum where only the last stage is non-zero), averaged over replicas."""
    if result.global_loss is not None:
        return result.global_loss
    grid = model.grid
    t = torch.tensor([result.loss or 0.0], dtype=torch.float64, device=_device(model))
    if grid.pp_size > 1:
        C.all_reduce(t, "sum", group=grid.pp_group)
    if len(grid.dp_cp_ranks) > 1:
        C.all_reduce(t, "avg", group=grid.dp_cp_group)
    return float(t)
