"""`minidist bench`'s point-to-point ceiling: its byte counts and its column (no timing asserts)."""

import math

import pytest

from minidist_course import bench
from minidist_course.bench.collectives import ceiling_elements


@pytest.mark.parametrize("op,numel,w,want", [
    ("all_reduce", 1200, 2, 1200),        # 2(W-1)/W · N = N at W=2
    ("all_reduce", 1200, 4, 1800),        # 2·3/4 · 1200
    ("all_reduce", 1200, 3, 1600),        # 2·2/3 · 1200
    ("reduce_scatter", 1200, 4, 900),     # (W-1)/W · N
    ("all_gather", 1200, 4, 900),
    ("all_gather", 1200, 2, 600),
    ("broadcast", 1200, 4, 1200),         # a pipelined chain forwards N once
    ("all_reduce", 10, 4, 16),            # pieces [3,3,2,2]: a rank skips a 2-piece: 2·(10-2)
    ("reduce_scatter", 3, 4, 3),          # pieces [1,1,1,0]: the rank owning the empty piece sends 3
    ("all_reduce", 0, 4, 0),              # empty tensor: nothing moves
    ("all_reduce", 1200, 1, 0),           # one rank: nothing moves
    ("broadcast", 1200, 1, 0),
])
def test_ceiling_moves_what_the_ring_moves_per_rank(op, numel, w, want):
    assert ceiling_elements(op, numel, w) == want


def test_ceiling_matches_the_busbw_factor_when_w_divides_n():
    for op in ("all_reduce", "reduce_scatter", "all_gather", "broadcast"):
        for w in (2, 3, 4, 8):
            n = 1 << 20 if w != 3 else 3 << 18
            assert ceiling_elements(op, n, w) == bench.busbw_factor(op, w) * n


def test_ceiling_rejects_bad_input():
    with pytest.raises(ValueError, match="unknown op 'reduce'"):
        ceiling_elements("reduce", 8, 2)
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        ceiling_elements("all_reduce", 8, 0)


def _row(alg, time_s, ceiling_s):
    return dict(op="all_reduce", algorithm=alg, world_size=2, bytes=4 << 20, time_s=time_s,
                algbw_GBps=1.0, busbw_GBps=1.0, ratio_to_torch=0.02 / time_s, max_error=0.0,
                wrong=False, ceiling_s=ceiling_s, of_ceiling=ceiling_s / time_s)


def test_table_prints_the_fraction_of_the_ceiling_beside_the_ratio_to_torch():
    table = bench.format_table([_row("torch", 0.020, 0.016), _row("ring", 0.025, 0.016)])
    head, _, torch_line, ring_line = table.splitlines()[:4]
    assert head.index("vs torch") < head.index("of p2p")
    assert torch_line.split()[-2:] == ["0.80", "0"] and ring_line.split()[-2:] == ["0.64", "0"]
    assert "1.00x" in torch_line and "0.80x" in ring_line
    assert "the ceiling = one isend to the right and one irecv from the left" in table


def test_run_bench_times_the_ceiling_in_the_same_run():
    rows = bench.run_bench(ops=("all_reduce", "all_gather"),
                           algorithms=("torch", "torch-again", "ring"),
                           world_sizes=(2,), sizes=(4096,), iters=1, warmup=0, timeout=240,
                           progress=False)
    assert sorted((r["op"], r["algorithm"]) for r in rows) == [
        ("all_gather", "ring"), ("all_gather", "torch"), ("all_gather", "torch-again"),
        ("all_reduce", "ring"), ("all_reduce", "torch"),
        ("all_reduce", "torch-again")]  # the ceiling is a column, not a row
    for r in rows:
        assert r["ceiling_s"] > 0 and not r["wrong"]
        assert math.isclose(r["of_ceiling"], r["ceiling_s"] / r["time_s"])


def test_ring_breakdown_times_every_part_and_checks_the_ring():
    from minidist_course.bench.ring_breakdown import PARTS, ring_breakdown
    res = ring_breakdown(3, 3 * 4096, iters=1, warmup=0, timeout=240)  # W=3: steps of uneven order
    assert list(res) == list(PARTS)
    for part in res.values():
        assert 0 < part["min_s"] <= part["median_s"] <= part["max_s"]
    with pytest.raises(ValueError, match="world_size must be >= 2"):
        ring_breakdown(1, 4096)


def test_calls_per_sample_reach_the_sample_time_within_bounds():
    from minidist_course.bench.collectives import MAX_BACK_TO_BACK, SAMPLE_S, _calls_per_sample
    assert _calls_per_sample(1.0) == 1                       # a long call: timed alone
    assert _calls_per_sample(SAMPLE_S) == 2                  # ... at the threshold, two
    assert _calls_per_sample(SAMPLE_S / 10) * SAMPLE_S / 10 >= SAMPLE_S
    assert _calls_per_sample(1e-7) == _calls_per_sample(0.0) == MAX_BACK_TO_BACK
    rows = [dict(_row("torch", 0.02, 0.016), calls_per_sample=3),
            dict(_row("ring", 0.025, 0.016), calls_per_sample=3)]
    assert "k calls back to back (k = 3..3 by size" in bench.format_table(rows)


def test_back_to_back_calls_are_timed_and_the_result_still_checked():
    rows = bench.run_bench(ops=("all_reduce",), algorithms=("torch", "recursive_doubling"),
                           world_sizes=(2,), sizes=(1024,), iters=2, warmup=1, timeout=120,
                           progress=False)
    ks = {r["calls_per_sample"] for r in rows}      # one k for every algorithm of the size
    assert len(ks) == 1 and 1 <= ks.pop() <= 32
    assert all(r["max_error"] == 0 and not r["wrong"] for r in rows)


