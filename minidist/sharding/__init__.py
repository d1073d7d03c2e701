"""Sharded data parallelism from scratch: ZeRO stages 1-3 and activation recomputation.

* :class:`ShardedOptimizer` — ZeRO-1 (optimizer states) and ZeRO-2 (gradients too) (:mod:`.zero`);
* :func:`fully_shard` — ZeRO-3 / FSDP units, each parameter sharded on dim 0 (:mod:`.fsdp`,
  :mod:`.fsdp_param`; the flat-parameter first design with ``per_parameter=False``);
  full and sharded checkpoints, global-norm clipping (:mod:`.fsdp_state`);
* :func:`checkpoint` — activation recomputation, RNG replayed (:mod:`.recompute`);
* :func:`account`, :class:`ActivationMeter`, :func:`zero_formula` — memory per rank
  (:mod:`.memory`);
* flat padded buffers, the layout every stage uses (:mod:`.flat`);
* the collectives they need, hand-built or torch's, and a communication thread (:mod:`.comms`).

Source: Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", §5; Zhao et al. 2023, "PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel".
"""

from .comms import Collectives, CommWorker  # noqa: F401
from .flat import FlatBuffer, padded_numel, plan_buckets  # noqa: F401
from .zero import ShardedOptimizer  # noqa: F401
from .fsdp import (FlatParamUnit, MixedPrecision, fully_shard,  # noqa: F401
                   set_requires_gradient_sync, units)
from .fsdp_param import ParamShardUnit  # noqa: F401
from .fsdp_state import (clip_grad_norm_, full_optim_state_dict, full_state_dict,  # noqa: F401
                         load_full_optim_state_dict, load_full_state_dict, load_sharded,
                         save_sharded)
from .recompute import Checkpointed, checkpoint  # noqa: F401
from .memory import ActivationMeter, account, zero_formula  # noqa: F401
