"""`minidist bench report`: the verdict reads the ratio against the goal only when the run's own
control allows; the whole report runs at its smallest sizes (integration tier: ~20 s of launches)."""

from __future__ import annotations

import pytest

from minidist_course.bench import report as R


def test_the_verdict_reads_the_control_first():
    assert R.verdict(1.05, 1.01) == "✓" and R.verdict(1.40, 1.02) == "✗"
    assert R.verdict(1.15, 1.20) == "noise"     # the control strays further than 1.15 from 1.10
    assert R.verdict(0.90, None) == "—"


def test_compare_pairs_rows_by_dimension():
    before = [{"dimension": "TP, W=2", "ratio": 1.5}, {"dimension": "PP 1f1b (bubble 0.2)", "ratio": 1.1}]
    after = [{"dimension": "TP, W=2", "ratio": 1.2}, {"dimension": "PP 1f1b (bubble 0.3)", "ratio": 1.0}]
    text = R.compare(before, after)
    assert "TP, W=2" in text and "1.50    1.20" in text and "PP 1f1b" in text


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_the_report_runs_every_benchmark_at_its_smallest_size():
    rows = R.run_report(steps=1, quick=True)
    dims = [r["dimension"] for r in rows]
    assert dims[:4] == ["DDP (bucketed), W=2", "ZeRO-3 vs FSDP2, W=2", "TP, W=2", "TP + SP, W=2"]
    assert all(r["control"] is not None for r in rows[:4])   # each has its torch-again row
    assert sum(d.startswith("PP ") for d in dims) == 6
    assert all(r["ratio"] > 0 and r["verdict"] in ("✓", "✗", "noise", "—") for r in rows)
    text = R.format_report(rows)
    assert "load average" in text
    assert "pipeline idle time / the communication-aware simulator's" in text
    assert all("idle_ratio_minidist" in r for r in rows if r["dimension"].startswith("PP "))
