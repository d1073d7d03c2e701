"""`minidist bench tp`: every variant is checked against one process before it is timed, the
collectives each calls per step are counted (no timing asserts: performance lives in the report)."""

from __future__ import annotations

import pytest

from minidist_course.bench import tensor_parallel as T


def test_rows_counts_and_the_check_that_gates_the_timing(capsys):
    rows = T.bench_tp(2, steps=1, warmup=0, batch=2, seq=8, hidden=32, heads=4)
    by = {r["variant"]: r for r in rows}
    assert set(by) == set(T.VARIANTS)
    # Megatron's count per block: 2 all-reduces forward (attention, MLP) and 2 backward
    assert by["minidist"]["collectives"] == {"all_reduce": 4} == by["torch"]["collectives"]
    # with sequence parallelism each becomes an all-gather and a reduce-scatter
    assert by["minidist+sp"]["collectives"] == {"all_gather": 4, "reduce_scatter": 4}
    assert all(r["step_ms"] > 0 and r["ratio"] > 0 for r in rows)
    assert "every variant equal to one process" in capsys.readouterr().out


def test_a_wrong_variant_is_refused_before_timing(monkeypatch):
    """ColumnParallelLinear without f (its input's gradient not summed over the TP group) trains
    on silently with wrong LayerNorm gradients; the bench refuses to time it."""
    from minidist.tensor_parallel import regions
    monkeypatch.setattr(regions, "copy_to_tensor_model_parallel_region", lambda x, group=None: x)
    with pytest.raises(Exception, match=r"minidist: ln1\.\w+ off by"):
        T.bench_tp(2, steps=1, warmup=0, batch=2, seq=8, hidden=32, heads=4,
                   variants=("minidist", "torch"), quiet=True)
