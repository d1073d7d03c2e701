"""Data parallelism across the DP group of a 3-D grid: the ways minidist averages gradients.

``"flat"`` (one flat all-reduce after the rank's last backward), ``"bucketed"``
(:class:`PipelineBucketedDDP`, buckets overlapped with each stage's last backward),
``"zero1"`` (:class:`ZeRO1Optimizer`: one reduce-scatter after the pipeline; experts sharded
apart over their expert-DP group, :class:`ExpertSlices`), ``"zero2"`` (the same optimizer, a
reduce-scatter after every backward), ``"zero3"``/``"zero3/keep"`` (each stage a
``fully_shard`` unit over DP×CP, experts units of their own over expert-DP) and ``"hsdp"``
(sharded over CP, replicated over DP: torchtitan's mesh). Narayanan et al. 2021, §3.3;
Rajbhandari et al. 2020, §5. What each does and why, with sources: docs/design/hybrid.md.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from .. import collectives as C

from ..data_parallel.bucketed import BucketedDDP
from ..data_parallel.clip import clip_by_global_norm_
from ..sharding.fsdp import fully_shard, set_gradient_divide_factor
from ..sharding.zero import ShardedOptimizer
from .clip import _reduce_tp_pp
from ..expert_parallel.gpt import is_expert
from .moe import refuse_expert_dp_mode

__all__ = ["DP_MODES", "ZERO3", "SHARDED", "PipelineBucketedDDP", "ZeRO1Optimizer", "ExpertSlices", "sharded_parts",
           "make_optimizer", "shard_stages", "check_sharding", "self_group"]

DP_MODES = ("flat", "bucketed", "zero1", "zero2", "zero3", "zero3/keep", "hsdp")
ZERO3 = ("zero3", "zero3/keep")
SHARDED = ZERO3 + ("hsdp",)     # the modes whose stages are fully_shard units


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


class ZeRO1Optimizer(ShardedOptimizer):
    """ZeRO-1 on the DP group of ``model`` (a :class:`~.stages.HybridGPT`) with the gradient
    reduction and clipping on the slices. ``p.grad`` is this replica's (un-averaged) gradient.

    :meth:`reduce_gradients` (reduce-scatter: each rank gets its slice of the DP average),
    :meth:`clip_grad_norm_` (the global norm from the slices: each element counted once, TP-
    replicated parameters on TP rank 0 only, the tied copy not at all; summed over DP, TP and PP),
    :meth:`step` (reduces first if not done yet; steps the slices; all-gathers the parameters).
    With experts sharded over EP (``ep > 1``) the experts are sharded apart, over their expert-DP
    group (``experts``: :class:`ExpertSlices`), as Megatron-Core's distributed optimizer shards
    expert parameters over the expert-data-parallel group.
    """

    def __init__(self, model, optimizer_class=torch.optim.AdamW, **defaults):
        # each copy of a tied embedding in a param group (a flat buffer) of its own: the first
        # and the last stage then reduce-scatter it at the same offsets, in the same order, so the
        # two copies get bitwise the same averaged gradient and stay identical
        tied = [] if not model.tied else [p for p in (
            model.first.tok_emb.weight if model.first is not None else None,
            model.last.head.weight if model.last is not None else None) if p is not None]
        apart = [p for p in model.parameters() if model.grid.ep_size > 1 and is_expert(p)]
        rest = [p for p in model.parameters()
                if all(p is not t for t in tied) and all(p is not e for e in apart)]
        groups = [{"params": [t]} for t in tied] + ([{"params": rest}] if rest else [])
        super().__init__(groups, optimizer_class, group=model.grid.dp_cp_group, stage=1,
                         grads="local", **defaults)
        self.model, self._reduced = model, False
        self.experts = ExpertSlices(apart, optimizer_class, model, **defaults) if apart else None
        # per part, per buffer: which elements the norm counts (1/0)
        self._counted = [_norm_masks(part, model) for part in self.parts()]

    def parts(self) -> list[ShardedOptimizer]:
        """The sharded optimizers: this one (dense, over DP×CP) and the experts' (if any)."""
        return [self] + ([self.experts] if self.experts is not None else [])

    def reduce_gradients(self) -> None:
        """Reduce-scatter every buffer's gradients: this rank's slice of the DP average.
        ``RuntimeError`` naming the parameters whose ``requires_grad`` changed since
        construction (the norm masks are per buffer: rebuild the optimizer after a change)."""
        for part in self.parts():
            changed = [f"parameter {i} {tuple(p.shape)}" for i, p in enumerate(part.all_params)
                       if p.requires_grad != (p in part._where)]
            if changed:
                raise RuntimeError(f"ZeRO1Optimizer (rank {self.rank}): requires_grad changed "
                                   f"since it was built for {', '.join(changed)}; build a new "
                                   "optimizer (state_dict()/load_state_dict() carry the state)")
        for part in self.parts():
            part._stage1_grads()
        self._reduced = True

    def clip_grad_norm_(self, max_norm: float) -> float:
        """The global gradient norm from the averaged slices (every rank); scale the slices by
        ``min(1, max_norm / (norm + 1e-6))`` as ``torch.nn.utils.clip_grad_norm_``."""
        if not self._reduced:
            self.reduce_gradients()
        total = torch.zeros(1, dtype=torch.float64, device=self._counted[0][0].device)
        grads = []
        for part, masks in zip(self.parts(), self._counted):   # expert slices: disjoint over
            for b, mask in zip(part.buckets, masks):           # DP×CP too (EP × expert-DP)
                if b.shard.grad is not None:
                    total += (b.shard.grad.double().pow(2) * mask).sum()
                    grads.append(b.shard.grad)
        return float(clip_by_global_norm_(total, grads, max_norm,
                                          _reduce_tp_pp(self.model.grid, dp=True)))

    @torch.no_grad()
    def full_gradients_(self) -> None:
        """Write the averaged (and clipped) gradients into every ``p.grad``: an all-gather per
        buffer. For checks and inspection only (ZeRO-1 never needs the full gradient)."""
        if not self._reduced:
            self.reduce_gradients()
        for part in self.parts():
            for b in part.buckets:
                flat = b.layout.empty()
                part.comm.all_gather(flat, b.shard.grad.contiguous())
                for p, v in zip(b.params, b.layout.views(flat)):
                    p.grad = v.clone()

    def step(self, closure=None):
        if closure is not None:
            raise ValueError("ZeRO1Optimizer.step: closures are not supported")
        if not self._reduced:
            self.reduce_gradients()
        self._reduced = False
        for part in self.parts():
            part.optim.step()
            with torch.no_grad():
                for b in part.buckets:
                    part.comm.all_gather(b.flat, b.shard)
                    b.shard.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        if self.experts is not None:
            self.experts.zero_grad(set_to_none)
        self._reduced = False

    @torch.no_grad()
    def reduce_backward(self) -> None:
        """ZeRO-2: the gradients one backward left in ``p.grad`` (sequence-parallel ones summed
        over TP first) reduce-scattered into the slices, added to what earlier backwards left
        there, and freed. Every rank of the DP group after the same backward."""
        self.model.finish_sequence_parallel_grads()     # linear: per backward or once, alike
        for part in self.parts():
            for b in part.buckets:
                flat = b.layout.pack([p.grad if p.grad is not None else torch.zeros_like(p)
                                      for p in b.params])
                shard = b.layout.shard(flat)
                part.comm.reduce_scatter(shard, flat, divisor=part.gradient_divisor())
                b.shard.grad = shard.clone() if b.shard.grad is None else b.shard.grad + shard
                for p in b.params:
                    p.grad = None
        self._reduced = True

    @torch.no_grad()
    def scale_slices(self, factor: float) -> None:
        """ZeRO-2: multiply the gradients its slices hold by ``factor``."""
        for part in self.parts():
            for b in part.buckets:
                if b.shard.grad is not None:
                    b.shard.grad.mul_(factor)

    @torch.no_grad()
    def sum_tied_slices(self) -> None:
        """ZeRO-2: the tied embedding's two copies' slices summed (their buffers have one layout):
        on this rank when it holds both, else over the grid's embedding group."""
        model, n = self.model, int(model_tied_count(self.model))
        if n == 2:
            a, b = self.buckets[0].shard, self.buckets[1].shard
            a.grad = a.grad + b.grad
            b.grad = a.grad.clone()
        elif n == 1 and model.grid.embedding_group is not None:
            C.all_reduce(self.buckets[0].shard.grad, "sum", group=model.grid.embedding_group)


