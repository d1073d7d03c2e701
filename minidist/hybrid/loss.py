"""The step's loss in one place: the last stage's loss function, and the global batch's loss (and
the experts' aux loss) every rank reports.

The loss reaches the gradients through the engine (:mod:`minidist.pipeline_parallel.microbatch`
weighs the micro-batches, :func:`~.dp_pipeline.dp_pipeline_step` the replicas for ``"sum"`` and
``"per_token"``); what is here only reports it: summed over the pipeline (one stage holds it),
averaged over DP×CP (each replica its share), the TP ranks holding the same.
"""

from __future__ import annotations

import torch

from .. import collectives as C
from ..pipeline_parallel.engine import StepResult
from ..tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

__all__ = ["make_loss_fn", "global_loss", "AuxMeter", "device_of"]


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


def device_of(model):
    params = model.parameters()
    return params[0].device if params else None


def _report(model, value: float, over_tp: bool = False) -> float:
    """``value`` summed over the pipeline, averaged over DP×CP (and over TP: ``over_tp``)."""
    grid = model.grid
    t = torch.tensor([value], dtype=torch.float64, device=device_of(model))
    if grid.pp_size > 1:
        C.all_reduce(t, "sum", group=grid.pp_group)
    if len(grid.dp_cp_ranks) > 1:
        C.all_reduce(t, "avg", group=grid.dp_cp_group)
    if over_tp and grid.tp_size > 1:
        C.all_reduce(t, "avg", group=grid.tp_group)
    return float(t)


def global_loss(model, result: StepResult) -> float:
    """The global batch's loss: ``"sum"``/``"per_token"`` were reduced by ``dp_pipeline_step``;
    ``"mean"``: the last stage's replica mean, reported."""
    if result.global_loss is not None:
        return result.global_loss
    return _report(model, result.loss or 0.0)


class AuxMeter:
    """Sums this rank's aux losses over the step's micro-batches, each weighted ``b / samples``
    (a forward hook on every stage: a stage's forward runs once per micro-batch, while a
    recomputed block runs again in backward). :meth:`global_value`: reported as the loss is."""

    def __init__(self, model, samples: int):
        self.model, self.samples, self.total = model, samples, 0.0
        self.handles: list = []

    def _hook(self, stage, args, out):
        b = args[0].shape[0]
        self.total += b / self.samples * sum(float(blk.mlp.aux_loss.detach()) for blk in stage.blocks)

    def __enter__(self):
        if self.model.moe_layers:
            self.handles = [s.register_forward_hook(self._hook) for s in self.model.stages.values()]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()

    def global_value(self) -> float:
        """Reported as the loss is; with sequence parallelism each TP rank's aux loss is over its
        own positions (equal shares): averaged over TP too."""
        return _report(self.model, self.total, over_tp=self.model.sequence_parallel)
