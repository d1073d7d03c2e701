"""Mixed precision for ZeRO-3 units (Zhao et al. 2023, §4.4; torch's ``MixedPrecisionPolicy``).

Shards are cast to ``param_dtype`` before the all-gather, unit inputs cast to ``param_dtype``,
gradients reduce-scattered in ``reduce_dtype`` and kept in the fp32 master's dtype. Per-parameter
units cast frozen parameters too (FSDP2); buffers are not cast.
Design notes: docs/design/sharding.md
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["MixedPrecisionPolicy", "cast_floating"]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """``param_dtype``: gathered parameters' (compute) dtype; ``reduce_dtype``: the reduce-scatter's.
    Masters and their gradients stay fp32."""

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
