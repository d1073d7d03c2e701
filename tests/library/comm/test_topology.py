"""A two-level cluster on one machine (minidist.comm.topology), its shaper in p2p, and the
hierarchical collectives (minidist.comm.hierarchical, algorithm="hierarchical").

* without a launch: the topology's spec, links, errors; the cost model per link class;
* one launch (W = 4) runs many checks: hierarchical all_reduce / reduce_scatter / all_gather
  against torch's on hypothesis-drawn cases (a fixed list) under 2x2, 1x4 and 4x1 (sizes not
  divisible by 4, empty and 0-dim, ops sum/avg/max/min, float32/float64/int32/int64; integers
  exact, floats within ``torch.testing.assert_close``'s defaults: float32 rtol 1.3e-6 / atol
  1e-5, float64 rtol 1e-7 / atol 1e-7 — the summation order differs from gloo's), all_reduce
  bit-identical on every rank; bytes per link class against the formulas; groups made by
  ``hierarchical.new_group``; sub-groups made once; the errors on every rank, then a valid call;
* one launch times the shaper (a lower bound per message) and the crossover (hierarchical
  faster than the flat ring at beta_inter / beta_intra = 16: sleeps of 69 ms against 26 ms);
* one launch: a topology that does not describe the world is refused on every rank at start.
"""

from __future__ import annotations

import hashlib
import time

import pytest
import torch
import torch.distributed as dist

import minidist
from minidist import collectives as C
from minidist.comm import hierarchical, p2p, topology, tuner, tuner_topology
from minidist.comm.topology import Link, Topology

LAYOUTS = ("2x2", "1x4", "4x1")
EXAMPLES = 50            # per layout
OPS = ("all_reduce", "reduce_scatter", "all_gather")
REDS = ("sum", "avg", "max", "min")
DTYPES = (torch.float32, torch.float64, torch.int32, torch.int64)
TORCH_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
             "min": dist.ReduceOp.MIN}


# ------------------------------------------------------------------ without ranks
def test_spec_round_trip_links_and_nodes():
    t = Topology.parse("2x3:inter=1e-4,2e8")
    assert (t.nodes, t.ranks_per_node, t.size) == (2, 3, 6)
    assert t.inter == Link(1e-4, 2e8) and t.inter.beta == pytest.approx(5e-9)
    assert not t.intra.shaped and t.intra.beta == 0.0
    assert Topology.parse(t.spec()) == t
    assert [t.node(r) for r in range(6)] == [0, 0, 0, 1, 1, 1]
    assert t.link(0, 2) == "intra" and t.link(2, 3) == "inter"
    assert Topology.parse("1x4:intra=0,inf:inter=0.5,1e6").inter.seconds(1000) == 0.5 + 1e-3


@pytest.mark.parametrize("spec, message", [
    ("2y2", "is not NODESxRANKS_PER_NODE"), ("0x2", "nodes must be an int >= 1"),
    ("2x2:wan=1,2", "link class must be 'inter' or 'intra'"), ("2x2:inter=1", "inter=1"),
    ("2x2:inter=1,0", "bandwidth must be > 0"), ("2x2:inter=-1,5", "alpha must be")])
def test_bad_specs_name_the_problem_and_the_form(spec, message):
    with pytest.raises(ValueError, match=message):
        Topology.parse(spec)


def test_use_installs_exports_and_restores(monkeypatch):
    monkeypatch.delenv(topology.ENV, raising=False)
    topology.uninstall()
    with topology.use("2x2:inter=1e-3,1e8") as t:
        assert topology.current() == t and topology.state.maybe
        assert topology.link(1, 2) == "inter"
        import os
        assert Topology.parse(os.environ[topology.ENV]) == t
        with topology.use(None):
            assert topology.current() is None
        assert topology.current() == t
    assert topology.current() is None and not topology.state.maybe
    with pytest.raises(RuntimeError, match="no topology is installed"):
        topology.link(0, 1)


