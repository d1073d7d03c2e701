"""Per-rank timelines exported as Chrome trace-event JSON (minidist.chrome_trace), read back from
the JSON file and checked event by event against the Timeline they came from: a pipeline
simulator's ops, bucketed DDP's two lanes on 2 ranks, and a 3-D step on 4 ranks.

The format's rules checked independently of the exporter: every event has ph/pid/tid/ts, an "X"
has a non-negative dur, ``pid`` is the rank, every (pid, tid) is named by a thread_name metadata
event, and the complete events of one thread nest (a viewer draws a thread as a stack).
"""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
import torch

import minidist
from minidist.chrome_trace import read_chrome_trace, to_chrome_trace, write_chrome_trace
from minidist.pipeline_parallel.schedules import one_f_one_b
from minidist.pipeline_parallel.simulator import simulate
from minidist.trace import Event, Timeline, align


def _check_format(trace: dict) -> dict[tuple[int, int], str]:
    """The rules every trace must follow; returns the thread names."""
    assert trace["displayTimeUnit"] == "ms"
    names, procs = {}, {}
    for t in trace["traceEvents"]:
        assert {"ph", "pid", "tid", "name"} <= t.keys(), t
        if t["ph"] == "M" and t["name"] == "thread_name":
            names[t["pid"], t["tid"]] = t["args"]["name"]
        if t["ph"] == "M" and t["name"] == "process_name":
            procs[t["pid"]] = t["args"]["name"]
    slices: dict = {}
    for t in trace["traceEvents"]:
        if t["ph"] in ("X", "i"):
            assert (t["pid"], t["tid"]) in names and procs[t["pid"]] == f"rank {t['pid']}"
            assert t["ts"] >= 0 and math.isfinite(t["ts"])
        if t["ph"] == "X":
            assert t["dur"] > 0
            slices.setdefault((t["pid"], t["tid"]), []).append((t["ts"], t["ts"] + t["dur"]))
    for key, spans in slices.items():     # nesting: a stack of open slices per thread
        stack: list[float] = []
        for a, b in sorted(spans, key=lambda s: (s[0], -s[1])):
            while stack and stack[-1] <= a + 1e-6:        # touching (to rounding) is not crossing
                stack.pop()
            assert not stack or b <= stack[-1] + 1e-6, f"slices cross on {names[key]}: {a, b}"
            stack.append(b)
    return names


def _same(events, back, tol=2e-9):
    """Events read back equal the aligned originals: name, rank, lane, mb, stage, times."""
    want = sorted(align(events), key=lambda e: (e.rank, e.start, -e.end, e.name))
    got = sorted(back, key=lambda e: (e.rank, e.start, -e.end, e.name))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (g.name, g.rank, g.lane, g.mb, g.stage) == (w.name, w.rank, w.lane, w.mb, w.stage)
        assert abs(g.start - w.start) <= tol and abs(g.duration - w.duration) <= tol


def test_pipeline_simulator_events_round_trip(tmp_path):
    sim = simulate(one_f_one_b(4, 8), t_f=1.0, t_b=2.0, t_comm=0.25)
    path = write_chrome_trace(sim.events, tmp_path / "1f1b.json", us_per_unit=1e3)
    trace = json.loads((tmp_path / "1f1b.json").read_text())
    _check_format(trace)
    xs = [t for t in trace["traceEvents"] if t["ph"] == "X"]
    assert len(xs) == len(sim.events) and {t["pid"] for t in xs} == {0, 1, 2, 3}
    assert Counter(t["name"] for t in xs) == Counter(e.name for e in sim.events)
    assert Counter(t["name"] for t in xs)["F"] == 4 * 8
    # an F lasts t_f = 1 unit = 1000 µs, a B 2000 µs
    assert {round(t["dur"], 6) for t in xs if t["name"] == "F"} == {1000.0}
    assert {round(t["dur"], 6) for t in xs if t["name"] == "B"} == {2000.0}
    assert {(t["pid"], t["args"]["mb"]) for t in xs if t["name"] == "F"} == \
        {(r, m) for r in range(4) for m in range(8)}
    _same(sim.events, read_chrome_trace(path))


def test_overlapping_events_of_one_lane_get_an_extra_thread():
    events = [Event("recv", 0.0, 3.0, rank=1), Event("send", 1.0, 4.0, rank=1),   # cross
              Event("F", 0.5, 1.0, rank=1), Event("mark", 2.0, 2.0, rank=1)]       # nested, instant
    trace = to_chrome_trace(events)
    names = _check_format(trace)
    assert sorted(names.values()) == ["main", "main (2)"]
    by_name = {t["name"]: t for t in trace["traceEvents"] if t["ph"] in ("X", "i")}
    assert names[1, by_name["send"]["tid"]] == "main (2)"
    assert names[1, by_name["F"]["tid"]] == "main" and by_name["mark"]["ph"] == "i"
    _same(events, read_chrome_trace(trace))


