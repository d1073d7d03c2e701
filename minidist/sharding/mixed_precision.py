"""Mixed precision for ZeRO-3 units: bf16/fp16 compute on gathered parameters, fp32 sharded
masters, gradients reduce-scattered in ``reduce_dtype`` (FSDP, Zhao et al. 2023, §4.4; torch's
``MixedPrecisionPolicy``). Used by :func:`~.fsdp.fully_shard` through ``mp_policy=``:

* the fp32 shard is cast to ``param_dtype`` *before* the all-gather (half the bytes on the wire);
* floating-point forward inputs of each unit are cast to ``param_dtype``;
* the unit's gradient (``param_dtype``) is cast to ``reduce_dtype`` before the reduce-scatter,
  and the averaged slice is kept in the master's dtype (fp32);
* per-parameter units cast *every* parameter, frozen ones included (FSDP2's behaviour: a frozen
  fp32 weight in a bf16 unit would otherwise meet bf16 activations); flat units leave frozen
  parameters unsharded in their own dtype;
* buffers are not cast (as FSDP2): an fp32 buffer combined with bf16 activations promotes them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["MixedPrecisionPolicy", "cast_floating"]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """``param_dtype``: dtype of the gathered parameters, i.e. of the compute (bf16/fp16);
    ``reduce_dtype``: dtype gradients are reduce-scattered in (fp32 keeps the sum exact-ish).
    The sharded master parameter and its gradient stay fp32 (torch's ``MixedPrecisionPolicy``)."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None


def cast_floating(obj, dtype: torch.dtype):
    """``obj`` (tensors in nested tuples/lists/dicts) with floating tensors cast to ``dtype``."""
    if torch.is_tensor(obj):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, tuple):
        return tuple(cast_floating(o, dtype) for o in obj)
    if isinstance(obj, list):
        return [cast_floating(o, dtype) for o in obj]
    if isinstance(obj, dict):
        return {k: cast_floating(v, dtype) for k, v in obj.items()}
    return obj
