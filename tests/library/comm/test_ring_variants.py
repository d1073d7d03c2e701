"""The two rings of minidist.comm.ring — the base ring (one exchange per step) and the pre-posted
refinement — against torch.distributed.all_reduce.

W = 1..4, sizes 0, 1, 3, 10, 1001 (not divisible by W; fewer elements than ranks; empty). Float32
within 1e-5 relative to the magnitude (the ring adds in a different order than gloo); int64 exact.
The two variants must also agree with each other bit for bit and send the same bytes and messages:
they differ only in when the receives are posted.
"""

import pytest
import torch
import torch.distributed as dist

import minidist
from minidist.comm import p2p, ring

SIZES = (0, 1, 3, 10, 1001)


def _rank(rank, world):
    rows = []
    for dtype in (torch.float32, torch.int64):
        for n in SIZES:
            g = torch.Generator().manual_seed(100 * rank + n)
            x = (torch.randn(n, generator=g) if dtype.is_floating_point
                 else torch.randint(-50, 50, (n,), generator=g)).to(dtype)
            ref = x.clone()
            if n:
                dist.all_reduce(ref)
            got = {}
            for name, fn in ring.VARIANTS.items():
                y = x.clone()
                with p2p.count_traffic() as t:
                    fn(y, "sum", rank, world)
                got[name] = (y, t.bytes_sent, t.msgs_sent)
            rows.append((dtype, n, ref, got))
    return rows


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_both_rings_equal_torch_all_reduce(world):
    assert set(ring.VARIANTS) == {"simple", "preposted"}
    results = minidist.run(_rank, world, timeout=120)
    for rank, rows in enumerate(results):
        for dtype, n, ref, got in rows:
            scale = max(1.0, ref.abs().max().item()) if n else 1.0
            tol = 1e-5 if dtype.is_floating_point else 0
            for name, (y, _, _) in got.items():
                assert y.dtype == dtype and y.shape == ref.shape, (rank, name, n)
                err = (y.double() - ref.double()).abs().max().item() / scale if n else 0.0
                assert err <= tol, (world, rank, name, dtype, n, err)
            (a, bytes_a, msgs_a), (b, bytes_b, msgs_b) = got["simple"], got["preposted"]
            assert torch.equal(a, b), (world, rank, dtype, n)
            assert (bytes_a, msgs_a) == (bytes_b, msgs_b), (world, rank, dtype, n)
            elem = torch.empty(0, dtype=dtype).element_size()
            # every rank sends all chunks but one in each phase: 2(W-1)/W · N when W divides N
            sizes = [c.numel() for c in torch.empty(n).tensor_split(world)]
            assert bytes_a == elem * (2 * n - sizes[(rank + 1) % world] - sizes[rank]), \
                (world, rank, n, bytes_a)
    # the results are the same on every rank
    for rows in results[1:]:
        for (_, _, _, got), (_, _, _, got0) in zip(rows, results[0]):
            assert torch.equal(got["simple"][0], got0["simple"][0])


def test_library_default_is_the_preposted_ring():
    assert ring.all_reduce is ring.all_reduce_preposted
    assert ring.reduce_scatter_chunks is ring.reduce_scatter_preposted
    assert ring.all_gather_chunks is ring.all_gather_preposted


