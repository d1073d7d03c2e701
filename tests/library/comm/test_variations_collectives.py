"""Collectives whose ranks disagree on sizes: a clear error on every rank, never a stale element.

Found by trying the product as users do (issue 14): with per-rank sizes, ``all_gather`` on ranks
that pass inconsistent size lists left one rank silently holding a stale value (gloo accepts a
message shorter than the receive buffer; the rest of the buffer keeps what it held). The same held
for ``broadcast`` when the root's tensor is smaller than a receiver's (and a root with an empty
tensor left the others waiting for the timeout), for ``reduce_scatter`` with per-rank sizes and for
``all_to_all`` when an output is larger than what its sender sends. Debug mode is off throughout.
"""

import pytest
import torch

import minidist
from minidist import collectives as C

STALE = -7.0  # what an output holds before the call: it must never survive one


def _disagree_rank(rank, world, op, algorithm, case, warm=False):
    site = "here" if warm else None   # a named call site: at W = 2 its next call carries the
    if warm:                          # agreement beside the data (comm/agreed.py)
        if op == "all_gather":
            C.all_gather(torch.empty(3 * world), torch.ones(3), algorithm=algorithm, debug=False,
                         agree_at=site)
        else:
            C.reduce_scatter(torch.empty(3), torch.ones(3 * world), algorithm=algorithm,
                             debug=False, agree_at=site)
    if op == "all_gather":
        if case == "receiver-larger":  # rank 0 expects more from the last rank than it sends
            sizes = [3] * world
            if rank == 0:
                sizes[-1] = 5
        elif case == "receiver-smaller":
            sizes = [3] * world
            if rank == 0:
                sizes[-1] = 2
        else:  # "tensor-form": each rank's own input size differs
            n = 3 if rank == 0 else 4
            out = torch.full((n * world,), STALE)
            C.all_gather(out, torch.full((n,), float(rank)), algorithm=algorithm, debug=False,
                         agree_at=site)
            return out.tolist()
        outs = [torch.full((s,), STALE) for s in sizes]
        C.all_gather(outs, torch.full((sizes[rank],), float(rank)), algorithm=algorithm,
                     debug=False, agree_at=site)
        return [o.tolist() for o in outs]
    if op == "reduce_scatter":
        sizes = [3] * world
        if rank == 0:
            sizes[-1] = 5 if case == "receiver-larger" else 2
        out = torch.full((sizes[rank],), STALE)
        C.reduce_scatter(out, [torch.ones(s) for s in sizes], algorithm=algorithm, debug=False,
                         agree_at=site)
        return out.tolist()
    if op == "broadcast":
        n = {"receiver-larger": (4 if rank == 0 else 6), "receiver-smaller": (6 if rank == 0 else 4),
             "empty-root": (0 if rank == 0 else 3)}[case]
        t = torch.full((n,), STALE if rank else 1.0)
        C.broadcast(t, 0, algorithm=algorithm, debug=False)
        return t.tolist()
    if op == "all_to_all":
        bigger = {"receiver-larger": 3, "receiver-smaller": 1}[case]
        ins = [torch.full((2,), float(10 * rank + j)) for j in range(world)]
        outs = [torch.full((bigger if (rank == 0 and j == 1) else 2,), STALE) for j in range(world)]
        C.all_to_all(outs, ins, debug=False)
        return [o.tolist() for o in outs]
    raise AssertionError(op)


CASES = [(op, alg, case, world)
         for world in (2, 3)
         for op, algs, cases in [
             ("all_gather", ("naive", "ring"), ("receiver-larger", "receiver-smaller", "tensor-form")),
             ("reduce_scatter", ("naive", "ring"), ("receiver-larger", "receiver-smaller")),
             ("broadcast", ("naive", "ring", "tree"), ("receiver-larger", "receiver-smaller",
                                                       "empty-root")),
             ("all_to_all", ("naive",), ("receiver-larger", "receiver-smaller"))]
         for alg in algs for case in cases]


# after an agreed call the sizes travel beside the data: the disagreement must still be an error
# on both ranks, neither a hang (pytorch/xla#8660: all_gather of different sizes hung) nor a gloo
# abort (a payload longer than its buffer)
WARM = [(op, "ring", case, 2, True) for op, alg, case, world in CASES
        if op in ("all_gather", "reduce_scatter") and alg == "ring" and world == 2]


@pytest.mark.parametrize("op,algorithm,case,world,warm",
                         [(*c, False) for c in CASES] + WARM)
