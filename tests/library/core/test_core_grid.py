"""minidist.core.grid against the library's grid (minidist.grid).

The arithmetic (coordinates, every dimension's groups) is compared in this process on every grid
shape with W <= 8; one launch of 8 ranks then builds the process groups both ways on a few shapes
and compares each rank's groups (their members as torch sees them), and sums over the core's.
(Named test_core_grid.py: tests/library/grid/test_grid.py holds the basename test_grid.py.)
"""

import itertools

import pytest
import torch.distributed as dist
import torch

import minidist
from minidist.core import grid as core
from minidist.grid import ProcessGrid, grid_layout

SHAPES = [(dp, pp, cp, tp, ep)
          for world in range(1, 9)
          for dp, pp, cp, tp in itertools.product(range(1, world + 1), repeat=4)
          if dp * pp * cp * tp == world
          for ep in range(1, dp * cp + 1) if (dp * cp) % ep == 0]
LAUNCHED = [(2, 2, 1, 2, 1), (2, 1, 2, 2, 2), (1, 2, 2, 2, 1), (4, 2, 1, 1, 4)]


def test_coordinates_and_groups_are_the_library_s_on_every_shape_up_to_8_ranks():
    assert len(SHAPES) > 100
    for dp, pp, cp, tp, ep in SHAPES:
        world = dp * pp * cp * tp
        lib = grid_layout(world, dp=dp, pp=pp, tp=tp, cp=cp, ep=ep)
        mine = core.group_ranks(dp, pp, cp, tp, ep)
        for dim, groups in lib.items():
            assert mine[dim] == groups, (dp, pp, cp, tp, ep, dim)
        full = torch.arange(world).view(dp, pp, cp, tp)
        for rank in range(world):
            assert full[core.coordinates(rank, dp, pp, cp, tp)] == rank
    assert core.group_ranks(2, 2, 1, 2)["embedding"][1] == [1, 3]


def test_groups_are_created_in_the_library_s_order(monkeypatch):
    """``dist.new_group`` recorded, not run: both must create the same groups in the same order
    (a collective: every rank the same sequence), and give each rank the same ones."""
    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "new_group", lambda ranks: calls.append(list(ranks)) or len(calls))
    for dp, pp, cp, tp, ep in SHAPES:
        world = dp * pp * cp * tp
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: world)
        for rank in range(world):
            monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
            calls.clear()
            grid = ProcessGrid(dp=dp, pp=pp, tp=tp, cp=cp, ep=ep)
            lib_calls, n = list(calls), len(calls)
            mine = core.new_groups(dp, pp, cp, tp, ep)
            assert calls[n:] == lib_calls, (dp, pp, cp, tp, ep, rank)
            for dim, (ranks, group) in mine.items():
                lib_group = grid.embedding_group if dim == "embedding" else \
                    getattr(grid, f"{dim}_group")
                assert group - n == lib_group, (dp, pp, cp, tp, ep, rank, dim)


def _rank(rank, world, shapes):
    out = []
    for dp, pp, cp, tp, ep in shapes:
        with ProcessGrid(dp=dp, pp=pp, tp=tp, cp=cp, ep=ep) as grid:
            mine = core.new_groups(dp, pp, cp, tp, ep)
            got = {dim: (ranks, dist.get_process_group_ranks(group))
                   for dim, (ranks, group) in mine.items()}
            lib = {dim: (getattr(grid, f"{dim}_ranks"), getattr(grid, f"{dim}_group"))
                   for dim in ("dp", "pp", "tp", "cp", "dp_cp", "ep", "expert_dp")}
            lib = {dim: (ranks, dist.get_process_group_ranks(group))
                   for dim, (ranks, group) in lib.items() if dim in mine}
            if grid.embedding_group is not None:
                lib["embedding"] = (grid.embedding_ranks,
                                    dist.get_process_group_ranks(grid.embedding_group))
            sums = {}
            for dim, (ranks, group) in mine.items():
                t = torch.tensor([rank])
                dist.all_reduce(t, group=group)
                sums[dim] = (int(t), sum(ranks))
            coords = (core.coordinates(rank, dp, pp, cp, tp),
                      (grid.dp_rank, grid.pp_rank, grid.cp_rank, grid.tp_rank))
            for _, group in {id(g): g for _, g in mine.values()}.items():
                dist.destroy_process_group(group)
        out.append((got, lib, sums, coords))
    return out


@pytest.mark.timeout(120)
def test_core_groups_are_the_library_s():
    results = minidist.run(_rank, 8, LAUNCHED, timeout=100)
    for rank, per_rank in enumerate(results):
        for shape, (got, lib, sums, coords) in zip(LAUNCHED, per_rank):
            assert got == lib, (rank, shape)
            assert all(a == b for a, b in sums.values()), (rank, shape, sums)
            assert coords[0] == coords[1], (rank, shape)
