"""Mixture of experts and expert parallelism, from scratch on minidist's all-to-all.

======================  =====================================================================
module                  what it holds
======================  =====================================================================
``router``              route (fp32 softmax, top-k, ties to the lower index), expert_capacity
                        (Megatron's ceil rule), keep_mask (drop policies), the aux and z losses
``permute``             expert-major permute / weighted un-permute, split sizes, regroup index
``dispatch``            the six-step dispatch and combine; differentiable uneven AllToAll
``layer``               MoE: the layer for the course GPT (router + expert MLPs, EP-sharded)
``stats``               MoEStats: tokens per expert / rank, dropped fraction, all-to-all bytes
``gpt``                 MoEGPT and sync_grads / global_grad_norm for EP x DP
======================  =====================================================================

The ranks: :class:`minidist.grid.ProcessGrid` with ``ep`` (folded over the data-parallel ranks)
gives the EP group and the expert-DP group.
"""

from . import dispatch, gpt, layer, permute, router, stats  # noqa: F401
from .dispatch import all_to_all_rows, dispatch_combine, exchange_counts, local_experts  # noqa: F401
from .gpt import MoEGPT, clip_grad_norm_, global_grad_norm, sync_grads  # noqa: F401
from .layer import MoE  # noqa: F401
from .router import expert_capacity, keep_mask, load_balancing_loss, route, z_loss  # noqa: F401
from .stats import MoEStats, imbalance  # noqa: F401

__all__ = ["MoE", "MoEGPT", "MoEStats", "imbalance",
           "route", "expert_capacity", "keep_mask", "load_balancing_loss", "z_loss",
           "dispatch_combine", "all_to_all_rows", "exchange_counts", "local_experts",
           "sync_grads", "global_grad_norm", "clip_grad_norm_"]
