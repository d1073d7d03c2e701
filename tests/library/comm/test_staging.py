"""The staging path (minidist.comm.staging), forced on for CPU tensors so it runs without a GPU.

On a GPU shared by several ranks every message is a CUDA tensor that gloo cannot send, and
p2p routes it through a reusable CPU buffer. Here staging is forced for CPU tensors: every
collective, with every algorithm, W = 1..4, sizes 0, 1, 3, 1001, must give bit-identical results
to the same call unstaged, and equal torch.distributed's within the tolerances of
test_collectives.py; and the second pass over the same calls allocates no buffer.
"""

import os

import pytest
import torch
import torch.distributed as dist

import minidist
from minidist import collectives as C
from minidist.comm import staging

SIZES = (0, 1, 3, 1001)
TOL = {torch.float32: 1e-5, torch.int64: 0}


from test_collectives import _err, _input  # the same seeded inputs and relative error as the collectives' tests


_TORCH_OP = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _cases(rank, world):
    """(name, minidist call -> tensor, torch reference -> tensor) for every collective/algorithm."""
    last = world - 1
    for dtype, ops in ((torch.float32, ("sum", "avg", "max")), (torch.int64, ("sum", "min"))):
        for n in SIZES:
            x = _input(n, dtype, rank, n)
            for op in ops:
                top = _TORCH_OP.get(op, dist.ReduceOp.SUM)
                fix = (lambda t: t / world) if op == "avg" else (lambda t: t)

                def ref_ar(x=x, top=top, fix=fix):
                    r = x.clone()
                    if r.numel():
                        dist.all_reduce(r, op=top)
                    return fix(r)
                for alg in C.ALGORITHMS["all_reduce"]:
                    yield (f"all_reduce/{alg}/{op}/{dtype}/{n}",
                           lambda x=x, op=op, alg=alg: C.all_reduce(x.clone(), op=op, algorithm=alg),
                           ref_ar)
                for alg in C.ALGORITHMS["reduce"]:
                    # only the root's result is defined (the others hold scratch)
                    yield (f"reduce/{alg}/{op}/{dtype}/{n}",
                           lambda x=x, op=op, alg=alg: C.reduce(x.clone(), last, op=op,
                                                                algorithm=alg),
                           ref_ar if rank == last else (lambda ref_ar=ref_ar: (ref_ar(), None)[1]))
                big = _input(n * world, dtype, rank, n + 7)

                def ref_rs(big=big, top=top, fix=fix):
                    r = big.clone()
                    if r.numel():
                        dist.all_reduce(r, op=top)
                    return fix(r).split(n)[rank] if n else r[:0]
                for alg in C.ALGORITHMS["reduce_scatter"]:
                    yield (f"reduce_scatter/{alg}/{op}/{dtype}/{n}",
                           lambda big=big, op=op, alg=alg: C.reduce_scatter(
                               torch.empty(n, dtype=dtype), big.clone(), op=op, algorithm=alg),
                           ref_rs)

            def ref_ag(x=x):
                out = [torch.empty_like(x) for _ in range(world)]
                if x.numel():
                    dist.all_gather(out, x)
                return torch.cat(out)
            for alg in C.ALGORITHMS["all_gather"]:
                yield (f"all_gather/{alg}/{dtype}/{n}",
                       lambda x=x, alg=alg: C.all_gather(torch.empty(n * world, dtype=dtype), x,
                                                         algorithm=alg), ref_ag)

            def ref_bc(x=x):
                r = x.clone()
                if r.numel():
                    dist.broadcast(r, src=last)
                return r
            for alg in C.ALGORITHMS["broadcast"]:
                yield (f"broadcast/{alg}/{dtype}/{n}",
                       lambda x=x, alg=alg: C.broadcast(x.clone(), last, algorithm=alg), ref_bc)
            pieces = [_input(n, dtype, rank, 100 + j) for j in range(world)]
            yield (f"all_to_all/{dtype}/{n}",
                   lambda pieces=pieces: torch.cat(C.all_to_all(
                       [torch.empty(n, dtype=dtype) for _ in range(world)], pieces)),
                   lambda: torch.cat([_input(n, dtype, j, 100 + rank) for j in range(world)]))


