"""ProcessGrid: the layout without processes, and real groups that reduce over the right ranks."""

import pytest
import torch

import minidist
from minidist.collectives import all_reduce
from minidist.grid import ProcessGrid, grid_layout


def test_layout_example_from_docstring():
    lay = grid_layout(8, 2, 2, 2)
    assert [1, 5] in lay["dp"] and [5, 7] in lay["pp"] and [4, 5] in lay["tp"]


@pytest.mark.parametrize("dims", [(1, 1, 1), (2, 2, 1), (1, 2, 2), (4, 1, 1), (2, 3, 2), (3, 1, 2)])
def test_each_dimension_partitions_the_world(dims):
    world = dims[0] * dims[1] * dims[2]
    lay = grid_layout(world, *dims)
    for name, size in zip(("dp", "pp", "tp"), dims):
        flat = sorted(r for g in lay[name] for r in g)
        assert flat == list(range(world))
        assert all(len(g) == size for g in lay[name])
    # a DP group and a PP group share exactly one rank when tp = 1
    if dims[2] == 1:
        assert all(len(set(d) & set(p)) == 1 for d in lay["dp"] for p in lay["pp"])


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="dp x pp x tp = 2 x 3 x 1 = 6, but the world size is 4"):
        grid_layout(4, 2, 3)
    with pytest.raises(ValueError, match="pp must be an int >= 1"):
        grid_layout(4, 4, 0)


def _groups(rank, world, dims):
    grid = ProcessGrid(*dims)
    out = {}
    for name in ("dp", "pp", "tp"):
        t = torch.tensor([float(rank)])
        all_reduce(t, group=getattr(grid, f"{name}_group"))
        out[name] = (getattr(grid, f"{name}_ranks"), t.item())
    return (grid.dp_rank, grid.pp_rank, grid.tp_rank), out


@pytest.mark.parametrize("dims", [(2, 2, 1), (1, 2, 2), (2, 1, 2), (4, 1, 1)])
def test_groups_reduce_over_the_right_ranks(dims):
    results = minidist.run(_groups, 4, dims, timeout=60)
    lay = grid_layout(4, *dims)
    g = torch.arange(4).view(*dims)
    for rank, (coords, out) in enumerate(results):
        assert g[coords].item() == rank
        for name in ("dp", "pp", "tp"):
            ranks, total = out[name]
            assert ranks in lay[name] and rank in ranks
            assert total == sum(ranks)  # the all-reduce really ran over exactly these ranks


def test_grid_needs_matching_world():
    with pytest.raises(minidist.RankError, match="the world size is 2"):
        minidist.run(lambda r, w: ProcessGrid(2, 2), 2, timeout=30)