class ExpertSlices(ShardedOptimizer):
    """ZeRO-1 of the experts of ``model`` over their expert-DP group (the ranks that hold the same
    experts). The reduce-scatter sums the local gradients and divides by DP×CP, not by the group's
    size: backward's all-to-all already summed the EP ranks' contributions (the average over
    expert-DP, then ``/ep``, of :func:`~.moe.average_gradients`)."""

    def __init__(self, params, optimizer_class, model, **defaults):
        super().__init__([{"params": params}], optimizer_class, group=model.grid.expert_dp_group,
                         stage=1, grads="local", **defaults)
        self._divisor = len(model.grid.dp_cp_ranks)

    def gradient_divisor(self) -> float:
        return self._divisor


def model_tied_count(model) -> int:
    """How many copies of a tied embedding this rank holds (0, 1 or 2: the first groups of a
    :class:`ZeRO1Optimizer`)."""
    if not model.tied:
        return 0
    return (model.first is not None) + (model.last is not None)


def sharded_parts(optimizer) -> list[ShardedOptimizer]:
    """A ZeRO optimizer's sharded parts (a :class:`ZeRO1Optimizer` with experts apart: two)."""
    return optimizer.parts() if isinstance(optimizer, ZeRO1Optimizer) else [optimizer]


def _norm_masks(opt: ShardedOptimizer, model) -> list:
    """Per flat buffer of ``opt``, this rank's slice of a 1/0 mask: the elements the norm counts
    (TP-replicated parameters on TP rank 0 only, the tied copy not at all)."""
    tp_rank, masks = model.grid.tp_rank, []
    for b in opt.buckets:
        flags = [float(not model.is_tied_copy(p) and
                       (getattr(p, "tensor_model_parallel", False) or tp_rank == 0))
                 for p in b.params]
        mask = b.layout.pack([torch.full(p.shape, f, device=p.device)
                              for p, f in zip(b.params, flags)])
        masks.append(b.layout.shard(mask).double())
    return masks


