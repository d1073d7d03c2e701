"""Cut a batch into micro-batches, and weight each micro-batch's loss so the sum is the full-batch loss.

``torch.tensor_split`` gives exactly ``M`` near-equal pieces; micro-batch ``m`` of ``n_m`` samples
weighs its mean loss by ``n_m / N`` (torchgpipe's ``microbatch.py``, Kim et al. 2020).
Design notes: docs/design/pipeline_parallel.md
"""

from __future__ import annotations

import torch

__all__ = ["split", "sizes", "loss_weights", "REDUCTIONS"]

# how a loss is reduced over a batch (pipeline_step's ``loss_reduction``):
# "mean" over samples: micro-batch means weighted n_m/N; "sum": weight 1;
# "per_token": loss_fn returns (sum, count), divided once by the global count (Megatron-Core's
# calculate_per_token_loss): the only exact one for a token mean with ignored positions, whose
# micro-batches hold different numbers of counted tokens.
REDUCTIONS = ("mean", "sum", "per_token")


def sizes(batch_size: int, M: int) -> list[int]:
    """Micro-batch sizes ``tensor_split`` gives: ``batch_size`` into ``M`` near-equal parts."""
    _check(batch_size, M)
    return [batch_size // M + (1 if m < batch_size % M else 0) for m in range(M)]


def _check(batch_size: int, M: int, what: str = "batch") -> None:
    if not isinstance(M, int) or M < 1:
        raise ValueError(f"number of micro-batches M must be an int >= 1, got {M!r}")
    if batch_size < M:
        raise ValueError(f"cannot cut the {what} ({batch_size} samples) into M={M} micro-batches: "
                         f"{M - batch_size} would be empty. Use M <= {batch_size} or a larger batch.")


def split(x: torch.Tensor, M: int, what: str = "batch") -> list[torch.Tensor]:
    """``M`` micro-batches ``[n_m, ...]`` of ``x`` ``[N, ...]``; ``ValueError`` if ``M < 1`` or ``N < M``."""
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        raise ValueError(f"split: the {what} must be a tensor with a batch dimension, got "
                         f"{type(x).__name__}{'' if not isinstance(x, torch.Tensor) else ' of 0 dims'}")
    _check(x.shape[0], M, what)
    return list(torch.tensor_split(x, M, dim=0))


def loss_weights(batch_size: int, M: int) -> list[float]:
    """``n_m / N`` per micro-batch: multiply each micro-batch's *mean* loss by it."""
    return [n / batch_size for n in sizes(batch_size, M)]