def test_size_disagreement_is_an_error_naming_the_ranks(op, algorithm, case, world, warm):
    """``warm``: after an agreed call, where the agreement travels beside the data (W = 2)."""
    with pytest.raises(minidist.RankError) as info:
        got = minidist.run(_disagree_rank, world, op, algorithm, case, warm, timeout=60)
        pytest.fail(f"no error; results by rank: {got}")  # a silent (possibly stale) answer
    msg = str(info.value)
    assert "ranks disagree on the sizes" in msg, msg[-2000:]
    if op == "all_to_all":
        assert "rank 1 sends 2 elements to rank 0, which expects" in msg, msg[-2000:]
    else:
        assert "rank 0: [" in msg and "rank 1: [" in msg, msg[-2000:]


def _agree_rank(rank, world, algorithm):
    """Sizes that differ by rank but agree across ranks still work (and nothing stale remains)."""
    sizes = [r + 1 for r in range(world)]
    outs = [torch.full((s,), STALE) for s in sizes]
    C.all_gather(outs, torch.full((sizes[rank],), float(rank)), algorithm=algorithm, debug=False)
    assert all(torch.equal(o, torch.full_like(o, float(r))) for r, o in enumerate(outs)), outs
    out = torch.full((sizes[rank],), STALE)
    C.reduce_scatter(out, [torch.full((s,), float(rank)) for s in sizes], algorithm=algorithm,
                     debug=False)
    assert torch.equal(out, torch.full_like(out, float(sum(range(world))))), out
    ins = [torch.full((j + 1,), float(rank)) for j in range(world)]  # to rank j: j + 1 elements
    outs = [torch.full((rank + 1,), STALE) for _ in range(world)]
    C.all_to_all(outs, ins, debug=False)
    assert all(torch.equal(o, torch.full_like(o, float(j))) for j, o in enumerate(outs)), outs
    return True


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("algorithm", ["naive", "ring"])
def test_per_rank_sizes_that_agree_still_work(world, algorithm):
    assert minidist.run(_agree_rank, world, algorithm, timeout=60) == [True] * world


def _shapes_rank(rank, world):
    """One named call site after another with the shapes of a loop that changes its sequence
    length: every result right, nothing stale; a call whose sizes the site agreed before sends its
    data alone (the header goes by torch.distributed, as the all-reduce it replaces) and runs no
    separate agreement; a new shape sends old-length data first, then the data again."""
    from minidist.comm import agreed, p2p
    checks = []
    real = agreed.check_sizes_agree
    agreed.check_sizes_agree = lambda *a, **k: (checks.append(a[0]), real(*a, **k))[1]
    steady = []
    # field reports: an empty all_gather aborted gloo (pytorch#85234: [0, 0] here, through the
    # header); an all_gather of varying sizes paid one more collective each call to agree them
    # (Lightning-AI/pytorch-lightning#12630: here only a site's first call or a new shape does)
    for sizes in ([3, 3], [3, 3], [1, 2], [1, 2], [0, 4], [0, 4], [5, 5], [3, 3], [3, 3],
                  [0, 0], [0, 0]):
        before = (len(checks), p2p.traffic("all_gather/ring").msgs_sent)
        outs = [torch.full((s,), STALE) for s in sizes]
        C.all_gather(outs, torch.full((sizes[rank],), float(rank + 1)), debug=False,
                     agree_at="loop")
        assert all(torch.equal(o, torch.full_like(o, float(r + 1))) for r, o in enumerate(outs)), outs
        steady.append((len(checks) - before[0], p2p.traffic("all_gather/ring").msgs_sent - before[1]))
        out = torch.full((sizes[rank],), STALE)
        C.reduce_scatter(out, [torch.full((s,), float(rank + 1)) for s in sizes], debug=False,
                         agree_at="loop")
        assert torch.equal(out, torch.full_like(out, 3.0)), out
    return steady


def test_the_agreement_travels_beside_the_data_at_two_ranks_and_follows_new_shapes():
    for steady in minidist.run(_shapes_rank, 2, timeout=60):
        # (separate agreements, data messages sent) per all-gather: the first call agrees apart
        assert steady[0] == (1, 1) and steady[1] == (0, 1), steady
        assert steady[2] == (0, 2) and steady[3] == (0, 1), steady
        assert steady[7] == (0, 2) and steady[8] == (0, 1), steady
        assert steady[9] == (0, 1) and steady[10] == (0, 0), steady   # an empty piece sends nothing
