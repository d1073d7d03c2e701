"""How the tests, the demo and the lesson measure "equal to the single-process model".

``rel_error(a, b) = ||a - b|| / ||b||`` (2-norm over all elements; ``||a - b||`` when ``b`` is all
zeros): the norm-wise relative error of numerical linear algebra. In fp32 a TP layer differs from
the single-process one only in the order of floating-point additions (a row-parallel layer sums W
partial products), so the tests ask for ``rel_error < 1e-6`` (fp32 epsilon is 1.2e-7). A broken
operator (a missing f or g) gives errors of order 1.
"""

from __future__ import annotations

import torch

__all__ = ["rel_error", "max_rel_error"]


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """Norm-wise relative error of ``a`` against the reference ``b`` (same shape: else ValueError)."""
    if a.shape != b.shape:
        raise ValueError(f"rel_error: shapes differ, {tuple(a.shape)} vs reference {tuple(b.shape)}")
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    scale = b.norm().item()
    diff = (a - b).norm().item()
    if scale == 0.0:
        return diff
    return diff / scale


def max_rel_error(got: dict, ref: dict) -> tuple[float, str]:
    """``(worst error, its key)`` over the keys of ``ref``; a key missing from ``got`` is an error."""
    missing = sorted(set(ref) - set(got))
    if missing:
        raise KeyError(f"max_rel_error: missing {missing}")
    worst, where = 0.0, ""
    for k in ref:
        e = rel_error(got[k], ref[k])
        if e > worst or not where:
            worst, where = e, k
    return worst, where
