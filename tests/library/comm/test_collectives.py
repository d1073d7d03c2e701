"""Every hand-built collective against torch.distributed's own, on several ranks.

Tolerances: integers exact; float32 and float64 within 1e-5 / 1e-12 relative to the magnitude (the
summation order differs from gloo's); bfloat16 within 2**-7 relative (its epsilon).
Each test launches the ranks once and loops over sizes inside them, to keep the suite fast.
"""

import pytest
import torch
import torch.distributed as dist

import minidist
from minidist import collectives as C
from minidist.comm import p2p
from minidist.comm.ops import CollectiveMismatchError

SIZES = (0, 1, 3, 6, 10, 1001)
BIG = (1 << 20) + 3  # large, and not divisible by any W > 1
TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 2 ** -7, torch.int64: 0,
       torch.int32: 0}


def _input(n, dtype, rank, salt=0):
    g = torch.Generator().manual_seed(1000 * rank + salt)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    return torch.randint(-50, 50, (n,), generator=g).to(dtype)


def _err(a, b):
    if a.numel() == 0:
        return 0.0
    scale = max(1.0, b.abs().max().item()) if b.dtype.is_floating_point else 1.0
    return (a.double() - b.double()).abs().max().item() / scale


def _all_reduce_rank(rank, world, dtype, ops, sizes):
    errs = []
    for op in ops:
        for alg in ("ring", "naive", "recursive_doubling"):
            for n in sizes:
                x = _input(n, dtype, rank, n)
                ref = x.clone()
                torch_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
                            "min": dist.ReduceOp.MIN, "avg": dist.ReduceOp.SUM}[op]
                if n:
                    dist.all_reduce(ref, op=torch_op)
                if op == "avg":
                    ref = ref / world
                got = C.all_reduce(x.clone(), op=op, algorithm=alg)
                errs.append((op, alg, n, _err(got, ref)))
    return errs


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_all_reduce_matches_torch(world):
    for dtype, ops in [(torch.float32, ("sum", "avg", "max", "min")), (torch.int64, ("sum", "max")),
                       (torch.float64, ("sum",)), (torch.bfloat16, ("sum",))]:
        results = minidist.run(_all_reduce_rank, world, dtype, ops, SIZES, timeout=120)
        for rank_errs in results:
            for op, alg, n, err in rank_errs:
                assert err <= TOL[dtype], (dtype, op, alg, n, err)


def _bit_identical_rank(rank, world, n):
    out = {}
    for alg in ("ring", "naive", "recursive_doubling"):
        out[alg] = C.all_reduce(_input(n, torch.float32, rank), algorithm=alg)
    return out


@pytest.mark.parametrize("world", [3, 4])
def test_all_reduce_large_and_identical_on_every_rank(world):
    """2^20+3 elements (uneven pieces); and every rank ends with bit-identical values (DDP relies on it)."""
    res = minidist.run(_bit_identical_rank, world, BIG, timeout=120)
    ref = sum(_input(BIG, torch.float64, r) for r in range(world))
    for alg in ("ring", "naive", "recursive_doubling"):
        for r in range(world):
            assert torch.equal(res[r][alg], res[0][alg]), (alg, r)
        assert _err(res[0][alg], ref) < 1e-5


def _avg_rank(rank, world):
    return C.all_reduce(torch.tensor([rank + 1.0]), op="avg").item()


def test_avg_is_sum_divided_by_world_size():
    """avg on gloo (which has no AVG): W=4, x=[rank+1] -> 2.5 on all ranks."""
    assert minidist.run(_avg_rank, 4) == [2.5] * 4


