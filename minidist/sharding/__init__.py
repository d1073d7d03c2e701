"""Sharded data parallelism from scratch: ZeRO stages 1-3 and activation recomputation.

* :class:`ShardedOptimizer` — ZeRO-1 (optimizer states) and ZeRO-2 (gradients too) (:mod:`.zero`);
* :func:`fully_shard` — ZeRO-3 / FSDP units (:mod:`.fsdp`): a :class:`ShardUnit` (the hooks,
  :mod:`.fsdp_unit`) holding a layout — :class:`ParamLayout`, each parameter sharded on dim 0
  (:mod:`.fsdp_param`), or the flat-parameter first design with ``per_parameter=False``,
  :class:`FlatLayout` (:mod:`.fsdp_flat`);
  full and sharded checkpoints, global-norm clipping (:mod:`.fsdp_state`);
* HSDP — ``fully_shard(module, mesh=hsdp_mesh(R, S))``: sharded inside each group of S ranks
  (a node), replicated across the R groups; gradients reduce-scattered in the shard group, then
  all-reduced across the replicate group (:mod:`.hsdp`; Zhao et al. 2023 §3.2.2, FSDP2's 2-D
  mesh);
* :func:`replicate` — a replicated unit: whole parameters, gradients all-reduced (torch's
  composable ``replicate``; e.g. norms kept whole beside sharded linears) (:mod:`.replicate`);
* :func:`checkpoint` — activation recomputation, RNG replayed (:mod:`.recompute`);
* :func:`account`, :class:`ActivationMeter`, :func:`zero_formula` — memory per rank
  (:mod:`.memory`);
* flat padded buffers, the layout every stage uses (:mod:`.flat`);
* the collectives they need, hand-built or torch's, and the communication thread, are
  :mod:`minidist.communicator`'s (the ones DDP uses).

Source: Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", §5; Zhao et al. 2023, "PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel"
(§3.2.2: hybrid sharding); Wang et al. 2023, "ZeRO++", §3.2 (hpZ: parameters gathered inside a
node).
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