@pytest.mark.parametrize("bad, match", [
    ([Event("x", 2.0, 1.0, rank=3)], "event 'x' of rank 3 ends before it starts"),
    ([Event("y", 0.0, float("nan"))], "event 'y' of rank 0 has a non-finite time"),
])
def test_bad_events_are_named(bad, match):
    with pytest.raises(ValueError, match=match):
        to_chrome_trace(bad)


def test_bad_unit_and_empty():
    with pytest.raises(ValueError, match="us_per_unit must be a positive number, got 0"):
        to_chrome_trace([Event("x", 0.0, 1.0)], us_per_unit=0)
    assert to_chrome_trace([])["traceEvents"] == []


def _ddp_steps(rank, world):
    from minidist.data_parallel import BucketedDDP
    from minidist.models import MLP
    from minidist_course.lessons.scaling import recorded_step

    torch.manual_seed(0)
    tl = Timeline()
    ddp = BucketedDDP(MLP(64, (128, 128), 10), bucket_cap_mb=0.004)  # 3 buckets
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
    for _ in range(2):
        recorded_step(ddp, opt, x, y, tl)
    n_buckets = len(ddp.buckets)
    ddp.close()
    return tl.events, tl.origin, n_buckets


@pytest.mark.timeout(120)
def test_ddp_lanes_on_two_ranks(tmp_path):
    res = minidist.run(_ddp_steps, 2, timeout=90)
    per_rank, t0s, n_buckets = [r[0] for r in res], [r[1] for r in res], res[0][2]
    assert n_buckets >= 3
    path = write_chrome_trace(per_rank, tmp_path / "ddp.json", t0s=t0s)
    trace = json.loads(open(path).read())
    names = _check_format(trace)
    assert sorted(names.items()) == [((0, 0), "main"), ((0, 1), "comm"), ((1, 0), "main"),
                                     ((1, 1), "comm")]
    for rank in (0, 1):
        mine = [t for t in trace["traceEvents"] if t["pid"] == rank and t["ph"] != "M"]
        ars = [t for t in mine if t["name"].startswith("all-reduce b")]
        assert len(ars) == 2 * n_buckets and {names[rank, t["tid"]] for t in ars} == {"comm"}
        assert sum(t["ph"] == "i" for t in mine) == 2 * n_buckets        # "ready bN" marks
        assert sum(t["name"] == "backward" for t in mine) == 2
        # each duration equals its Timeline event's, in µs
        want = sorted(e.duration * 1e6 for e in per_rank[rank] if e.name.startswith("all-reduce"))
        assert sorted(t["dur"] for t in ars) == pytest.approx(want, abs=1e-3)
    back = read_chrome_trace(path)
    shifted = [[e._replace(start=e.start + t0, end=e.end + t0, rank=r) for e in evs]
               for r, (evs, t0) in enumerate(zip(per_rank, t0s))]
    _same([e for evs in shifted for e in evs], back, tol=1e-8)


@pytest.mark.timeout(200)
def test_a_3d_step_exports_every_rank():
    from minidist_course.lessons.hybrid_timeline import step_timeline

    events = step_timeline(1, 2, 2, timeout=150)
    trace = to_chrome_trace(events)
    _check_format(trace)
    xs = [t for t in trace["traceEvents"] if t["ph"] == "X"]
    assert {t["pid"] for t in xs} == {0, 1, 2, 3}
    assert len(xs) == sum(e.duration > 0 for e in events)
    assert Counter(t["name"] for t in xs) == Counter(e.name for e in events if e.duration > 0)
    for rank in range(4):
        assert sum(t["name"] == "F" and t["pid"] == rank for t in xs) == 4       # 4 micro-batches
        assert any(t["name"].startswith("tp ") and t["pid"] == rank for t in xs)
    _same(events, read_chrome_trace(trace), tol=1e-8)


def test_any_intervals_export_nested_and_complete():
    """Property: random intervals on random ranks and lanes all come back, on threads that nest."""
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies

    interval = st.tuples(st.integers(0, 3), st.sampled_from(["main", "comm"]),
                         st.integers(0, 50), st.integers(0, 20))

    @hypothesis.settings(max_examples=150, deadline=None)
    @hypothesis.given(st.lists(interval, max_size=30))
    def check(items):
        events = [Event(f"e{i}", a / 10, (a + d) / 10, lane, rank)
                  for i, (rank, lane, a, d) in enumerate(items)]
        trace = to_chrome_trace(events)
        _check_format(trace)
        assert sum(t["ph"] in ("X", "i") for t in trace["traceEvents"]) == len(events)
        if events:
            _same(events, read_chrome_trace(trace))

    check()