def _wrong_place(rank, world):
    """Every public ring, called on 2 node groups of 2 with the GLOBAL rank as the place (the
    mistake of a learner's hierarchical all-reduce): ranks 2 and 3 are wrong, 0 and 1 right."""
    nodes = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = nodes[rank // 2]
    one = lambda: list(torch.ones(4).tensor_split(2))  # noqa: E731
    calls = {
        "reduce_scatter_chunks": lambda: ring.reduce_scatter_chunks(one(), "sum", rank, 2, mine),
        "all_gather_chunks": lambda: ring.all_gather_chunks(one(), rank, 2, mine),
        "all_reduce": lambda: ring.all_reduce(torch.ones(4), "sum", rank, 2, mine),
        "reduce_scatter_simple": lambda: ring.reduce_scatter_simple(one(), "sum", rank, 2, mine),
        "all_gather_simple": lambda: ring.all_gather_simple(one(), rank, 2, group=mine),
        "all_reduce_simple": lambda: ring.all_reduce_simple(torch.ones(4), "sum", rank, 2, mine),
        "all_reduce (world wrong)": lambda: ring.all_reduce(torch.ones(4), "sum", rank % 2, 4, mine),
        "all_reduce (keywords)": lambda: ring.all_reduce(torch.ones(4), op="sum", rank=rank,
                                                         world=2, group=mine),
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    return out


@pytest.mark.timeout(60)
def test_a_global_rank_for_a_place_in_the_group_is_refused_on_every_wrong_rank():
    """The check runs before any message: the wrong ranks raise, naming the place they hold, and
    the right ranks' calls are not left waiting for them (both nodes' rings are separate)."""
    out = minidist.run(_wrong_place, 4, timeout=45)
    for rank in (0, 1):
        assert all(v is None for k, v in out[rank].items() if "world" not in k), out[rank]
    for rank in (2, 3):
        assert out[rank]["all_reduce"] == (
            f"ring.all_reduce (rank {rank}): rank={rank} but this process is rank {rank - 2} of "
            "its group (size 2): pass the place in the group (rank="
            f"{rank} is this process's global rank; the ranks of a group are numbered 0 … 1 in "
            "the order of their global ranks)"), out[rank]["all_reduce"]
        assert out[rank]["reduce_scatter_chunks"].startswith(
            f"ring.reduce_scatter_chunks (rank {rank}): rank={rank} but")
        assert out[rank]["all_gather_chunks"].startswith(f"ring.all_gather_chunks (rank {rank}):")
        for name in ("reduce_scatter_simple", "all_gather_simple", "all_reduce_simple"):
            assert out[rank][name].startswith(f"ring.{name} (rank {rank}): rank={rank} but"), name
        assert out[rank]["all_reduce (keywords)"] == out[rank]["all_reduce"]
    for rank in range(4):
        assert out[rank]["all_reduce (world wrong)"] == (
            f"ring.all_reduce (rank {rank}): world=4 but its group has 2 ranks: pass the group's "
            "size"), out[rank]
    # the world, without a process group: rank 0 of 1 is the only place there is
    ring.all_reduce(torch.ones(2), "sum", 0, 1)
    with pytest.raises(ValueError, match=r"rank=1 but this process is rank 0 of its group \(size 1\)"):
        ring.all_reduce(torch.ones(2), "sum", 1, 1)


def test_the_public_rings_are_the_plain_functions_with_the_check_in_front():
    """The check lives in minidist.comm.checks, applied once per public name; help() and
    inspect.getsource show the ring itself (chapter 03 prints it)."""
    import inspect

    from minidist.comm import checks
    for fn, contract in ((ring.reduce_scatter_chunks, "afterwards ``chunks[rank]`` holds"),
                         (ring.all_gather_chunks, "``chunks[rank]`` is this rank's data"),
                         (ring.all_reduce, "afterwards ``flat``"),
                         (ring.reduce_scatter_simple, "afterwards ``chunks[rank]`` holds"),
                         (ring.all_gather_simple, "``chunks[rank]`` is this rank's data"),
                         (ring.all_reduce_simple, "afterwards ``flat``")):
        plain = fn.__wrapped__
        assert fn.__code__ is checks.placed(plain, "x").__code__, fn.__name__
        assert fn.__name__ == plain.__name__ and fn.__doc__ == plain.__doc__
        assert inspect.getdoc(fn).startswith("In place: ") and contract in inspect.getdoc(fn)
        src = inspect.getsource(fn)
        assert src.startswith(f"def {plain.__name__}(") and "check" not in src
        assert inspect.signature(fn) == inspect.signature(plain)


def _skewed(rank, world):
    """Ranks that enter each all-reduce at different times (a random sleep per rank and call):
    the all-gather's receives, posted before the reduce-scatter's first send, may be filled only
    after this rank's last use of their chunk (ring.all_reduce_preposted's argument)."""
    import random
    import time
    rng = random.Random(rank)
    out = []
    for n in (3, 10, 1001, 40_000):   # uneven chunks, fewer elements than ranks, a large one
        for i in range(4):
            x = torch.randn(n, generator=torch.Generator().manual_seed(1000 * rank + 10 * n + i))
            ref = x.clone()
            dist.all_reduce(ref)
            time.sleep(rng.random() * 0.02)
            ring.all_reduce(x, "sum", rank, world)
            out.append((n, (x - ref).abs().max().item() / max(1.0, ref.abs().max().item()), x))
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
def test_preposted_all_reduce_is_right_when_ranks_arrive_at_different_times(world):
    results = minidist.run(_skewed, world, timeout=120)
    for rank, rows in enumerate(results):
        for (n, err, x), (_, _, x0) in zip(rows, results[0]):
            assert err <= 1e-5, (world, rank, n, err)
            assert torch.equal(x, x0), (world, rank, n)   # bit-identical on every rank
