"""ProcessGrid: the layout without processes, and real groups that reduce over the right ranks."""

import pytest
import torch

import minidist
from minidist.collectives import all_reduce
from minidist.grid import ProcessGrid, grid_layout

from _gloo_threads import HAVE_PROC, gloo_threads


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


def _build_use_close(rank, world):
    import torch.distributed as dist

    from minidist.comm import p2p
    from minidist.communicator import CommThread, Communicator
    before, seen = gloo_threads(), []
    for _ in range(3):   # a sweep building grid after grid (the resume matrix does 12 a launch)
        with ProcessGrid(2, 2) as grid:
            t = torch.ones(5)
            all_reduce(t, group=grid.dp_group)                        # minidist's ring
            dist.all_reduce(t, group=grid.tp_group)                   # torch's
            peer = 1 - grid.pp_rank
            p2p.exchange(t.clone(), peer, t, peer, group=grid.pp_group)
            worker = CommThread(Communicator(group=grid.dp_group))    # a DDP's comm thread
            worker.submit("all-reduce", lambda comm, x: comm.all_reduce(x), t).wait()
            worker.close()
            seen.append(gloo_threads())
        grid.close()                                                  # idempotent
        assert grid.dp_rank in (0, 1)
        with pytest.raises(AttributeError, match=r"rank \d\): dp_group is gone, the grid was closed"):
            getattr(grid, "dp_group")  # noqa: B009 - the attribute access is the test
    return before, seen, gloo_threads(), float(t[0])


@pytest.mark.skipif(not HAVE_PROC, reason="Linux /proc")
def test_closing_a_grid_frees_its_groups_threads():
    """A process that builds many grids must not keep every grid's gloo threads: each group holds
    a TCP loop and two workers until destroyed, and the resume matrix's 30 grids per launch once
    ran ~555 threads per rank (a load of 150 on 2 cores). ``dist.destroy_process_group`` alone
    was not enough: the p2p layer's per-group memory kept the groups alive."""
    for before, seen, after, value in minidist.run(_build_use_close, 4, timeout=120):
        assert seen[0] > before            # the grid's groups (and the comm thread's) were live
        assert after == before, (before, seen, after)
        assert seen == [seen[0]] * 3       # no growth from one grid to the next
        assert value == 4.0                # 2 (dp) x 1 (tp) x exchange x 2 (the thread's dp)
