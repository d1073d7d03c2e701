"""Where a data × tensor parallel grid sits on a two-level cluster: TP inside a node, or across.

:class:`minidist.grid.ProcessGrid` lays the world out as ``arange(world).view(dp, tp)`` — tp
fastest, so TP peers are neighbouring ranks — and :mod:`minidist.comm.topology` puts global rank
``r`` on node ``r // ranks_per_node``. With ``ranks_per_node`` a multiple of ``tp`` every TP group
is therefore inside a node and the DP groups cross nodes: Megatron-LM's order, the one that keeps
the chattiest dimension on the fast links. Neither rule has a switch for the other placement, and
neither needs one: a launcher that hands the grid's positions to the nodes in another order is
a *renumbering*. Here grid position ``(d, t)`` (grid rank ``d·tp + t``) gets global rank

* ``d·tp + t`` with ``tp_inside=True`` (the grid's own numbering), or
* ``t·dp + d`` with ``tp_inside=False`` — the transpose: dp fastest, as Megatron-core's ``order``
  string does when ``dp`` is listed before ``tp``. TP peers are then ``dp`` global ranks apart,
  on different nodes whenever ``dp >= ranks_per_node``.

On 2 nodes × 2 ranks with dp = tp = 2: inside, TP groups ``[0, 1], [2, 3]`` and DP groups ``[0, 2],
[1, 3]``; across, the other way round. The groups are what a strategy is handed (``group=``);
nothing in the library changes. :func:`placed_layout` gives them without processes,
:class:`PlacedGroups` makes them (every rank, the same order, as ``ProcessGrid`` does).
"""

from __future__ import annotations

import torch.distributed as dist

from minidist.comm.p2p import destroy_group
from minidist.grid import grid_layout

__all__ = ["placed_layout", "PlacedGroups"]


def placed_layout(dp: int, tp: int, tp_inside: bool = True) -> dict[str, list[list[int]]]:
    """``{"tp": [...], "dp": [...]}``: the groups of a dp × tp grid as global ranks, TP groups
    on neighbouring ranks (``tp_inside``) or ``dp`` ranks apart (module docstring). Each list
    partitions ``range(dp·tp)``; ValueError for a size < 1."""
    grid = grid_layout(dp * tp, dp, tp=tp)

    def place(g: int) -> int:
        return g if tp_inside else (g % tp) * dp + g // tp

    return {dim: [sorted(place(g) for g in ranks) for ranks in grid[dim]] for dim in ("tp", "dp")}


class PlacedGroups:
    """This rank's TP and DP groups under :func:`placed_layout` (collective: every rank of the
    world builds it with the same arguments). Attributes: ``tp_group``, ``dp_group``,
    ``tp_ranks``, ``dp_ranks`` (global), ``tp_rank``, ``dp_rank`` (inside each group).
    :meth:`close` destroys the groups."""

    def __init__(self, dp: int, tp: int, tp_inside: bool = True):
        me, world = dist.get_rank(), dist.get_world_size()
        if dp * tp != world:
            raise ValueError(f"PlacedGroups (rank {me}): dp x tp = {dp} x {tp} = {dp * tp}, but "
                             f"the world size is {world}")
        self.layout = placed_layout(dp, tp, tp_inside)
        self._own = []
        for dim in ("tp", "dp"):
            for ranks in self.layout[dim]:
                group = dist.new_group(ranks)
                if me in ranks:
                    self._own.append(group)
                    setattr(self, f"{dim}_group", group)
                    setattr(self, f"{dim}_ranks", ranks)
        self.tp_rank, self.dp_rank = self.tp_ranks.index(me), self.dp_ranks.index(me)

    def close(self) -> None:
        for group in self._own:
            destroy_group(group)
        self._own = []
