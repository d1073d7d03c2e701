"""The per-strategy rooflines: at the crossover compute equals communication; the closed forms
where α is 0 (CP: s* = β·F, EP: f* = (ep-1)/ep·β·F, DP: tokens* = all-reduce time·F/(6N)); the
crossover moves right as the link slows; the drawing lists each machine's crossover."""

from __future__ import annotations

import math

import pytest

from minidist_course.planner.calc import comm_time
from minidist_course.planner.roofline import STRATEGIES, Roofline, crossover, times

F, ALPHA, BETA = 5e14, 1e-5, 1 / 50e9


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_compute_equals_communication_at_the_crossover(strategy):
    r = STRATEGIES[strategy]
    x = crossover(r, F, ALPHA, BETA)
    c, m = times(r, x, F, ALPHA, BETA)
    assert c == pytest.approx(m, rel=1e-9)
    slower = crossover(r, F, ALPHA, 10 * BETA)
    assert slower > x                      # a slower link needs a larger size to hide


def test_closed_forms_without_latency():
    assert crossover(STRATEGIES["cp"], F, 0.0, BETA) == pytest.approx(BETA * F, rel=1e-9)
    ep = STRATEGIES["ep"]
    assert crossover(ep, F, 0.0, BETA) == pytest.approx((ep.ways - 1) / ep.ways * BETA * F,
                                                        rel=1e-9)
    dp = STRATEGIES["dp"]
    want = comm_time("all_reduce", 2 * dp.params, dp.ways, 0.0, BETA) * F / (6 * dp.params)
    assert crossover(dp, F, 0.0, BETA) == pytest.approx(want, rel=1e-9)


def test_no_crossover_and_unknown_strategy():
    assert crossover(STRATEGIES["dp"], 1.0, 1.0, 1e6, hi=10.0) == math.inf   # comm wins up to hi
    assert crossover(STRATEGIES["dp"], 1.0, 0.0, 1e-30) == 1.0            # compute wins from lo
    with pytest.raises(ValueError, match="strategy must be one of"):
        times(Roofline("zz", "x"), 1.0, F, ALPHA, BETA)


def test_the_drawing_names_each_crossover():
    import matplotlib
    matplotlib.use("Agg")
    from minidist_course.diagrams import draw_roofline
    fig = draw_roofline("tp", {"fast": (F, 5e-6, 1 / 450e9), "slow": (F, ALPHA, BETA)})
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    x = crossover(STRATEGIES["tp"], F, ALPHA, BETA)
    assert f"slow: communication (crossover {x:,.0f})" in labels and len(labels) == 4