def test_cost_model_per_link_class():
    lc = tuner_topology.link_coefficients
    assert lc("all_reduce", "hierarchical", 2, 4) == {"intra": (6.0, 1.5), "inter": (2.0, 0.25)}
    assert lc("reduce_scatter", "hierarchical", 4, 2) == {"intra": (1.0, 0.5), "inter": (3.0, 0.375)}
    assert lc("all_reduce", "ring", 2, 2) == {"intra": (0.0, 0.0), "inter": (6.0, 1.5)}
    assert lc("all_gather", "ring", 1, 4) == {"intra": (3.0, 0.75), "inter": (0.0, 0.0)}
    table = tuner.load_table()
    with topology.use("2x2:inter=1e-4,1e8:intra=6.25e-6,1.6e9"):   # beta ratio 16
        big = 4 << 20
        hier = tuner_topology.predict(table, "all_reduce", "hierarchical", 4, 2, 2, big)
        ring = tuner_topology.predict(table, "all_reduce", "ring", 4, 2, 2, big)
        # emulated: 0.5 n beta + n beta / 16 against 1.5 n beta (22 ms, 63 ms); plus loopback's
        assert hier < 0.6 * ring, (hier, ring)


# ------------------------------------------------------------------ one launch, many checks
def _cases():
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    shapes = st.one_of(st.just(()), st.lists(st.integers(0, 5), min_size=1, max_size=3))
    strategy = st.fixed_dictionaries({
        "op": st.sampled_from(OPS), "red": st.sampled_from(REDS), "dtype": st.sampled_from(DTYPES),
        "shape": shapes, "flat": st.booleans(), "seed": st.integers(0, 10 ** 6)})
    cases: list = []

    @settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(strategy)
    def draw(case):
        cases.append(case)

    draw()
    return cases


def _make(case, rank, salt=0):
    g = torch.Generator().manual_seed(case["seed"] * 7 + rank * 101 + salt)
    if case["dtype"].is_floating_point:
        return torch.randn(case["shape"], generator=g, dtype=torch.float64).to(case["dtype"])
    return torch.randint(-50, 50, case["shape"], generator=g).to(case["dtype"])


def _torch_result(case, rank, world):
    x, red = _make(case, rank), case["red"]
    if case["op"] == "all_reduce":
        dist.all_reduce(x, op=TORCH_OPS[red])
        return x / world if red == "avg" else x
    if case["op"] == "all_gather":
        outs = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(outs, x)
        return torch.stack(outs)
    pieces = [_make(case, rank, salt=1 + j) for j in range(world)]
    out = torch.empty_like(pieces[0])
    dist.reduce_scatter(out, pieces, op=TORCH_OPS[red])
    return out / world if red == "avg" else out


def _mine(case, rank, world):
    x, red = _make(case, rank), case["red"]
    if case["op"] == "all_reduce":
        return C.all_reduce(x, op=red, algorithm="hierarchical")
    if case["op"] == "all_gather":
        if case["flat"]:
            out = torch.empty((world, *x.shape), dtype=x.dtype)
            return C.all_gather(out, x, algorithm="hierarchical")
        outs = [torch.empty_like(x) for _ in range(world)]
        return torch.stack(C.all_gather(outs, x, algorithm="hierarchical"))
    pieces = [_make(case, rank, salt=1 + j) for j in range(world)]
    inp = torch.stack(pieces) if case["flat"] else pieces
    return C.reduce_scatter(torch.empty_like(pieces[0]), inp, op=red, algorithm="hierarchical")


def _differential(rank, world, cases, found, digests):
    for case in cases:
        name = {**case, "dtype": str(case["dtype"])}
        int_avg = (case["red"] == "avg" and not case["dtype"].is_floating_point
                   and case["op"] != "all_gather")
        if int_avg:                               # minidist must refuse, naming op and rank
            try:
                _mine(case, rank, world)
                found.append((name, "no error for avg of integers"))
            except TypeError as e:
                if case["op"] not in str(e) or f"rank {rank}" not in str(e):
                    found.append((name, f"error without op and rank: {e}"))
            continue
        theirs = _torch_result(case, rank, world)
        mine = _mine(case, rank, world)
        try:
            torch.testing.assert_close(mine, theirs, rtol=None if mine.is_floating_point() else 0,
                                       atol=None if mine.is_floating_point() else 0)
        except AssertionError as e:
            found.append((name, str(e)[:300]))
        if case["op"] == "all_reduce":
            digests.append(hashlib.sha1(mine.numpy().tobytes()).hexdigest())


