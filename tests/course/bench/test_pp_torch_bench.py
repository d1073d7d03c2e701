"""`minidist bench pp-torch`: every schedule both engines share runs on the same split in one
launch; rows carry both step times, their ratio, the measured bubbles, the simulator's with nominal
costs and the communication-aware prediction both engines are held to (no timing asserts:
performance lives in the report)."""

from __future__ import annotations

import pytest

from minidist.pipeline_parallel.catalog import make_schedule
from minidist.pipeline_parallel.simulator import simulate
from minidist_course.bench.pipeline_torch import TORCH_SCHEDULES, bench_pp_torch, link_fit


def test_every_shared_schedule_runs_beside_torchs(capsys):
    rows = bench_pp_torch(2, 4, steps=1, warmup=0, t_f=0.002, t_b=0.004)
    assert [r["schedule"] for r in rows] == list(TORCH_SCHEDULES)
    for r in rows:
        assert r["minidist_ms"] > 0 and r["torch_ms"] > 0 and r["ratio"] > 0
        sched = make_schedule(r["schedule"], 2, 4, 2)
        assert r["bubble_simulated"] == simulate(sched, 0.002 / sched.v, 0.004 / sched.v).bubble
        # measured op times are at least the sleeps, messages and overhead cost >= 0: the
        # communication-aware makespan cannot be shorter than the nominal one (max-plus is monotone)
        assert r["bubble_simulated"] - 1e-9 <= r["bubble_predicted"] < 1
        assert r["alpha_s"] >= 0 and r["beta_s_per_byte"] >= 0 and r["t_gap_s"] >= 0
        busy = 4 * (0.002 + 0.004)
        predicted = busy / (1 - r["bubble_predicted"])
        for engine in ("minidist", "torch"):
            assert r[f"idle_ratio_{engine}"] == pytest.approx(
                (r[f"{engine}_ms"] / 1e3 - busy) / (predicted - busy))
    assert "minidist bench pp-torch: P=2, M=4" in capsys.readouterr().out


def test_a_ping_pong_too_noisy_to_fit_gives_alpha_alone():
    """CI's integration tier, under load: {256 B: 1.92 ms, 16 KiB: 1.99, 1 MiB: 1.91, 4 MiB: 1.38}
    (the times did not grow with the size): the prediction keeps the fastest time as alpha."""
    ping = {256: 0.001918, 16384: 0.001986, 1048576: 0.001913, 4194304: 0.001377}
    assert link_fit(ping) == (0.001377, float("inf"))
    alpha, bandwidth = link_fit({256: 1e-4, 1 << 20: 1e-4 + (1 << 20) / 1e9})
    assert alpha == pytest.approx(1e-4, rel=0.01) and bandwidth == pytest.approx(1e9, rel=0.01)
