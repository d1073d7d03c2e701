"""One small object per way of averaging the gradients (``dp_mode``, :mod:`.dp` says what each
does): what the step asks of it at three points — around each backward, after the pipeline's last
backward, and when clipping.

========================  ===================  ==========================  =====================
mode                      around a backward    after the last backward     the clip's norm
========================  ===================  ==========================  =====================
``flat``                  nothing              one flat all-reduce         replicated grads
``bucketed``              the wrapper's sync   (its buckets already ran)   replicated grads
``zero1``                 nothing              ZeRO-1's reduce-scatter     from the slices
``zero2``                 a reduce-scatter     the tied copies' slices     from the slices
                          after it
``zero3``, ``hsdp``       the units' sync      (their hooks already ran)   from the shards
========================  ===================  ==========================  =====================
"""

from __future__ import annotations

import contextlib

from ..sharding.fsdp import set_requires_gradient_sync, units
from ..trace import span
from .clip import clip_grad_norm_
from .dp import DP_MODES, SHARDED, PipelineBucketedDDP, shard_stages
from ..expert_parallel.gpt import is_expert
from .moe import average_expert_gradients, average_gradients, refuse_expert_dp_mode

__all__ = ["DPMode", "dp_mode_for", "wrap_stages"]


class DPMode:
    """``flat`` (and ``zero1`` without an optimizer): after the last backward the engine averages
    all of a rank's gradients over DP×CP as one flat buffer; with experts, each over its own
    replicas (:func:`~.moe.average_gradients`)."""

    def __init__(self, model, optimizer, modules: dict):
        self.model, self.optimizer, self.modules = model, optimizer, modules

    def backward_context(self):
        """``(stage, module, last micro-batch) -> context manager`` around each backward, or None."""
        return None

    def average(self):
        """What :func:`~.dp_pipeline.dp_pipeline_step` averages with: True (one flat all-reduce),
        False (someone else does), or a function of no argument."""
        if self.model.moe_layers:
            return lambda: average_gradients(self.model.parameters(), self.model.grid)
        return True

    def scale(self):
        """``factor -> None`` multiplying the gradients (``"sum"``, ``"per_token"``), or None: every
        ``.grad`` of the stages."""
        return None

    def after_backward(self) -> None:
        """Work after the pipeline, before clipping."""

    def clip(self, max_norm: float) -> float:
        return clip_grad_norm_(self.model, max_norm)


class Bucketed(DPMode):
    """Each stage's :class:`~.dp.PipelineBucketedDDP` all-reduces its buckets during the stage's
    last backward; experts sharded over EP are left out of its buckets and averaged after the
    pipeline over their own replicas (torchtitan's dp_shard_mod_ep mesh, as a DDP)."""

    def backward_context(self):
        return lambda s, m, last: self.modules[s].backward_sync(last)

    def average(self):
        if self.model.moe_layers and self.model.grid.ep_size > 1:
            return lambda: average_expert_gradients(self.model.parameters(), self.model.grid)
        return False


class ZeRO1(DPMode):
    """The :class:`~.dp.ZeRO1Optimizer` reduce-scatters the local gradients after the pipeline and
    clips from its averaged slices."""

    def average(self):
        return False

    def after_backward(self) -> None:
        with span("dp_sync"):
            self.optimizer.reduce_gradients()

    def clip(self, max_norm: float) -> float:
        return self.optimizer.clip_grad_norm_(max_norm)


class ZeRO2(ZeRO1):
    """ZeRO-2 under a pipeline: after every backward (each micro-batch of each stage; under a
    zero-bubble split, after W) the :class:`~.dp.ZeRO1Optimizer` reduce-scatters the gradients
    into its slices and frees them: M reduce-scatters a step where ZeRO-1 runs one — why
    DeepSpeed's pipeline engine refuses ZeRO-2 (deepspeedai/DeepSpeed#823); FSDP2 under torch's
    pipelining does the same when gradient sync is left on for every micro-batch. The tied
    embedding's copies are summed on the slices."""

    def backward_context(self):
        return lambda s, m, last: _then(self.optimizer.reduce_backward)

    def scale(self):
        return self.optimizer.scale_slices

    def after_backward(self) -> None:
        with span("dp_sync"):
            self.optimizer.sum_tied_slices()


class Sharded(DPMode):
    """ZeRO-3 and HSDP: each stage's ``fully_shard`` unit reduce-scatters (HSDP: then all-reduces
    over DP) the accumulated gradient during the stage's last backward; the norm sums each shard
    once (HSDP's DP replicas hold the same piece, so over CP only)."""

    def __init__(self, model, optimizer, modules: dict, hsdp: bool):
        super().__init__(model, optimizer, modules)
        self.hsdp = hsdp

    def backward_context(self):
        return lambda s, m, last: _gradient_sync(self.modules[s], last)

    def average(self):
        return False

    def clip(self, max_norm: float) -> float:
        return clip_grad_norm_(self.model, max_norm, dp_sharded=not self.hsdp, cp_sharded=self.hsdp)


def dp_mode_for(dp_mode: str, model, optimizer, modules: dict) -> DPMode:
    """The object for ``dp_mode`` (already checked by :func:`~.check_step.check_step`)."""
    if dp_mode == "bucketed":
        return Bucketed(model, optimizer, modules)
    if dp_mode == "zero1" and optimizer is not None:
        return ZeRO1(model, optimizer, modules)
    if dp_mode == "zero2" and optimizer is not None:
        return ZeRO2(model, optimizer, modules)
    if dp_mode in SHARDED:
        return Sharded(model, optimizer, modules, hsdp=dp_mode == "hsdp")
    return DPMode(model, optimizer, modules)


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
    refuse_expert_dp_mode(model, dp_mode, "wrap_stages")
    if dp_mode in SHARDED:
        shard_stages(model, dp_mode)
    if dp_mode != "bucketed":
        return dict(model.stages)
    sharded = model.grid.ep_size > 1   # experts: replicated over expert-DP, not over DP×CP
    return {s: PipelineBucketedDDP(m, group=model.grid.dp_cp_group, bucket_cap_mb=bucket_cap_mb,
                                   ignored_params=[p for p in m.parameters()
                                                   if sharded and is_expert(p)])
            for s, m in sorted(model.stages.items())}


@contextlib.contextmanager
def _then(work):
    """Run ``work()`` after the block (the backward inside)."""
    yield
    work()


@contextlib.contextmanager
def _gradient_sync(stage, sync: bool):
    """The backward inside reduce-scatters the accumulated gradient iff ``sync`` (the stage's last
    micro-batch), else keeps accumulating it unsharded. A zero-bubble schedule's weight pass W is
    a backward of its own, after the one whose hooks gathered the unit and finished its reduction:
    the unit is gathered before (the saved views are views of its buffer) and its reduction
    finished after, as torch's pipelining calls FSDP2's post-backward after W (pytorch#134052)."""
    set_requires_gradient_sync(stage, sync)
    try:
        for unit in units(stage):   # the stage and the units below it (experts over expert-DP)
            unit.start_backward()
        yield
    finally:
        set_requires_gradient_sync(stage, True)
    stage._fsdp.finish_backward()
