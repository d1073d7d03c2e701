"""The critical path of a pipeline timeline: its parts add up to the span, and it finds the slow
message or the slow op that decided the step."""

import pytest

from minidist.pipeline_parallel import Event, make_schedule, simulate
from minidist_course.bench.pipeline_critical_path import critical_path


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipe-v"])
def test_parts_add_up_to_the_span_of_a_simulated_step(name):
    sched = make_schedule(name, 4, 8, 2)
    sim = simulate(sched, 1.0, 2.0, t_comm=0.25, t_gap=0.05)
    cp = critical_path(sim.events, sched.n_stages)
    assert cp.span == pytest.approx(sim.makespan)
    assert cp.compute + cp.messages + cp.gaps + cp.start == pytest.approx(cp.span)
    assert cp.messages == pytest.approx(0.25 * len(cp.waits))   # every hop pays t_comm exactly
    assert cp.ops[-1] == max(((e.name, e.mb, e.stage, e.rank) for e in sim.events
                              if e.name in "FBW"), key=lambda k: next(
        e.end for e in sim.events if (e.name, e.mb, e.stage, e.rank) == k))


def _shift(events, after, by):
    """Delay every op that starts at or after ``after`` by ``by`` (a slow message at ``after``)."""
    return [e._replace(start=e.start + by, end=e.end + by) if e.start >= after else e for e in events]


def test_a_slow_message_on_the_path_is_found():
    sched = make_schedule("1f1b", 2, 2)
    ev = [Event("F", 0, 1, rank=0, mb=0, stage=0), Event("F", 1, 2, rank=0, mb=1, stage=0),
          Event("F", 4, 5, rank=1, mb=0, stage=1),           # 3 s after its input: the slow message
          Event("B", 5, 7, rank=1, mb=0, stage=1), Event("F", 7, 8, rank=1, mb=1, stage=1),
          Event("B", 8, 10, rank=1, mb=1, stage=1),
          Event("B", 7, 9, rank=0, mb=0, stage=0), Event("B", 10, 12, rank=0, mb=1, stage=0)]
    cp = critical_path(ev, sched.n_stages)
    assert cp.span == 12 and cp.waits == [3, 0]
    assert (cp.compute, cp.messages, cp.gaps, cp.start) == (9, 3, 0, 0)
    assert [k for k, *_ in cp.links] == ["message", "gap", "gap", "gap", "message"]
    assert "messages 3.0 (2 on the path, longest 3.0)" in cp.line(unit=1)


def test_a_late_start_after_a_simulated_step_is_a_gap_on_the_path():
    sched = make_schedule("1f1b", 4, 8)
    sim = simulate(sched, 1.0, 2.0)
    slow = _shift(sim.events, after=10.0, by=0.5)       # everything after t = 10 half a unit late
    cp, base = critical_path(slow, sched.n_stages), critical_path(sim.events, sched.n_stages)
    assert cp.span == pytest.approx(base.span + 0.5)
    assert cp.messages + cp.gaps == pytest.approx(base.messages + base.gaps + 0.5)


def test_a_timeline_without_ops_or_with_a_missing_input_is_refused():
    with pytest.raises(ValueError, match="no F, B or W op"):
        critical_path([Event("recv", 0, 1)], 2)
    with pytest.raises(ValueError, match=r"needs \('F', 0, 0\)"):
        critical_path([Event("F", 0, 1, rank=1, mb=0, stage=1)], 2)