def _staged_rank(rank, world):
    staging.reset()
    rows = []
    for name, call, ref in _cases(rank, world):
        plain = call()
        with staging.forced():
            staged = call()
        want = ref()  # every rank joins torch's reference; None: no defined result here
        want = staged if want is None else want
        rows.append((name, torch.equal(staged, plain), _err(staged, want)))
    first = staging.stats()
    # the same calls again, in the same order (at W = 2 the size agreement travels beside the
    # data once the previous call agreed the same sizes: comm/agreed.py): every buffer from the pool
    for name, call, ref in _cases(rank, world):
        call()
        with staging.forced():
            call()
    return rows, first, staging.stats()


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_collective_staged_equals_torch(world):
    results = minidist.run(_staged_rank, world, timeout=240)
    for rank, (rows, first, second) in enumerate(results):
        assert len(rows) > 100
        for name, identical, err in rows:
            assert identical, f"rank {rank} {name}: staged result differs from the unstaged one"
            tol = TOL[torch.int64] if "int64" in name else TOL[torch.float32]
            assert err <= tol, f"rank {rank} {name}: {err} vs torch"
        if world > 1:
            assert first["staged_sends"] > 0 and first["staged_recvs"] > 0, first
            assert first["allocations"] >= 1
            # reuse: the second pass stages as many messages and allocates nothing new
            assert second["staged_sends"] == 2 * first["staged_sends"]
            assert second["allocations"] == first["allocations"], (first, second)
            # per message in flight at once (up to 2(W-1) in all_to_all, each regrown at most once
            # as sizes go from 0 to 1001 elements), not per message sent
            assert first["allocations"] <= 4 * world, first
            assert first["allocations"] * 10 < first["staged_sends"], first
        else:
            assert first["staged_sends"] == 0  # W=1 sends nothing


def _env_var_rank(rank, world):
    """The environment variable reaches threads too (a DDP communication thread stages)."""
    import threading
    os.environ["MINIDIST_FORCE_STAGING"] = "1"
    staging.reset()
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("x", C.all_reduce(torch.arange(5.0) + rank)))
    t.start()
    t.join()
    return out["x"], staging.stats()["staged_sends"]


def test_env_var_forces_staging_in_every_thread():
    res = minidist.run(_env_var_rank, 2, timeout=120)
    for x, sends in res:
        assert torch.equal(x, 2 * torch.arange(5.0) + 1)
        assert sends > 0


def test_pool_reuses_and_bounds_buffers():
    pool = staging.StagingPool()
    a = pool.acquire(10, pin=False)
    assert a.numel() == 4096 and pool.allocations == 1
    pool.release(a)
    b = pool.acquire(4000, pin=False)
    assert b is a and pool.allocations == 1  # reused
    c = pool.acquire(5000, pin=False)  # a is lent: a second buffer, next power of two
    assert c.numel() == 8192 and pool.allocations == 2
    pool.release(b)
    pool.release(c)
    d = pool.acquire(100_000, pin=False)  # nothing fits: allocate, drop the largest too-small one
    assert d.numel() == 131072 and pool.held() == 1
    pool.release(d)
    assert pool.acquire(0, pin=False).numel() == 4096  # the smallest that fits


def test_cpu_tensors_are_not_staged_unless_forced(monkeypatch):
    monkeypatch.delenv("MINIDIST_FORCE_STAGING", raising=False)
    x = torch.zeros(3)
    # with no process group, needs_staging must not ask for the backend of a CPU tensor... unless
    # forced, which needs no backend either
    with staging.forced():
        assert staging.needs_staging(x)
    with staging.forced(False):
        monkeypatch.setenv("MINIDIST_FORCE_STAGING", "1")
        assert not staging.needs_staging(x)  # an explicit forced(False) wins over the variable
