"""Sharded data parallelism from scratch: ZeRO-1/2 (:class:`ShardedOptimizer`), ZeRO-3 / FSDP
(:func:`fully_shard`; HSDP, :func:`replicate`), activation recomputation (:func:`checkpoint`)
and memory per rank. Source: Rajbhandari et al. 2020, "ZeRO", §5; Zhao et al. 2023, "PyTorch
FSDP"; Wang et al. 2023, "ZeRO++", §3.2.
Design notes: docs/design/sharding.md
"""

from .flat import FlatBuffer, padded_numel, plan_buckets
from .zero import ShardedOptimizer
from .fsdp import (MixedPrecisionPolicy, ShardUnit, close_units, fully_shard,
                   set_requires_all_reduce, set_requires_gradient_sync, units)
from .fsdp_flat import FlatLayout
from .fsdp_param import ParamLayout
from .hsdp import HSDPMesh, hsdp_mesh
from .replicate import ReplicateUnit, replicate, replicated_units
from .fsdp_state import (clip_grad_norm_, full_optim_state_dict, full_state_dict,
                         load_full_optim_state_dict, load_full_state_dict)
from .recompute import Checkpointed, checkpoint
from .memory import ActivationMeter, account, zero_formula

__all__ = ["FlatBuffer", "padded_numel", "plan_buckets", "ShardedOptimizer", "ShardUnit",
           "ParamLayout", "FlatLayout", "MixedPrecisionPolicy", "fully_shard", "close_units",
           "set_requires_gradient_sync", "set_requires_all_reduce",
           "units", "HSDPMesh", "hsdp_mesh", "ReplicateUnit", "replicate", "replicated_units",
           "clip_grad_norm_", "full_optim_state_dict", "full_state_dict",
           "load_full_optim_state_dict", "load_full_state_dict",
           "Checkpointed", "checkpoint", "ActivationMeter", "account", "zero_formula"]
