"""Data parallelism across the DP group of a 3-D grid: the three ways minidist averages gradients.

``"flat"``: after the rank's last backward, the pipeline engine averages all of its stages'
gradients as one flat buffer (:func:`minidist.pipeline_parallel.engine.sync_gradients`).

``"bucketed"``: each stage (model chunk) is wrapped in :class:`PipelineBucketedDDP`, minidist's
:class:`~minidist.data_parallel.BucketedDDP` whose sync decision is taken per *backward*: a
pipeline runs the forwards and backwards of different micro-batches interleaved, so the decision a
forward takes (torch DDP's rule) belongs to another micro-batch by the time a backward runs. The
engine enters :meth:`PipelineBucketedDDP.backward_sync` around every backward: no sync except the
stage's last micro-batch, whose backward fills the buckets and all-reduces them on the
communication thread while that backward continues (gradient accumulation over micro-batches,
then overlap with the last one: Narayanan et al. 2021, §3.3; Megatron-LM's ``no_sync`` /
``enable_grad_sync`` in its pipeline schedules). One wrapper per chunk, as Megatron-LM's one DDP
per model chunk: a chunk's last backward is not the rank's last.

``"zero1"``: the flat average, then :class:`minidist.sharding.zero.ShardedOptimizer` (stage 1,
``grads="averaged"``, on the DP group): each replica keeps and steps 1/dp of the optimizer state,
then all-gathers the parameters (Rajbhandari et al. 2020, P_os).
"""

from __future__ import annotations

import contextlib

import torch

from ..data_parallel.bucketed import BucketedDDP
from ..sharding.zero import ShardedOptimizer

__all__ = ["DP_MODES", "PipelineBucketedDDP", "make_optimizer"]

DP_MODES = ("flat", "bucketed", "zero1")


class PipelineBucketedDDP(BucketedDDP):
    """:class:`~minidist.data_parallel.BucketedDDP` for one pipeline stage: the sync decision is
    given per backward by :meth:`backward_sync` (the engine's ``backward_context``)."""

    @contextlib.contextmanager
    def backward_sync(self, sync: bool):
        """Backwards run inside synchronise iff ``sync`` (whatever the last forward decided)."""
        previous = (self._sync_enabled, self._sync_this_backward)
        self._sync_enabled = self._sync_this_backward = bool(sync)
        try:
            yield
        finally:
            self._sync_enabled, self._sync_this_backward = previous


def make_optimizer(model, dp_mode: str, optimizer_class=torch.optim.AdamW, **defaults):
    """The optimizer for ``model`` (a :class:`~.stages.HybridGPT`): ``optimizer_class`` over its
    parameters, or a ZeRO-1 :class:`ShardedOptimizer` on the grid's DP group for ``"zero1"``."""
    if dp_mode not in DP_MODES:
        raise ValueError(f"make_optimizer (rank {model.grid.rank}): dp_mode must be one of "
                         f"{DP_MODES}, got {dp_mode!r}")
    if dp_mode == "zero1":
        return ShardedOptimizer(model.parameters(), optimizer_class, group=model.grid.dp_group,
                                stage=1, grads="averaged", **defaults)
    return optimizer_class(model.parameters(), **defaults)