def _rs_ag_rank(rank, world, sizes):
    errs = []
    for n in sizes:
        # reduce-scatter, tensor form (n per rank) and list form (uneven pieces)
        for alg in ("ring", "naive"):
            x = _input(n * world, torch.float32, rank, n)
            ref = torch.empty(n)
            if n:
                dist.reduce_scatter(ref, [p.clone() for p in x.split(n)])
            got = C.reduce_scatter(torch.empty(n), x.clone(), algorithm=alg)
            errs.append(("rs", alg, n, _err(got, ref)))
            pieces = list(x.tensor_split(world))  # uneven: sizes differ by rank
            want = sum(_input(n * world, torch.float32, r, n).tensor_split(world)[rank]
                       for r in range(world))
            out = torch.empty_like(pieces[rank])
            C.reduce_scatter(out, [p.clone() for p in pieces], algorithm=alg)
            errs.append(("rs-list", alg, n, _err(out, want)))
            # all-gather, tensor form against torch
            y = _input(n, torch.float32, rank, n + 1)
            parts = [torch.empty(n) for _ in range(world)]
            if n:
                dist.all_gather(parts, y)
            got = C.all_gather(torch.empty(n * world), y, algorithm=alg)
            errs.append(("ag", alg, n, _err(got, torch.cat(parts))))
            # all-gather, list form with a different size per rank
            outs = [torch.empty(n + r) for r in range(world)]
            C.all_gather(outs, torch.full((n + rank,), float(rank)), algorithm=alg)
            errs.append(("ag-list", alg, n, max(_err(o, torch.full_like(o, r))
                                                for r, o in enumerate(outs))))
    return errs


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_reduce_scatter_and_all_gather_match_torch(world):
    for rank_errs in minidist.run(_rs_ag_rank, world, SIZES, timeout=120):
        for kind, alg, n, err in rank_errs:
            assert err <= 1e-5, (kind, alg, n, err)


def _rooted_rank(rank, world, sizes):
    errs = []
    for n in sizes:
        for root in range(world):
            for alg in ("tree", "naive", "ring"):
                x = _input(n, torch.float32, rank, n)
                ref = x.clone()
                if n:
                    dist.broadcast(ref, root)
                errs.append(("bcast", alg, n, root, _err(C.broadcast(x.clone(), root, alg), ref)))
            for alg in ("tree", "naive"):
                x = _input(n, torch.int32, rank, n)
                ref = x.clone()
                if n:
                    dist.reduce(ref, root)
                got = C.reduce(x.clone(), root, algorithm=alg)
                errs.append(("reduce", alg, n, root, _err(got, ref) if rank == root else 0.0))
        outs = [torch.empty(n) for _ in range(world)]
        ins = [_input(n, torch.float32, rank, j) for j in range(world)]
        refs = [torch.empty(n) for _ in range(world)]
        if n:
            dist.all_to_all(refs, [i.clone() for i in ins])
            C.all_to_all(outs, ins)
            errs.append(("a2a", "naive", n, -1, max(_err(o, r) for o, r in zip(outs, refs))))
    return errs


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_broadcast_reduce_all_to_all_match_torch(world):
    for rank_errs in minidist.run(_rooted_rank, world, (0, 1, 3, 1001), timeout=120):
        for kind, alg, n, root, err in rank_errs:
            assert err == 0.0, (kind, alg, n, root, err)


def _noncontig_rank(rank, world):
    x = torch.arange(12.0).view(3, 4).t() * (rank + 1)  # not contiguous
    C.all_reduce(x)
    return x


def test_non_contiguous_is_copied_back_in_place():
    res = minidist.run(_noncontig_rank, 2)
    assert torch.equal(res[0], torch.arange(12.0).view(3, 4).t() * 3)


def _traffic_rank(rank, world, n):
    p2p.reset_traffic()
    with p2p.count_traffic() as t:
        C.all_reduce(torch.ones(n))
    return t.bytes_sent // 4, t.bytes_recv // 4


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_traffic_is_2_w_minus_1_over_w_n(world):
    """Per-rank traffic of a ring all-reduce is 2(W-1)/W · N elements (N divisible by W)."""
    n = 12 * 1000
    for sent, recvd in minidist.run(_traffic_rank, world, n):
        assert sent == recvd == 2 * (world - 1) * n // world


