"""A 3-D process grid: which ranks do data, pipeline and tensor parallelism together.

The world's ranks are laid out as ``torch.arange(world).view(dp, pp, tp)`` (picotron's
``process_group_manager``; Megatron-LM's ``parallel_state`` uses the same order): tensor-parallel
ranks are neighbours (they talk most, and on a GPU node they share NVLink), then pipeline stages,
then data-parallel replicas. Rank ``r`` sits at ``(dp_rank, pp_rank, tp_rank)`` and belongs to

* a **DP group**: the ranks with its ``(pp_rank, tp_rank)`` — replicas of the same shard of the
  model, which average gradients;
* a **PP group**: the ranks with its ``(dp_rank, tp_rank)`` — the stages of one pipeline;
* a **TP group**: the ranks with its ``(dp_rank, pp_rank)`` — the shards of one layer.

Example, world 8 = dp 2 x pp 2 x tp 2: rank 5 is at (1, 0, 1); DP group [1, 5], PP group [5, 7],
TP group [4, 5].

With ``pp > 1`` there is a fourth kind, the **embedding group**: the first and the last stage of
each pipeline (``[pp_ranks[0], pp_ranks[-1]]``), which sum the gradients of an embedding tied to
the output head (Megatron-LM's ``_allreduce_word_embedding_grads``). Rank 5 above: [5, 7].
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ProcessGrid", "grid_layout"]

_DIMS = ("dp", "pp", "tp")


def grid_layout(world_size: int, dp: int, pp: int = 1, tp: int = 1) -> dict[str, list[list[int]]]:
    """The groups of each dimension as lists of global ranks, no processes needed.

    Returns ``{"dp": [...], "pp": [...], "tp": [...]}``, each a list of rank lists that partitions
    ``range(world_size)``.

    Raises:
        ValueError: ``dp·pp·tp != world_size`` or a size < 1.
    """
    for name, n in zip(_DIMS, (dp, pp, tp)):
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"ProcessGrid: {name} must be an int >= 1, got {n!r}")
    if dp * pp * tp != world_size:
        raise ValueError(f"ProcessGrid: dp x pp x tp = {dp} x {pp} x {tp} = {dp * pp * tp}, but the "
                         f"world size is {world_size}")
    g = torch.arange(world_size).view(dp, pp, tp)
    return {
        "dp": [g[:, p, t].tolist() for p in range(pp) for t in range(tp)],
        "pp": [g[d, :, t].tolist() for d in range(dp) for t in range(tp)],
        "tp": [g[d, p, :].tolist() for d in range(dp) for p in range(pp)],
    }


class ProcessGrid:
    """This rank's place in a ``dp x pp x tp`` grid and a process group per dimension.

    Every rank must construct it (``dist.new_group`` is collective), with the same sizes.
    Attributes: ``dp_rank``, ``pp_rank``, ``tp_rank`` (coordinates = ranks inside each group),
    ``dp_size``, ``pp_size``, ``tp_size``, ``dp_group``, ``pp_group``, ``tp_group``,
    ``dp_ranks``/``pp_ranks``/``tp_ranks`` (global ranks of this rank's groups), ``grid``;
    ``embedding_ranks`` / ``embedding_group``: the first and last stage of this rank's pipeline
    (``embedding_group`` is None on the stages between, and when ``pp == 1``).
    """

    # set per dimension in __init__ (setattr over "dp", "pp", "tp")
    dp_group: Any
    pp_group: Any
    tp_group: Any
    dp_ranks: list[int]
    pp_ranks: list[int]
    tp_ranks: list[int]

    def __init__(self, dp: int, pp: int = 1, tp: int = 1):
        if not dist.is_initialized():
            raise RuntimeError("ProcessGrid: the process group is not initialised; run inside "
                               "minidist.run(...) or after minidist.init()")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        try:
            layout = grid_layout(self.world_size, dp, pp, tp)
        except ValueError as e:  # every rank raises the same, before any communication
            raise ValueError(f"{e} (rank {self.rank})") from None
        self.dp_size, self.pp_size, self.tp_size = dp, pp, tp
        self.grid = torch.arange(self.world_size).view(dp, pp, tp)
        d, p, t = (int(i) for i in (self.grid == self.rank).nonzero()[0])
        self.dp_rank, self.pp_rank, self.tp_rank = d, p, t
        for dim in _DIMS:  # every rank creates every group, in the same order
            for ranks in layout[dim]:
                group = dist.new_group(ranks)
                if self.rank in ranks:
                    setattr(self, f"{dim}_group", group)
                    setattr(self, f"{dim}_ranks", ranks)
        self.embedding_ranks = sorted({self.pp_ranks[0], self.pp_ranks[-1]})
        self.embedding_group = None
        if pp > 1:
            for ranks in layout["pp"]:
                group = dist.new_group([ranks[0], ranks[-1]])
                if self.rank in (ranks[0], ranks[-1]):
                    self.embedding_group = group

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def __repr__(self) -> str:
        return (f"ProcessGrid(rank {self.rank}: dp {self.dp_rank}/{self.dp_size}, pp {self.pp_rank}/"
                f"{self.pp_size}, tp {self.tp_rank}/{self.tp_size}; dp group {self.dp_ranks}, "
                f"pp group {self.pp_ranks}, tp group {self.tp_ranks})")
