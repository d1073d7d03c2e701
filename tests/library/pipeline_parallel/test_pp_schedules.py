"""Schedules as data and the pure-Python simulator (no processes: fast)."""

import pytest

from minidist.pipeline_parallel import (Op, PipelineDeadlock, Schedule, ScheduleError, bubble_formula,
                                        message_order_mismatches,
                                        gpipe, interleaved_one_f_one_b, make_schedule, one_f_one_b,
                                        simulate, validate)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("P,M,expected", [(8, 32, 0.1795), (4, 8, 0.2727), (1, 4, 0.0), (4, 1, 0.75)])
def test_bubble_equal_costs_matches_formula(name, P, M, expected):
    for t_f, t_b in [(1.0, 1.0), (1.0, 2.0)]:
        r = simulate(make_schedule(name, P, M), t_f, t_b)
        assert r.bubble == pytest.approx(expected, abs=5e-5)
        assert r.bubble == pytest.approx((P - 1) / (M + P - 1), rel=1e-12)
        assert r.makespan == pytest.approx((M + P - 1) * (t_f + t_b))


@pytest.mark.parametrize("P,M,v", [(4, 8, 2), (8, 32, 2), (2, 4, 3), (4, 4, 4)])
def test_interleaved_bubble_is_smaller(P, M, v):
    inter = simulate(interleaved_one_f_one_b(P, M, v), 1.0, 2.0).bubble
    plain = simulate(one_f_one_b(P, M), 1.0, 2.0).bubble
    assert inter < plain
    assert inter == pytest.approx(bubble_formula(P, M, v), rel=1e-12)


@pytest.mark.parametrize("P,M", [(1, 1), (2, 3), (4, 3), (4, 8), (8, 32), (4, 1)])
def test_peak_activations(P, M):
    g = simulate(gpipe(P, M)).peak_inflight
    f = simulate(one_f_one_b(P, M)).peak_inflight
    assert g == {s: M for s in range(P)}
    assert f == {s: min(P - s, M) for s in range(P)}


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved"])
@pytest.mark.parametrize("P", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("M", [1, 2, 3, 4, 8, 16])
def test_every_schedule_finishes(name, P, M):
    if name == "interleaved" and M % P:
        with pytest.raises(ScheduleError, match="multiple of the pipeline size"):
            make_schedule(name, P, M)
        return
    s = make_schedule(name, P, M, v=2)
    r = simulate(s, 1.0, 2.0, t_comm=0.1)  # no PipelineDeadlock
    assert len(r.events) == 2 * M * s.n_stages
    assert 0.0 <= r.bubble < 1.0


def test_schedule_rows_are_data():
    s = one_f_one_b(2, 3)
    assert s[0] == [Op("F", 0, 0), Op("F", 1, 0), Op("B", 0, 0), Op("F", 2, 0), Op("B", 1, 0),
                    Op("B", 2, 0)]
    assert s[1] == [Op("F", 0, 1), Op("B", 0, 1), Op("F", 1, 1), Op("B", 1, 1), Op("F", 2, 1),
                    Op("B", 2, 1)]


def test_validate_rejects_bad_lists():
    good = one_f_one_b(2, 2)
    with pytest.raises(ScheduleError, match="rank 0: missing ops"):
        validate(Schedule("x", 2, 2, 1, (good.ops[0][:-1], good.ops[1])))
    with pytest.raises(ScheduleError, match="before its forward"):
        validate(Schedule("x", 2, 2, 1, ((Op("B", 0, 0),) + good.ops[0][1:], good.ops[1])))
    with pytest.raises(ScheduleError, match="holds stages"):
        validate(Schedule("x", 2, 2, 1, (good.ops[1], good.ops[0])))
    with pytest.raises(ScheduleError, match="M must be an int >= 1"):
        gpipe(2, 0)


def test_simulator_detects_deadlock_and_names_stages():
    # rank 0 runs B0 before F1; rank 1 needs F1 before B0 -> circular wait
    bad = Schedule("wrong", 2, 2, 1, (
        (Op("F", 0, 0), Op("B", 0, 0), Op("F", 1, 0), Op("B", 1, 0)),
        (Op("F", 0, 1), Op("F", 1, 1), Op("B", 0, 1), Op("B", 1, 1))))
    validate(bad)  # each row on its own is fine
    with pytest.raises(PipelineDeadlock) as info:
        simulate(bad)
    msg = str(info.value)
    assert "rank 0 (stage 0) is stuck at B0@s0, waiting for B0@s1 from stage 1 on rank 1" in msg
    assert "rank 1 (stage 1) is stuck at F1@s1, waiting for F1@s0 from stage 0 on rank 0" in msg


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved"])
@pytest.mark.parametrize("P,M", [(2, 4), (3, 6), (4, 8), (8, 16), (4, 3)])
def test_builtin_schedules_keep_message_order_per_pair(name, P, M):
    if name == "interleaved" and M % P:
        return
    assert message_order_mismatches(make_schedule(name, P, M, v=2)) == []


def test_message_order_mismatch_is_reported():
    # legal and deadlock-free (gloo matches by tag), but rank 0 sends mb 1 before mb 0
    s = validate(Schedule("swapped", 2, 2, 1, (
        (Op("F", 1, 0), Op("F", 0, 0), Op("B", 0, 0), Op("B", 1, 0)),
        (Op("F", 0, 1), Op("B", 0, 1), Op("F", 1, 1), Op("B", 1, 1)))))
    simulate(s)
    assert message_order_mismatches(s) == [
        (0, 1, [("act", 1, 0), ("act", 0, 0)], [("act", 0, 0), ("act", 1, 0)])]


def test_message_costs_per_link_class():
    """``t_comm`` as a number or per link: alpha + bytes·beta of the class a message crosses."""
    from minidist.comm.topology import Link, Topology
    from minidist.pipeline_parallel.simulator import link_costs
    sched = make_schedule("1f1b", 4, 8)
    same = Topology(1, 4, intra=Link(0.01, 1e6))
    assert link_costs(same, 1000)(0, 1) == pytest.approx(0.011)
    # one link class: the per-link callable is the number
    assert simulate(sched, 1.0, 2.0, link_costs(same, 1000)).makespan == \
        pytest.approx(simulate(sched, 1.0, 2.0, 0.011).makespan)
    # two nodes of two ranks: only the message between ranks 1 and 2 crosses the slow link
    two = Topology(2, 2, intra=Link(0.01, 1e6), inter=Link(0.5, 1e6))
    assert link_costs(two, 1000)(1, 2) == pytest.approx(0.501)
    slow = simulate(sched, 1.0, 2.0, link_costs(two, 1000))
    assert simulate(sched, 1.0, 2.0, 0.011).makespan < slow.makespan < \
        simulate(sched, 1.0, 2.0, 0.501).makespan
    # forward chain: rank 2's first forward waits one intra and one inter message (plus rank 0's, 1's F)
    first = min(e.start for e in slow.events if e.rank == 2 and e.kind == "F")
    assert first == pytest.approx(2 * 1.0 / 1 + 0.011 + 0.501)