def _ring_4m_rank(rank, world):
    x = torch.ones(4 * 1024 * 1024) * (rank + 1)
    C.all_reduce(x)
    return x[0].item(), x[-1].item()


def test_ring_does_not_deadlock_on_messages_too_large_to_buffer():
    """4M floats; rank r holds ones*(r+1) -> W(W+1)/2 everywhere."""
    assert minidist.run(_ring_4m_rank, 3, timeout=120) == [(6.0, 6.0)] * 3


def _bad_input_rank(rank, world, case):
    if case == "int-avg":
        C.all_reduce(torch.ones(3, dtype=torch.int64), op="avg")
    elif case == "bool-avg":
        C.all_reduce(torch.ones(3, dtype=torch.bool), op="avg")
    elif case == "bad-op":
        C.all_reduce(torch.ones(3), op="prod")
    elif case == "bad-alg":
        C.all_reduce(torch.ones(3), algorithm="butterfly")
    elif case == "bad-root":
        C.broadcast(torch.ones(3), src=world)
    elif case == "bad-output":
        C.all_gather(torch.empty(5), torch.ones(3))
    elif case == "mismatch":
        C.all_reduce(torch.ones(4 if rank == 0 else 6), debug=True)


@pytest.mark.parametrize("case,match", [
    ("int-avg", r"op='avg' on torch.int64 would truncate"),
    ("bool-avg", r"op='avg' on torch.bool would truncate"),
    ("bad-op", r"op must be one of"),
    ("bad-alg", r"algorithm must be one of"),
    ("bad-root", r"root must be a rank in 0..1"),
    ("bad-output", r"output must hold world_size x 3 = 6 elements"),
    ("mismatch", r"ranks disagree before any data moved[\s\S]*rank 0: .*shape=\(4,\)[\s\S]*rank 1: .*shape=\(6,\)"),
])
def test_bad_input_gives_a_clear_error_naming_the_rank(case, match):
    with pytest.raises(minidist.RankError, match=match) as info:
        minidist.run(_bad_input_rank, 2, case, timeout=30)
    assert "rank" in str(info.value).splitlines()[0]


def _mismatch_type_rank(rank, world):
    try:
        C.all_reduce(torch.ones(4 if rank == 0 else 6), debug=True)
    except CollectiveMismatchError:
        return "raised"
    return "no error"


def test_debug_mode_raises_on_every_rank_before_data_moves():
    """Mismatched shapes across ranks: in debug mode every rank gets the mismatch error (no abort, no hang)."""
    assert minidist.run(_mismatch_type_rank, 3, timeout=30) == ["raised"] * 3


def _debug_env_rank(rank, world):
    import os
    os.environ["MINIDIST_DEBUG"] = "1"
    C.all_reduce(torch.ones(2, dtype=torch.float32 if rank else torch.float64))


def test_debug_mode_from_environment():
    with pytest.raises(minidist.RankError, match=r"dtype=torch.float64[\s\S]*dtype=torch.float32"):
        minidist.run(_debug_env_rank, 2, timeout=30)


def _autograd_rank(rank, world):
    from minidist.tensor_parallel import regions as A
    x = torch.ones(3, requires_grad=True)
    ((rank + 1) * A.all_reduce(x)).sum().backward()
    g = (torch.arange(4.0) + rank * 4).requires_grad_()  # rank's slice of [0..4W)
    full = A.all_gather(g, dim=0)
    (full * torch.arange(4.0 * world)).sum().backward()
    h = torch.ones(2 * world, requires_grad=True)
    part = A.reduce_scatter(h * (rank + 1), dim=0)
    (part * (rank + 1)).sum().backward()
    return x.grad, g.grad, full.detach(), part.detach(), h.grad


