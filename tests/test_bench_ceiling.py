"""`minidist bench`'s point-to-point ceiling: its byte counts and its column (no timing asserts)."""

import math

import pytest

from minidist import bench
from minidist.bench.collectives import ceiling_elements


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
    rows = bench.run_bench(ops=("all_reduce", "all_gather"), algorithms=("torch", "ring"),
                           world_sizes=(2,), sizes=(4096,), iters=1, warmup=0, timeout=240,
                           progress=False)
    assert sorted((r["op"], r["algorithm"]) for r in rows) == [
        ("all_gather", "ring"), ("all_gather", "torch"), ("all_reduce", "ring"),
        ("all_reduce", "torch")]  # the ceiling is a column, not a row
    for r in rows:
        assert r["ceiling_s"] > 0 and not r["wrong"]
        assert math.isclose(r["of_ceiling"], r["ceiling_s"] / r["time_s"])


def test_ring_breakdown_times_every_part_and_checks_the_ring():
    from minidist.bench.ring_breakdown import PARTS, ring_breakdown
    res = ring_breakdown(3, 3 * 4096, iters=1, warmup=0, timeout=240)  # W=3: steps of uneven order
    assert list(res) == list(PARTS)
    for part in res.values():
        assert 0 < part["min_s"] <= part["median_s"] <= part["max_s"]
    with pytest.raises(ValueError, match="world_size must be >= 2"):
        ring_breakdown(1, 4096)


def test_calls_per_sample_reach_the_sample_time_within_bounds():
    from minidist.bench.collectives import MAX_BACK_TO_BACK, SAMPLE_S, _calls_per_sample
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
    from minidist.bench import collectives as bc
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
