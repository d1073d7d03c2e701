"""Mixture of experts and expert parallelism, from scratch on minidist's all-to-all.

``router`` (top-k, capacity, dropping, aux losses), ``permute``, ``dispatch`` (the all-to-all
dispatch and combine), ``layer`` (MoE), ``stats``, ``gpt`` (MoEGPT, EP x DP gradients).
Design notes: docs/design/expert_parallel.md
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
