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

**With pipeline and data parallelism too** (a :class:`~minidist.grid.ProcessGrid`), the seeds
follow Megatron-LM's ``_set_random_seed`` (``megatron/training/initialize.py``):

* **pipeline stages** hold different layers, so they must not draw the same masks: stage
  ``pp_rank`` uses ``seed + 100·pp_rank`` as its base seed (without it, stage 1's first dropout
  would repeat stage 0's first mask whenever the shapes agree);
* **data-parallel replicas** reuse the seed by default: replica d draws the *same* masks as replica
  0 (on different data). With ``data_parallel_random_init=True`` (Megatron's flag of that name)
  the base seed also gets ``+ 10·dp_rank``, so replicas differ;
* within a stage, ``"replicated"`` = base and ``"model-parallel"`` = base + 2718 + tp_rank, as above.

The offsets are Megatron's and so are their limits: 10·dp_rank meets 100·pp_rank at dp_rank 10,
and base + 100·27 comes near base + 2718; a grid that large needs a different scheme.

The tracker's generator states can be saved and restored (:meth:`RNGTracker.state_dict` /
:meth:`RNGTracker.load_state_dict`, the library's state protocol; Megatron calls them
``get_states`` / ``set_states``) so that a resumed run continues the same masks, and :func:`record_masks` lists the masks drawn while it is active (for tests and the lesson).
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
        """``{"seeds": {name: int}, "generators": {"name|device": ByteTensor}}``: a copy of the
        seeds and of every generator's state (what a checkpoint saves)."""
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
    """Megatron-LM's per-rank base seed: ``seed + 100·pp_rank``, plus ``10·dp_rank`` when
    ``dp_rank`` is given (``data_parallel_random_init``); ``dp_rank=None``: replicas share it."""
    return int(seed) + PIPELINE_OFFSET * int(pp_rank) + (
        DATA_PARALLEL_OFFSET * int(dp_rank) if dp_rank is not None else 0)


def model_parallel_seed(seed: int, group=None, tracker: RNGTracker | None = None, *,
                        pp_rank: int = 0, dp_rank: int | None = None) -> RNGTracker:
    """Seed ``"replicated"`` with ``b = stage_seed(seed, pp_rank, dp_rank)`` and
    ``"model-parallel"`` with ``b + 2718 + tp_rank`` (tp_rank: this rank's place in ``group``).

    With the defaults (``pp_rank=0, dp_rank=None``) it is plain TP's ``seed`` / ``seed+2718+tp``.
    Returns the tracker (the global one unless ``tracker`` is given).
    """
    tracker = tracker or _TRACKER
    rank, _ = group_rank_world(group)
    base = stage_seed(seed, pp_rank, dp_rank)
    tracker.add("replicated", base)
    tracker.add("model-parallel", base + MODEL_PARALLEL_OFFSET + rank)
    return tracker


def grid_seed(seed: int, grid, data_parallel_random_init: bool = False,
              tracker: RNGTracker | None = None) -> RNGTracker:
    """:func:`model_parallel_seed` for this rank of a :class:`~minidist.grid.ProcessGrid`: TP
    group ``grid.tp_group``, ``pp_rank=grid.pp_rank``, and ``dp_rank=grid.dp_rank`` only when
    ``data_parallel_random_init`` (default: every DP replica draws the same masks, as Megatron-LM).
    Seeds only the dropout tracker, not torch's global generator (weight init is the caller's)."""
    return model_parallel_seed(seed, grid.tp_group, tracker, pp_rank=grid.pp_rank,
                               dp_rank=grid.dp_rank if data_parallel_random_init else None)


@contextmanager
def record_masks():
    """``with record_masks() as log:`` appends ``(region, keep)`` for every :func:`dropout` that
    draws a mask in this process (``keep``: bool tensor of x's shape, True = kept), in call order."""
    log: list = []
    _RECORDERS.append(log)
    try:
        yield log
    finally:
        _RECORDERS.remove(log)


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
