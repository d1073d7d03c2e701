"""Dropout randomness under tensor parallelism (Megatron-LM's ``CudaRNGStatesTracker``).

Generator ``"replicated"`` (same masks on every TP rank) and ``"model-parallel"`` (different
per rank), never torch's global one; seeds per stage and replica as Megatron's ``_set_random_seed``.
Design notes: docs/design/tensor_parallel.md
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from ..comm.p2p import group_rank_world
from . import regions as R

__all__ = ["RNGTracker", "get_rng_tracker", "model_parallel_seed", "grid_seed", "stage_seed",
           "record_masks", "dropout", "Dropout", "MODEL_PARALLEL_OFFSET", "PIPELINE_OFFSET",
           "DATA_PARALLEL_OFFSET"]

MODEL_PARALLEL_OFFSET = 2718   # Megatron-LM model_parallel_cuda_manual_seed
PIPELINE_OFFSET = 100          # Megatron-LM _set_random_seed: seed + 100 * pp_rank
DATA_PARALLEL_OFFSET = 10      # ... + 10 * dp_rank only with data_parallel_random_init


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

    checkpoint_scope = "per_rank"           # ranks draw different masks (minidist.state)

    def state_dict(self) -> dict:
        """Copy of the seeds and every generator's state (what a checkpoint saves)."""
        return {"seeds": dict(self.seeds),
                "generators": {f"{n}|{d}": g.get_state() for (n, d), g in self._gens.items()}}

    def load_state_dict(self, states: dict) -> None:
        """Undo :meth:`state_dict`: the generators continue exactly where they were saved."""
        self.seeds = {k: int(v) for k, v in states["seeds"].items()}
        self._gens = {}
        for key, state in states["generators"].items():
            name, device = key.split("|", 1)
            gen = torch.Generator(device=torch.device(device))
            gen.set_state(state)
            self._gens[(name, device)] = gen


_TRACKER = RNGTracker()
_RECORDERS: list[list] = []


def get_rng_tracker() -> RNGTracker:
    return _TRACKER


def stage_seed(seed: int, pp_rank: int = 0, dp_rank: int | None = None) -> int:
    """Megatron's base seed: ``seed + 100·pp_rank`` (+ ``10·dp_rank`` when dp_rank is given)."""
    return int(seed) + PIPELINE_OFFSET * int(pp_rank) + (
        DATA_PARALLEL_OFFSET * int(dp_rank) if dp_rank is not None else 0)


def model_parallel_seed(seed: int, group=None, tracker: RNGTracker | None = None, *,
                        pp_rank: int = 0, dp_rank: int | None = None) -> RNGTracker:
    """Seed ``"replicated"`` with ``b = stage_seed(...)`` and ``"model-parallel"`` with
    ``b + 2718 + tp_rank``. Returns the tracker."""
    tracker = tracker or _TRACKER
    rank, _ = group_rank_world(group)
    base = stage_seed(seed, pp_rank, dp_rank)
    tracker.add("replicated", base)
    tracker.add("model-parallel", base + MODEL_PARALLEL_OFFSET + rank)
    return tracker


def grid_seed(seed: int, grid, data_parallel_random_init: bool = False,
              tracker: RNGTracker | None = None) -> RNGTracker:
    """model_parallel_seed for this rank of a :class:`~minidist.grid.ProcessGrid` (dropout only)."""
    return model_parallel_seed(seed, grid.tp_group, tracker, pp_rank=grid.pp_rank,
                               dp_rank=grid.dp_rank if data_parallel_random_init else None)


@contextmanager
def record_masks():
    """``with record_masks() as log:`` collects ``(region, keep)`` of every mask drawn."""
    log: list = []
    _RECORDERS.append(log)
    try:
        yield log
    finally:
        _RECORDERS.remove(log)


def dropout(x: torch.Tensor, p: float, training: bool = True, region: str = "replicated",
            group=None, sequence_parallel: bool = False, seq_dim: int = 1,
            tracker: RNGTracker | None = None) -> torch.Tensor:
    """Inverted dropout with a mask from the tracker's ``region`` generator (with
    ``sequence_parallel``: the full-sequence mask, sliced)."""
    if not training or p == 0.0:
        return x
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout: p must be in [0, 1), got {p}")
    gen = (tracker or _TRACKER).generator(region, x.device)
    shape = list(x.shape)
    if sequence_parallel:
        _, world = group_rank_world(group)
        shape[seq_dim] *= world
    keep = torch.rand(shape, generator=gen, device=x.device) >= p
    if sequence_parallel:
        keep = R.split_along(keep, seq_dim, group, "dropout")
    for log in _RECORDERS:
        log.append((region, keep.clone()))
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