def _link_bytes(alg, op, n):
    """(inter, intra) bytes this rank sent in ``op`` of n float32 elements by ``alg``."""
    with p2p.count_traffic() as t:
        if op == "all_reduce":
            C.all_reduce(torch.ones(n), algorithm=alg)
        elif op == "reduce_scatter":
            C.reduce_scatter(torch.empty(n // 4), torch.ones(n), algorithm=alg)
        else:
            C.all_gather(torch.empty(n), torch.ones(n // 4), algorithm=alg)
    return t.bytes_sent_inter, t.bytes_sent_intra


def _expected_bytes(alg, op, n, rank, M=2, L=2, b=4):
    """The formulas (float32, n divisible by W = M·L, 2x2 by default)."""
    W = M * L
    if alg == "ring":    # every step over this rank's link to the right
        total = {"all_reduce": 2 * (W - 1) * n // W, "reduce_scatter": (W - 1) * n // W,
                 "all_gather": (W - 1) * n // W}[op] * b
        inter = (rank // L) != ((rank + 1) % W // L)
        return (total, 0) if inter else (0, total)
    if op == "all_reduce":
        return 2 * (M - 1) * (n // L) // M * b, 2 * (L - 1) * n // L * b
    return (M - 1) * n // W * b, (L - 1) * M * n // W * b   # one piece per node; M per super


def _errors(rank, world):
    """Every bad input: a ValueError on every rank naming rank, op and what was expected."""
    got = []
    topology.uninstall()
    try:
        C.all_reduce(torch.ones(3), algorithm="hierarchical")
    except ValueError as e:
        got.append("all_reduce (rank" in str(e) and "needs a two-level topology" in str(e))
    try:
        C.all_gather(torch.empty(0), torch.empty(0), algorithm="hierarchical")   # empty too
    except ValueError as e:
        got.append(f"all_gather (rank {rank})" in str(e))
    topology.install("2x2")
    plain = dist.new_group([0, 1])                # every rank calls new_group
    if rank < 2:
        try:
            C.reduce_scatter(torch.empty(1), torch.ones(2), algorithm="hierarchical", group=plain)
        except ValueError as e:
            got.append("reduce_scatter (rank" in str(e) and "hierarchical.new_group" in str(e))
    else:
        got.append(True)
    try:
        hierarchical.new_group([0, 1, 2])         # 2 ranks on node 0, 1 on node 1
    except ValueError as e:
        got.append("same number of the group's ranks on every node" in str(e)
                   and f"rank {rank}" in str(e))
    probe = torch.ones(2)                          # nothing was left half sent
    C.all_reduce(probe, algorithm="hierarchical")
    got.append(probe.tolist() == [4.0, 4.0])
    return got


def _groups(rank, world):
    """Groups from hierarchical.new_group, against torch's on the same group; the world's
    sub-groups are made once (no new_group at later calls)."""
    topology.install("2x2")
    whole = hierarchical.new_group(range(4))      # not the world object: its own sub-groups
    pair = [hierarchical.new_group([0, 2]), hierarchical.new_group([1, 3])][rank % 2]
    out = []
    for g in (whole, pair):
        x = torch.arange(7.0) * (rank + 1)
        ref = x.clone()
        dist.all_reduce(ref, group=g)
        out.append(torch.equal(C.all_reduce(x, algorithm="hierarchical", group=g), ref))
    made = []
    real = dist.new_group
    dist.new_group = lambda *a, **k: made.append(a) or real(*a, **k)
    try:
        for _ in range(3):
            C.all_reduce(torch.ones(5), algorithm="hierarchical")
            C.all_reduce(torch.ones(5), algorithm="hierarchical", group=whole)
    finally:
        dist.new_group = real
    out.append(made == [])
    return out


def _auto(rank, world):
    """With a slow inter link, auto runs hierarchical on a large buffer (the counters name it);
    without a topology it is no candidate."""
    topology.install("2x2:inter=1e-4,1e7")   # 256 KiB: the inter link's part 13 ms, ring's 39 ms
    p2p.reset_traffic()
    C.all_reduce(torch.ones(1 << 16), algorithm="auto")
    chosen = set(p2p.traffic())
    topology.uninstall()
    p2p.reset_traffic()
    C.all_reduce(torch.ones(1 << 16), algorithm="auto")
    return chosen, set(p2p.traffic())


def _many(rank, world, cases):
    found: list = []
    digests: dict = {}
    for spec in LAYOUTS:
        topology.install(spec)
        digests[spec] = []
        _differential(rank, world, cases, found, digests[spec])
    topology.install("2x2")
    n = 4000
    traffic = {(alg, op): _link_bytes(alg, op, n) for alg in ("ring", "hierarchical") for op in OPS}
    expected = {(alg, op): _expected_bytes(alg, op, n, rank) for alg, op in traffic}
    return dict(found=found, digests=digests, traffic=traffic, expected=expected,
                errors=_errors(rank, world), groups=_groups(rank, world), auto=_auto(rank, world))


@pytest.mark.timeout(120)
def test_hierarchical_collectives_in_one_launch():
    pytest.importorskip("hypothesis")
    cases = _cases()
    with topology.use(None):
        res = minidist.run(_many, 4, cases, timeout=100)
    for rank, r in enumerate(res):
        assert r["found"] == [], (rank, r["found"][:5])
        assert r["digests"] == res[0]["digests"], "all_reduce not bit-identical across ranks"
        assert r["traffic"] == r["expected"], (rank, r["traffic"], r["expected"])
        assert r["errors"] == [True] * 5, (rank, r["errors"])
        assert r["groups"] == [True] * 3, (rank, r["groups"])
        assert r["auto"][0] == {"all_reduce/hierarchical"}, r["auto"]
        assert len(r["auto"][1]) == 1 and "all_reduce/hierarchical" not in r["auto"][1], r["auto"]
    # summed over the ranks: the flat ring's two node-crossing links carry 2(W-1) chunks of n/W
    # each; the hierarchical all-reduce sends 2(M-1)/M · n/L from every rank (n = 4000 float32)
    inter = {alg: sum(r["traffic"][(alg, "all_reduce")][0] for r in res) for alg in ("ring", "hierarchical")}
    assert inter == {"ring": 2 * (2 * 3 * 1000 * 4), "hierarchical": 4 * (2 * 1 // 2 * 2000 * 4)}
    assert max(r["traffic"][("hierarchical", "all_reduce")][0] for r in res) * 3 == \
        max(r["traffic"][("ring", "all_reduce")][0] for r in res)


# ------------------------------------------------------------------ timing: the shaper
ALPHA, BW, NBYTES = 0.02, 1e7, 100_000       # one inter message: >= 30 ms


def _timed(rank, world):
    out = {}
    topology.install(f"2x2:inter={ALPHA},{BW}")
    x = torch.zeros(NBYTES // 4)
    dist.barrier()
    if rank == 0:                                 # to rank 2: another node; to rank 1: the same
        t0 = time.perf_counter()
        p2p.send(x, 2)
        out["one"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        p2p.wait_all([p2p.isend(x, 2) for _ in range(3)])
        out["three"] = time.perf_counter() - t0
        out["intra"] = []
        for _ in range(3):
            t0 = time.perf_counter()
            p2p.send(x, 1)
            out["intra"].append(time.perf_counter() - t0)
    elif rank == 2:
        for _ in range(4):
            p2p.recv(x, 0)
    elif rank == 1:
        for _ in range(3):
            p2p.recv(x, 0)
    # the crossover: beta_inter / beta_intra = 16 (and alpha likewise), 1 MiB
    topology.install("2x2:inter=1e-3,2.5e7:intra=6.25e-5,4e8")
    times: dict = {"ring": [], "hierarchical": []}
    for _ in range(3):
        for alg in times:
            y = torch.ones(1 << 18)
            dist.barrier()
            t0 = time.perf_counter()
            C.all_reduce(y, algorithm=alg)
            t = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times[alg].append(t.item())
    out["crossover"] = {a: sorted(v)[1] for a, v in times.items()}
    return out


@pytest.mark.timeout(90)
def test_shaper_paces_inter_node_messages_and_hierarchical_wins_at_ratio_16():
    with topology.use(None):
        res = minidist.run(_timed, 4, timeout=80)
    r0 = res[0]
    cost = ALPHA + NBYTES / BW
    assert cost <= r0["one"] < cost + 2.0, r0
    assert 3 * cost <= r0["three"] < 3 * cost + 3.0, r0      # back to back: serialised
    assert min(r0["intra"]) < cost, r0                          # inside a node: not slowed
    cross = r0["crossover"]
    assert cross["hierarchical"] < cross["ring"], cross           # sleeps: 26 ms against 69 ms
    assert cross["ring"] >= 6 * (1e-3 + (1 << 16) * 4 / 2.5e7), cross


def _nothing(rank, world):
    return True


def test_a_topology_that_does_not_describe_the_world_is_refused_on_every_rank():
    with topology.use("2x2"):
        with pytest.raises(minidist.RankError, match=r"describes 2 x 2 = 4 ranks, but the world has 2"):
            minidist.run(_nothing, 2, timeout=30)
