"""The gradient noise scale ``B_simple = tr(Σ) / |G|²`` (McCandlish et al. 2018, eq. 2.8): how large
a batch still pays. From per-example gradients, or (App. A.1) from a small and a big batch: each
rank's local gradient and the all-reduced one.
Design notes: docs/design/data_parallel.md
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

__all__ = ["NoiseScale", "per_example_grads", "from_per_example", "from_two_batches"]


@dataclass(frozen=True)
class NoiseScale:
    """``trace_sigma`` tr(Σ), ``grad_sq`` |G|²; ``b_simple`` their ratio in examples (``inf`` if ``grad_sq`` <= 0)."""

    trace_sigma: float
    grad_sq: float

    @property
    def b_simple(self) -> float:
        return self.trace_sigma / self.grad_sq if self.grad_sq > 0 else math.inf

    @staticmethod
    def mean(estimates: Sequence["NoiseScale"]) -> "NoiseScale":
        """Average tr(Σ) and |G|² separately over ``estimates`` (McCandlish et al., App. A.1)."""
        if not estimates:
            raise ValueError("NoiseScale.mean: no estimates to average")
        n = len(estimates)
        return NoiseScale(sum(e.trace_sigma for e in estimates) / n,
                          sum(e.grad_sq for e in estimates) / n)


def per_example_grads(model: nn.Module, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                      x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Every example's flattened gradient of ``loss_fn(model(x_i), y_i)``: ``[n, P]`` (``torch.func``
    vmap; ``model`` must act on a batch of one). ``x`` [n, ...], ``y`` [n, ...]."""
    from torch.func import functional_call, grad, vmap

    if x.shape[0] != y.shape[0]:
        raise ValueError(f"per_example_grads: x has {x.shape[0]} examples, y {y.shape[0]}")
    params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}
    if x.shape[0] == 0:
        return x.new_zeros(0, sum(v.numel() for v in params.values()))

    def loss_one(p, xi, yi):
        return loss_fn(functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))

    grads = vmap(grad(loss_one), in_dims=(None, 0, 0))(params, x, y)
    return torch.cat([grads[k].reshape(x.shape[0], -1) for k in params], dim=1)


def from_per_example(grads: torch.Tensor, whole_population: bool = False) -> NoiseScale:
    """tr(Σ) and |G|² from per-example gradients ``grads`` [n, P] (n >= 2), in float64: unbiased
    sample estimates, or exact with ``whole_population=True``."""
    if grads.dim() != 2:
        raise ValueError(f"from_per_example: grads must be [n, P], got shape {tuple(grads.shape)}")
    n = grads.shape[0]
    if n < 2:
        raise ValueError(f"from_per_example: needs at least 2 examples to see a variance, got {n}")
    g = grads.to(torch.float64)
    mean = g.mean(dim=0)
    centred = float(((g - mean) ** 2).sum())
    mean_sq = float(mean.pow(2).sum())
    if whole_population:
        return NoiseScale(centred / n, mean_sq)
    trace = centred / (n - 1)
    return NoiseScale(trace, mean_sq - trace / n)


def from_two_batches(sq_norm_small: float, sq_norm_big: float, b_small: float, b_big: float
                     ) -> NoiseScale:
    """McCandlish et al. App. A.1, eq. A.2: tr(Σ) and |G|² from the squared norms of mean gradients
    over batches of ``b_small < b_big`` examples (``E|G_B|² = |G|² + tr(Σ)/B``). In DDP: the mean
    of the local norms with ``b``, and the averaged gradient's with ``W·b``. Floats or 0-d tensors."""
    if not 0 < b_small < b_big:
        raise ValueError(f"from_two_batches: need 0 < b_small < b_big, got b_small={b_small}, "
                         f"b_big={b_big}")
    small, big = float(sq_norm_small), float(sq_norm_big)
    if small < 0 or big < 0 or not (math.isfinite(small) and math.isfinite(big)):
        raise ValueError(f"from_two_batches: squared norms must be finite and >= 0, got "
                         f"sq_norm_small={small}, sq_norm_big={big}")
    grad_sq = (b_big * big - b_small * small) / (b_big - b_small)
    trace = (small - big) / (1.0 / b_small - 1.0 / b_big)
    return NoiseScale(trace, grad_sq)
