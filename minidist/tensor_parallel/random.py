"""Dropout randomness under tensor parallelism, as Megatron-LM handles it (Shoeybi et al. 2019, §3;
Megatron's ``CudaRNGStatesTracker``).

Two kinds of activation need two kinds of mask:

* **replicated** activations (the residual stream, the outputs of g): every rank of the TP group
  holds the same tensor, so every rank must drop the *same* elements — else the replicas drift
  apart. Generator ``"replicated"``, seeded with ``seed`` on every TP rank.
* **parallel** activations (each rank's attention heads): shards of one tensor, so masks must be
  *different* on different ranks — equal masks would correlate the heads. Generator
  ``"model-parallel"``, seeded with ``seed + 2718 + tp_rank`` (Megatron's offset).

Masks are drawn from these dedicated ``torch.Generator`` objects, never from torch's global
generator: a rank that calls ``torch.rand`` for its own purposes (logging, data on rank 0 only)
changes nothing. With sequence parallelism a replicated-region dropout draws the full-sequence
mask and keeps its slice, so its masks differ per shard and the result equals plain TP's.
"""

from __future__ import annotations

import torch
from torch import nn

from . import regions as R

__all__ = ["RNGTracker", "get_rng_tracker", "model_parallel_seed", "dropout", "Dropout",
           "MODEL_PARALLEL_OFFSET"]

MODEL_PARALLEL_OFFSET = 2718


class RNGTracker:
    """Named seeds, one ``torch.Generator`` per (name, device), created on first use."""

    def __init__(self):
        self.seeds: dict[str, int] = {}
        self._gens: dict[tuple[str, str], torch.Generator] = {}

    def add(self, name: str, seed: int) -> None:
        self.seeds[name] = int(seed)
        for key in [k for k in self._gens if k[0] == name]:
            del self._gens[key]

    def generator(self, name: str, device) -> torch.Generator:
        if name not in self.seeds:
            raise RuntimeError(f"RNG tracker has no generator {name!r} (known: {sorted(self.seeds)}); "
                               "call minidist.tensor_parallel.random.model_parallel_seed(seed) on "
                               "every rank before training with dropout")
        device = torch.device(device)
        key = (name, str(device))
        if key not in self._gens:
            self._gens[key] = torch.Generator(device=device).manual_seed(self.seeds[name])
        return self._gens[key]


_TRACKER = RNGTracker()


def get_rng_tracker() -> RNGTracker:
    return _TRACKER


def model_parallel_seed(seed: int, group=None, tracker: RNGTracker | None = None) -> RNGTracker:
    """Seed ``"replicated"`` with ``seed`` and ``"model-parallel"`` with ``seed + 2718 + tp_rank``."""
    tracker = tracker or _TRACKER
    rank, _ = R.tp_rank_world(group)
    tracker.add("replicated", seed)
    tracker.add("model-parallel", seed + MODEL_PARALLEL_OFFSET + rank)
    return tracker


def dropout(x: torch.Tensor, p: float, training: bool = True, region: str = "replicated",
            group=None, sequence_parallel: bool = False, seq_dim: int = 1,
            tracker: RNGTracker | None = None) -> torch.Tensor:
    """Inverted dropout with a mask from the tracker's ``region`` generator.

    With ``sequence_parallel`` (``x`` is this rank's sequence shard of a replicated tensor), the
    mask of the whole sequence is drawn and sliced, so that it equals plain TP's mask.
    """
    if not training or p == 0.0:
        return x
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout: p must be in [0, 1), got {p}")
    gen = (tracker or _TRACKER).generator(region, x.device)
    shape = list(x.shape)
    if sequence_parallel:
        _, world = R.tp_rank_world(group)
        shape[seq_dim] *= world
    keep = torch.rand(shape, generator=gen, device=x.device) >= p
    if sequence_parallel:
        keep = R.split_along(keep, seq_dim, group, "dropout")
    return x * keep.to(x.dtype) / (1.0 - p)


class Dropout(nn.Module):
    """:func:`dropout` as a module (``region``: ``"replicated"`` or ``"model-parallel"``)."""

    def __init__(self, p: float, region: str = "replicated", group=None,
                 sequence_parallel: bool = False, seq_dim: int = 1):
        super().__init__()
        self.p, self.region, self.group = p, region, group
        self.sequence_parallel, self.seq_dim = sequence_parallel, seq_dim

    def forward(self, x):
        return dropout(x, self.p, self.training, self.region, self.group, self.sequence_parallel,
                       self.seq_dim)

    def extra_repr(self) -> str:
        return f"p={self.p}, region={self.region!r}, sequence_parallel={self.sequence_parallel}"