def test_a_sizes_iterations_are_spread_over_rounds_and_each_counted_once():
    from minidist_course.bench import collectives as bc
    calls = []
    prep = lambda: None  # noqa: E731
    fake = {s: (prep, lambda s=s: calls.append(s), lambda: 0.0) for s in (1, 2)}
    orig = bc._one_op, bc._measure, bc.dist
    bc._one_op = lambda op, a, nbytes, rank, world: fake[nbytes]  # noqa: E731
    bc._measure = lambda p, c, k: (c(), 1e-3)[1]  # noqa: E731

    class _Dist:   # one rank: the agreements are no-ops
        ReduceOp = bc.dist.ReduceOp
        all_reduce = staticmethod(lambda t, op=None: None)
    bc.dist = _Dist
    try:
        rows = bc._bench_rank(0, 1, [("all_reduce", "ring", 1), ("all_reduce", "ring", 2)],
                              iters=5, warmup=1, rounds=4)
    finally:
        bc._one_op, bc._measure, bc.dist = orig
    # warm-up of each size, then 4 passes through both sizes (2, 1, 1, 1 iterations), then the check
    assert calls == [1, 2] + [1, 1, 2, 2] + [1, 2] * 3 + [1, 2]
    assert [r["rounds"] for r in rows] == [4, 4]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7])
def test_the_order_is_balanced_for_position_and_predecessor(n):
    from minidist_course.bench.collectives import balanced_order
    names = [f"a{k}" for k in range(n)]
    cycle = n if n % 2 == 0 else 2 * n
    rows = [balanced_order(names, i) for i in range(cycle)]
    assert all(sorted(r) == names for r in rows)           # every row runs every algorithm once
    for pos in range(n):                                   # each in every position equally often
        assert sorted(r[pos] for r in rows) == sorted(names * (cycle // n))
    pairs = [(r[k], r[k + 1]) for r in rows for k in range(n - 1)]
    want = {(a, b) for a in names for b in names if a != b}
    assert set(pairs) == want and len(pairs) == len(want) * (cycle // n)   # after each equally
    assert balanced_order(names, cycle) == rows[0] and balanced_order([], 3) == []


def test_a_plain_rotation_would_keep_who_follows_whom():   # why the design, not a rotation
    names = ["torch", "torch-again", "p2p", "ring"]
    rows = [names[i:] + names[:i] for i in range(4)]
    pairs = [(r[k], r[k + 1]) for r in rows for k in range(3)]
    assert pairs.count(("torch", "torch-again")) == 3 and ("torch-again", "torch") not in pairs


def test_bench_rank_follows_the_design_across_rounds_per_size():
    from minidist_course.bench import collectives as bc
    calls = []
    fake = {a: ((lambda: None), (lambda a=a: calls.append(a)), lambda: 0.0) for a in "abc"}
    orig = bc._one_op, bc._measure, bc.dist
    bc._one_op = lambda op, a, nbytes, rank, world: fake[a]  # noqa: E731
    bc._measure = lambda p, c, k: (c(), 1e-3)[1]  # noqa: E731

    class _Dist:
        ReduceOp = bc.dist.ReduceOp
        all_reduce = staticmethod(lambda t, op=None: None)
    bc.dist = _Dist
    try:
        bc._bench_rank(0, 1, [("all_reduce", a, 1) for a in "abc"], iters=3, warmup=0, rounds=2)
    finally:
        bc._one_op, bc._measure, bc.dist = orig
    # warm-up a b c; 3 iterations over 2 rounds (2 + 1), rows 0, 1, 2 of the design; the checks
    assert calls == list("abc") + list("abc") + list("bca") + list("cab") + list("abc")


def test_the_control_is_torch_and_the_footer_states_its_spread_as_the_noise(monkeypatch):
    from minidist_course.bench import collectives as bc
    from minidist_course.bench.collectives import CONTROL, _one_op
    assert CONTROL in bench.ALGORITHMS["all_reduce"] and CONTROL in bench.ALGORITHMS["broadcast"]
    rows = [_row("torch", 0.020, 0.016), dict(_row(CONTROL, 0.025, 0.016)),
            dict(_row(CONTROL, 0.016, 0.016), bytes=1 << 20), _row("ring", 0.025, 0.016),
            dict(_row(CONTROL, 0.02, 0.016), world_size=4)]
    assert bench.noise_floor(rows) == {("all_reduce", 2): (pytest.approx(0.8), 1.25),
                                       ("all_reduce", 4): (1.0, 1.0)}
    table = bench.format_table(rows)
    assert "its 'vs torch' over the sizes is this run's noise (all_reduce W=2: 0.80-1.25x, " \
           "all_reduce W=4: 1.00-1.00x)" in table
    assert "torch-again" not in bench.format_table(rows[:1] + rows[3:4])   # no control, no line
    assert bench.noise_floor([dict(_row(CONTROL, 0.02, 0.016), ratio_to_torch=float("nan"))]) == {}
    called = []                                  # it calls torch's own collective, not minidist's
    monkeypatch.setattr(bc, "dist", type("D", (), {"all_reduce": staticmethod(called.append)}))
    monkeypatch.setattr(bc.C, "all_reduce", lambda *a, **k: pytest.fail("minidist's all_reduce ran"))
    _one_op("all_reduce", CONTROL, 64, 0, 1)[1]()
    assert len(called) == 1 and called[0].numel() == 16