_SELF: dict = {}   # "group" -> (the world it was made in, this rank alone as a group)


def self_group():
    """This rank alone as a process group (HSDP's shard group when ``cp == 1``). Every rank makes
    its own at the same point (``use_local_synchronization``: only the member takes part, and
    torch's group counter advances alike on every rank), once per process and world: a second
    call returns the same group (a group holds gloo threads until the process ends)."""
    here = dist.GroupMember.WORLD
    hit = _SELF.get("group")
    if hit is not None and hit[0] is here:
        return hit[1]
    group = dist.new_group([dist.get_rank()], use_local_synchronization=True)
    _SELF["group"] = (here, group)
    return group


def _groups(model, dp_mode: str) -> tuple:
    """``(shard group, replicate group or None, shard ranks, replicate ranks or None)`` of
    ``dp_mode``'s units (docs/design/hybrid.md)."""
    grid = model.grid
    if dp_mode != "hsdp":
        return grid.dp_cp_group, None, list(grid.dp_cp_ranks), None
    shard = grid.cp_group if grid.cp_size > 1 else self_group()   # never None: None is the world
    rep = grid.dp_group if grid.dp_size > 1 else None
    return shard, rep, list(grid.cp_ranks), (list(grid.dp_ranks) if rep is not None else None)


def shard_stages(model, dp_mode: str) -> None:
    """``"zero3"``/``"zero3/keep"``: make each of ``model``'s stages a ``fully_shard`` unit on the
    DP×CP group; ``"hsdp"``: sharded over the CP group (this rank alone when ``cp == 1``) and
    replicated over the DP group (docs/design/hybrid.md). Collective over those groups (the units
    sync from their rank 0; HSDP checks the layout with one all-gather over DP)."""
    shard, rep, _, _ = _groups(model, dp_mode)
    reshard = dp_mode == "zero3" or (dp_mode == "hsdp" and model.grid.pp_size == 1)
    grid = model.grid
    for s in sorted(model.stages):
        if grid.ep_size > 1:   # each expert a unit over its expert-DP group, summed over DP×CP
            for layer in model.moe_layers:
                for expert in (layer.experts if _within(layer, model.stages[s]) else ()):
                    fully_shard(expert, group=grid.expert_dp_group, reshard_after_forward=reshard)
                    set_gradient_divide_factor(expert, len(grid.dp_cp_ranks))
        fully_shard(model.stages[s], group=shard, replicate_group=rep,
                    reshard_after_forward=reshard)


def _within(module, stage) -> bool:
    return any(m is module for m in stage.modules())


def check_sharding(model, dp_mode: str, who: str) -> None:
    """``ValueError`` (every rank, no communication) when ``model``'s stages are not sharded the
    way ``dp_mode`` shards them (e.g. wrapped for ``"zero3"``, stepped as ``"hsdp"``: the
    clipping would count the shards over the wrong group)."""
    _, _, shard, rep = _groups(model, dp_mode)
    for s, stage in sorted(model.stages.items()):
        unit = getattr(stage, "_fsdp", None)
        if unit is None:
            continue
        has = sorted(dist.get_process_group_ranks(unit.comm.group) if unit.comm.group is not None
                     else range(dist.get_world_size()))
        has_rep = (None if getattr(unit, "rep", None) is None else
                   sorted(dist.get_process_group_ranks(unit.rep.group)))
        if has != sorted(shard) or has_rep != (sorted(rep) if rep is not None else None):
            raise ValueError(f"{who} (rank {model.grid.rank}): stage {s} is sharded over ranks "
                             f"{has} and replicated over {has_rep}, but dp_mode={dp_mode!r} "
                             f"shards over {sorted(shard)} and replicates over "
                             f"{sorted(rep) if rep is not None else None}; build the modules "
                             f"with wrap_stages(model, {dp_mode!r})")


def make_optimizer(model, dp_mode: str, optimizer_class=torch.optim.AdamW, **defaults):
    """The optimizer for ``model`` (a :class:`~.stages.HybridGPT`): ``optimizer_class`` over its
    parameters (with ``"zero3"`` and ``"hsdp"``: the shards — call :func:`~.dp_modes.wrap_stages`
    first), or a :class:`ZeRO1Optimizer` on the grid's DP group for ``"zero1"``."""
    if dp_mode not in DP_MODES:
        raise ValueError(f"make_optimizer (rank {model.grid.rank}): dp_mode must be one of "
                         f"{DP_MODES}, got {dp_mode!r}")
    refuse_expert_dp_mode(model, dp_mode, "make_optimizer")
    if dp_mode in ("zero1", "zero2"):
        return ZeRO1Optimizer(model, optimizer_class, **defaults)
    return optimizer_class(model.parameters(), **defaults)
