"""The gradient noise scale: how large a batch still pays (McCandlish et al. 2018).

McCandlish, Kaplan, Amodei et al., "An Empirical Model of Large-Batch Training" (2018), §2.2:
with per-example gradients of mean ``G`` (the true gradient) and covariance ``Σ``, a batch of
``B`` independent examples estimates ``G`` with noise of covariance ``Σ/B``, and

    B_simple = tr(Σ) / |G|²                     (their eq. 2.8; dimensionless, in examples)

is the batch size at which the noise and the signal are about equal. Below it a step on twice
the batch is worth nearly two steps (steps to a target halve); above it a bigger batch mostly
averages away noise that was already small (steps level off, examples processed grow). Their
§2.3 model: ``S = S_min·(1 + B_noise/B)`` steps and ``E = E_min·(1 + B/B_noise)`` examples, with
the critical batch ``B_crit = E_min/S_min``; ``B_simple`` estimates it when the Hessian is
close to a multiple of the identity (``B_noise = tr(HΣ)/GᵀHG`` in general).

Two estimators, both returning a :class:`NoiseScale`:

* :func:`from_per_example` — from per-example gradients ``[n, P]`` (:func:`per_example_grads`):
  unbiased ``tr(Σ)`` and ``|G|²`` from a sample, or exact for a finite data set given whole;
* :func:`from_two_batches` — their Appendix A.1: from the squared norms of gradients taken on
  batches of two sizes, using ``E|G_B|² = |G|² + tr(Σ)/B``. Data parallelism hands it over for
  free: each rank's local gradient (batch ``b``) is the small batch, the all-reduced one
  (``W·b``) the big batch. One step's estimate is noisy; average ``tr(Σ)`` and ``|G|²``
  separately over steps (:meth:`NoiseScale.mean`), then divide, as the paper does.
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
    """``trace_sigma`` = tr(Σ) (per-example gradient variance, summed over parameters),
    ``grad_sq`` = |G|² (squared norm of the true gradient); ``b_simple`` = their ratio, in
    examples (``inf`` when ``grad_sq`` <= 0: at a minimum, or a noisy estimate that crossed 0)."""

    trace_sigma: float
    grad_sq: float

    @property
    def b_simple(self) -> float:
        return self.trace_sigma / self.grad_sq if self.grad_sq > 0 else math.inf

    @staticmethod
    def mean(estimates: Sequence["NoiseScale"]) -> "NoiseScale":
        """Average tr(Σ) and |G|² separately over ``estimates`` (McCandlish et al., App. A.1:
        the ratio of averages, not the average of ratios, which one small |G|² would dominate)."""
        if not estimates:
            raise ValueError("NoiseScale.mean: no estimates to average")
        n = len(estimates)
        return NoiseScale(sum(e.trace_sigma for e in estimates) / n,
                          sum(e.grad_sq for e in estimates) / n)


def per_example_grads(model: nn.Module, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                      x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Every example's gradient of ``loss_fn(model(x_i), y_i)``, flattened: ``[n, P]``.

    ``P`` counts the trainable parameters in ``model.named_parameters()`` order (each flattened).
    Computed with ``torch.func`` (``vmap`` over ``grad``), one batched pass; ``model`` must act
    on a batch of one (no BatchNorm in training mode). ``x`` [n, ...], ``y`` [n, ...].
    """
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
    """tr(Σ) and |G|² from per-example gradients ``grads`` [n, P] (n >= 2).

    ``whole_population=False``: the ``n`` rows are a sample of the data; unbiased estimates
    ``tr(Σ) = Σᵢ|gᵢ − ḡ|²/(n−1)`` and ``|G|² = |ḡ|² − tr(Σ)/n`` (``|ḡ|²`` alone is biased up by
    the noise). ``True``: the rows are every example of a finite data set that batches are
    drawn from with replacement, so ``G = ḡ`` and ``Σ`` is the population covariance
    (divisor ``n``): exact, no estimation. Computed in float64.
    """
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
    """McCandlish et al. App. A.1, eq. A.2: tr(Σ) and |G|² from ``|G_small|²`` and ``|G_big|²``,
    the squared norms of mean gradients over batches of ``b_small < b_big`` examples.

    Unbiased because ``E|G_B|² = |G|² + tr(Σ)/B`` for a batch of B independent examples::

        |G|²  = (b_big·|G_big|² − b_small·|G_small|²) / (b_big − b_small)
        tr(Σ) = (|G_small|² − |G_big|²) / (1/b_small − 1/b_big)

    In DDP on W ranks of b examples each: ``sq_norm_small`` = the mean over ranks of the local
    gradients' squared norms (before the all-reduce), ``b_small = b``; ``sq_norm_big`` = the
    averaged gradient's, ``b_big = W·b``. Floats or 0-d tensors.
    """
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
