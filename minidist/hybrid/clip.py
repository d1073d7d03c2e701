"""Gradient clipping by the global norm when the model is split over TP shards and pipeline stages.

``torch.nn.utils.clip_grad_norm_`` on one process computes ``‖g‖ = sqrt(Σ_p ‖g_p‖²)`` over every
parameter once, then multiplies every gradient by ``min(1, max_norm / (‖g‖ + 1e-6))``. Split over a
``dp x pp x tp`` grid, each rank holds part of the sum; counting each parameter exactly once
(Megatron-LM's ``get_grad_norm_fp32`` in ``megatron/core/optimizer/clip_grads.py``, on the
gradients ``get_main_grads_for_grad_norm`` keeps with ``param_is_not_shared`` and
``param_is_not_tensor_parallel_duplicate``; Shoeybi et al. 2019):

* a tensor-parallel shard (``tensor_model_parallel``) counts on every TP rank (disjoint shards;
  the vocabulary padding has zero gradient);
* a TP-replicated parameter (LayerNorm, row-parallel bias, position embedding) counts on TP rank
  0 only (after sequence-parallel finishing, its gradient is the same on every TP rank);
* the last stage's copy of a tied embedding does not count (the first stage's does);
* DP replicas hold the same averaged gradient: not summed over the DP group (ZeRO-3's shards,
  disjoint over DP×CP, are; HSDP's, disjoint over CP and alike over DP, are summed over CP only);
* an expert (mixture of experts, :mod:`.moe`) lives on one rank of its EP group: its squares are
  summed over the EP group (not over its expert-DP replicas).

The squared sums are added over the TP group, then over the pipeline group: every rank of a
replica gets the same norm (and each replica the same one). Call it after the DP sync, the
sequence-parallel finish and the tied-embedding sum, before the optimizer step.
"""

from __future__ import annotations

import torch

from .. import collectives as C
from ..data_parallel.clip import clip_by_global_norm_

__all__ = ["global_grad_norm", "clip_grad_norm_"]


def global_grad_norm(model, norm_type: float = 2.0) -> float:
    """The 2-norm of the whole model's gradient (a :class:`~.stages.HybridGPT`), on every rank.

    Collective over the grid's TP and PP groups. Raises ``ValueError`` for a norm other than 2.
    """
    if float(norm_type) != 2.0:
        raise ValueError(f"global_grad_norm (rank {model.grid.rank}): only the 2-norm is "
                         f"implemented, got norm_type={norm_type}")
    total = _local_sum_sq(model)
    _reduce_tp_pp(model.grid)(total)
    return float(total.sqrt())


def _local_sum_sq(model, experts_over_ep: bool = True) -> torch.Tensor:
    """This rank's share of the squared norm: each parameter once (the tied copy and a replicated
    parameter's copies on TP ranks > 0 skipped), in fp64. Experts (sharded over the EP group,
    each on one rank of it) are summed over the EP group here: a collective over it when
    ``ep > 1`` — unless the caller sums over DP×CP (ZeRO-3's expert shards: disjoint over
    EP × expert-DP, which is DP×CP)."""
    grid, params = model.grid, model.parameters()
    device = params[0].device if params else torch.device("cpu")
    total = torch.zeros(1, dtype=torch.float64, device=device)
    experts = torch.zeros(1, dtype=torch.float64, device=device)
    for p in params:
        if p.grad is None or model.is_tied_copy(p):
            continue
        if not getattr(p, "tensor_model_parallel", False) and grid.tp_rank != 0:
            continue
        (experts if getattr(p, "expert_parallel", False) else total).add_(
            p.grad.detach().double().pow(2).sum())
    if grid.ep_size > 1 and experts_over_ep:
        C.all_reduce(experts, "sum", group=grid.ep_group)
    return total + experts


def _reduce_tp_pp(grid, dp: bool = False, cp: bool = False):
    """Sum in place over the grid's TP and PP groups (and DP×CP, for ZeRO-1's slices and ZeRO-3's
    shards: the ranks holding the same parameters, the DP group without context parallelism; or
    CP only, for HSDP's shards, which the DP replicas hold alike)."""
    over = (((len(grid.dp_cp_ranks), grid.dp_cp_group),) if dp else
            ((grid.cp_size, grid.cp_group),) if cp else ())   # cp_group is None iff cp_size == 1

    def reduce(t):
        for size, group in over + ((grid.tp_size, grid.tp_group), (grid.pp_size, grid.pp_group)):
            if size > 1:
                C.all_reduce(t, "sum", group=group)
    return reduce


def clip_grad_norm_(model, max_norm: float, norm_type: float = 2.0,
                    dp_sharded: bool = False, cp_sharded: bool = False) -> float:
    """Scale every gradient of ``model`` in place by ``min(1, max_norm / (norm + 1e-6))`` (as
    ``torch.nn.utils.clip_grad_norm_``) and return the global norm before clipping (a float).
    ``dp_sharded``: the gradients are ZeRO-3 shards (disjoint over the DP×CP group, zero padding):
    their squares are summed over that group too. ``cp_sharded``: HSDP shards (disjoint over the
    CP group, the same piece on every DP replica after the all-reduce): summed over CP only, so
    each piece counts once, not dp times (FSDP1 once counted replicated gradients W times,
    pytorch/pytorch#88955)."""
    if float(norm_type) != 2.0:
        raise ValueError(f"clip_grad_norm_ (rank {model.grid.rank}): only the 2-norm is "
                         f"implemented, got norm_type={norm_type}")
    if dp_sharded and cp_sharded:
        raise ValueError(f"clip_grad_norm_ (rank {model.grid.rank}): dp_sharded (ZeRO-3) and "
                         "cp_sharded (HSDP) are two layouts; pass the one the stages have")
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    total = _local_sum_sq(model, experts_over_ep=not dp_sharded)
    return float(clip_by_global_norm_(total, grads, max_norm,
                                      _reduce_tp_pp(model.grid, dp=dp_sharded, cp=cp_sharded)))