def test_differentiable_collectives_have_the_conjugate_backward():
    """A differentiable all-reduce: y = all_reduce(x), loss_r = ((r+1)*y).sum() -> x.grad = 3 on both of 2 ranks."""
    world = 2
    res = minidist.run(_autograd_rank, world)
    for rank, (xg, gg, full, part, hg) in enumerate(res):
        assert torch.equal(xg, torch.full((3,), 3.0))
        # all_gather backward: reduce-scatter of d(loss)/d(full) summed over ranks
        assert torch.equal(full, torch.arange(4.0 * world))
        assert torch.equal(gg, world * torch.arange(4.0 * world)[rank * 4:(rank + 1) * 4])
        # reduce_scatter forward: sum over ranks of (r+1) -> 3; backward: all-gather of (r+1)
        assert torch.equal(part, torch.full((2,), 3.0))
        assert torch.equal(hg, torch.cat([torch.full((2,), float(r + 1)) for r in range(world)])
                           * (rank + 1))


def _group_rank(rank, world):
    evens = dist.new_group([0, 2])
    odds = dist.new_group([1, 3])
    mine = evens if rank % 2 == 0 else odds
    x = torch.tensor([float(rank)])
    C.all_reduce(x, group=mine)
    y = torch.tensor([float(rank)])
    C.broadcast(y, src=1, group=mine)  # group rank 1 = global rank 2 or 3
    return x.item(), y.item()


def test_collectives_inside_a_subgroup():
    assert minidist.run(_group_rank, 4) == [(2.0, 2.0), (4.0, 3.0), (2.0, 2.0), (4.0, 3.0)]


@pytest.mark.parametrize("world", [5, 6, 8])
def test_all_reduce_up_to_eight_ranks(world):
    """Recursive doubling folds the extra ranks in when W is not a power of two (5, 6)."""
    results = minidist.run(_all_reduce_rank, world, torch.float32, ("sum",), (0, 3, 7, 1001),
                           timeout=120)
    for rank_errs in results:
        for op, alg, n, err in rank_errs:
            assert err <= 1e-5, (op, alg, n, err)


def _old_tree_name_rank(rank, world):
    try:
        C.all_reduce(torch.ones(3), algorithm="tree")
    except ValueError as e:
        return str(e)
    return "no error"


def test_all_reduce_tree_is_a_clear_error_naming_recursive_doubling():
    """all-reduce's log2(W) algorithm is recursive doubling; "tree" stays for broadcast/reduce."""
    msg = minidist.run(_old_tree_name_rank, 2, timeout=60)[0]
    assert "recursive_doubling" in msg and "all_reduce" in msg, msg


def _unmovable_then_valid(rank, world):
    out = []
    cases = [("all_reduce", lambda bad: C.all_reduce(bad)),
             ("broadcast", lambda bad: C.broadcast(bad, 0)),
             ("all_gather", lambda bad: C.all_gather(torch.zeros(8), bad)),
             ("reduce_scatter", lambda bad: C.reduce_scatter(torch.zeros(2), [bad, bad])),
             ("all_to_all", lambda bad: C.all_to_all([torch.zeros(4)] * world, [bad] * world))]
    for make, kind in ((lambda: torch.empty(4, device="meta"), "meta device"),
                       (lambda: torch.ones(4).to_sparse(), "sparse")):
        for op, call in cases:
            with pytest.raises(ValueError, match=rf"{op} \(rank {rank}\): .*{kind}") as e:
                call(make())
            t = torch.full((4,), float(rank + 1))
            C.all_reduce(t)                         # the next, valid collective runs at once
            out.append((op, kind, t.tolist() == [world * (world + 1) / 2] * 4, str(e.value)))
    return out


@pytest.mark.timeout(60)
def test_a_meta_or_sparse_tensor_is_refused_before_any_message_and_the_next_collective_runs():
    """Field report: a meta tensor's error left the ranks' messages half sent and the next,
    valid all-reduce hung until the timeout; a sparse tensor's error was torch's "unsupported
    memory format option Contiguous". Both are refused by name, on every rank, first."""
    for rank, rows in enumerate(minidist.run(_unmovable_then_valid, 2, timeout=45)):
        assert len(rows) == 10
        for op, kind, ok, msg in rows:
            assert ok, (op, kind)
            assert ("to_dense" if kind == "sparse" else "materialise") in msg, msg
