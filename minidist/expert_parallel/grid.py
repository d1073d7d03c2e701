"""Expert parallelism composed with data parallelism: a ``dp x ep`` grid and its three groups.

The world's ranks are laid out as ``torch.arange(world).view(dp, ep)``: EP ranks are neighbours
(the all-to-all is the heaviest traffic; Megatron-LM carves EP out of the data-parallel ranks the
same way). Rank ``r`` sits at ``(dp_rank, ep_rank) = divmod(r, ep)`` and belongs to

* an **EP group** (a row): the ranks that shard the experts between them and exchange tokens;
* an **expert-DP group** (a column): the ranks with the same ``ep_rank``, which hold the *same*
  experts — replicas that average the expert gradients (Megatron-LM's
  ``expert_data_parallel_group``);
* the **dense-DP group**: every rank (``dp x ep``), all holding the same non-expert parameters
  (attention, LayerNorms, embeddings, router), which average those gradients.

Example, world 4 = dp 2 x ep 2: rank 3 is at (1, 1); EP group [2, 3], expert-DP group [1, 3],
dense-DP group [0, 1, 2, 3].

This is a separate grid rather than a fourth dimension of :class:`minidist.grid.ProcessGrid`:
the MoE GPT here composes EP with DP itself, and the 3-D grid's callers stay unchanged.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["EPGrid", "ep_layout"]


def ep_layout(world_size: int, dp: int, ep: int) -> dict[str, list[list[int]]]:
    """``{"ep": rows, "expert_dp": columns, "dense_dp": [all]}`` as global rank lists.

    Raises ValueError when ``dp · ep != world_size`` or a size < 1."""
    for name, n in (("dp", dp), ("ep", ep)):
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"EPGrid: {name} must be an int >= 1, got {n!r}")
    if dp * ep != world_size:
        raise ValueError(f"EPGrid: dp x ep = {dp} x {ep} = {dp * ep}, but the world size is "
                         f"{world_size}")
    g = torch.arange(world_size).view(dp, ep)
    return {"ep": [g[d].tolist() for d in range(dp)],
            "expert_dp": [g[:, e].tolist() for e in range(ep)],
            "dense_dp": [list(range(world_size))]}


class EPGrid:
    """This rank's place in a ``dp x ep`` grid. Every rank must construct it, with the same sizes
    (``new_group`` is collective). Attributes: ``rank``, ``world_size``, ``dp_rank``, ``ep_rank``,
    ``dp_size``, ``ep_size``, ``ep_group``/``ep_ranks``, ``expert_dp_group``/``expert_dp_ranks``,
    ``dense_dp_group`` (the world)."""

    def __init__(self, dp: int, ep: int):
        if not dist.is_initialized():
            raise RuntimeError("EPGrid: the process group is not initialised; run inside "
                               "minidist.run(...) or after minidist.init()")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        try:
            layout = ep_layout(self.world_size, dp, ep)
        except ValueError as e:
            raise ValueError(f"{e} (rank {self.rank})") from None
        self.dp_size, self.ep_size = dp, ep
        self.dp_rank, self.ep_rank = divmod(self.rank, ep)
        for dim in ("ep", "expert_dp"):
            for ranks in layout[dim]:
                group = dist.new_group(ranks)
                if self.rank in ranks:
                    setattr(self, f"{dim}_group", group)
                    setattr(self, f"{dim}_ranks", ranks)
        self.dense_dp_group = dist.group.WORLD

    def __repr__(self) -> str:
        return (f"EPGrid(rank {self.rank}: dp {self.dp_rank}/{self.dp_size}, ep {self.ep_rank}/"
                f"{self.ep_size}; EP group {self.ep_ranks}, expert-DP group "
                f"{self.expert_dp_ranks})")
