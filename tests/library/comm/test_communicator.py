"""minidist.communicator: the one switch between hand-built and torch collectives, and the one
communication thread every strategy uses.

Both implementations are run on the same inputs inside one launch per world size (W = 1, 2, 3;
sizes 0, 1, 5 and 7 elements per rank, none divisible by 2 or 3 except 0) and must agree with each
other and with a value computed by hand from every rank's input: fp64 inputs, so sums agree to
1e-12 relative (the order of additions differs), max/min and gathers exactly.
"""

import pytest
import torch

import minidist
from minidist.comm.p2p import group_rank_world
from minidist.communicator import COLLECTIVES, CommThread, Communicator, check_collectives

SIZES = (0, 1, 5, 7)


def _x(rank, n, salt=0):
    g = torch.Generator().manual_seed(100 * rank + 10 * n + salt)
    return torch.randn(n, generator=g, dtype=torch.float64)


def _rank(rank, world):
    errors = []

    def check(name, got, want, tol=1e-12):
        err = 0.0 if got.numel() == 0 else ((got - want).abs().max() / want.abs().max().clamp(min=1)).item()
        if err > tol or got.shape != want.shape:
            errors.append(f"rank {rank} {name}: error {err:.3g}, shapes {tuple(got.shape)} vs "
                          f"{tuple(want.shape)}")

    # the one meaning of group=None in the library: the world
    assert group_rank_world() == group_rank_world(None) == (rank, world)
    for impl in COLLECTIVES:
        comm = Communicator(impl, None)
        assert (comm.rank, comm.world_size) == (rank, world)
        for n in SIZES:
            every = [_x(r, n) for r in range(world)]
            for op, want in (("sum", sum(every)), ("avg", sum(every) / world),
                             ("max", torch.stack(every).amax(0)), ("min", torch.stack(every).amin(0))):
                t = _x(rank, n)
                out = comm.all_reduce(t, op)
                assert out is t   # in place
                check(f"{impl} all_reduce {op} n={n}", t, want if n else torch.empty(0, dtype=t.dtype),
                      0.0 if op in ("max", "min") else 1e-12)
            out = torch.full((world, n), float("nan"), dtype=torch.float64)
            comm.all_gather(out, _x(rank, n))
            check(f"{impl} all_gather n={n}", out, torch.stack(every), 0.0)
            flat = torch.cat([_x(rank, n, 1) for _ in range(world)]) if n else torch.empty(0, dtype=torch.float64)
            total = sum(torch.cat([_x(r, n, 1) for _ in range(world)]) for r in range(world)) if n else flat
            shard = torch.empty(n, dtype=torch.float64)
            comm.reduce_scatter(shard, flat.clone(), "avg")
            check(f"{impl} reduce_scatter n={n}", shard,
                  (total[rank * n:(rank + 1) * n] / world) if n else shard)
            b = _x(rank, n, 2)
            comm.broadcast(b, world - 1)
            check(f"{impl} broadcast n={n}", b, _x(world - 1, n, 2), 0.0)
        # the one communication thread: submission order kept, an error re-raised on wait
        worker = CommThread(comm)
        seen = []
        handles = [worker.submit(f"job {i}", lambda c, i=i: seen.append((i, c.all_reduce(
            torch.tensor([float(rank + i)], dtype=torch.float64), "sum").item()))) for i in range(4)]
        for h in handles:
            h.wait()
        want = [(i, float(sum(range(world)) + world * i)) for i in range(4)]
        if seen != want:
            errors.append(f"rank {rank} {impl} CommThread: {seen} != {want}")
        bad = worker.submit("the broken job", lambda c: 1 / 0)
        try:
            bad.wait()
            errors.append(f"rank {rank} {impl}: an error on the thread was not re-raised")
        except RuntimeError as e:
            if "the broken job failed on the communication thread" not in str(e):
                errors.append(f"rank {rank}: {e}")
        worker.close()
    try:
        Communicator(impl, None).all_gather(torch.empty(world * 3 + 1), torch.empty(3))
        errors.append(f"rank {rank}: a wrong all_gather output size was accepted")
    except ValueError as e:
        if f"all_gather (rank {rank})" not in str(e):
            errors.append(str(e))
    return errors


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_both_implementations_agree_with_the_definition(world):
    results = minidist.run(_rank, world, timeout=90)
    assert results == [[]] * world, "\n".join(e for r in results for e in r)


def test_unknown_implementation_and_no_process_group_are_errors():
    with pytest.raises(ValueError, match="collectives must be 'hand-built' or 'torch', got 'nccl'"):
        check_collectives("nccl")
    with pytest.raises(RuntimeError, match="process group is not initialised"):
        Communicator("torch")


def test_without_a_process_group_this_process_is_alone_and_a_group_is_an_error():
    """group_rank_world outside any run: (0, 1) for the world; a group cannot exist without one."""
    assert group_rank_world() == (0, 1)
    with pytest.raises(RuntimeError, match="a process group was given but torch.distributed is "
                                           "not initialised"):
        group_rank_world(object())
