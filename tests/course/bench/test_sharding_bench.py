"""``minidist bench zero`` runs every variant and its accounted memory equals ZeRO's formula
(tiny model, 2 steps: a smoke test; timings are not asserted)."""

import torch._dynamo  # noqa: F401

from minidist_course.bench.sharding import VARIANTS, bench_zero


def test_bench_zero_rows_and_memory_equal_formula(capsys):
    rows = bench_zero(2, steps=1, warmup=1, batch=2, dim=8, hidden=16, blocks=2, vocab=12,
                      timeout=300)
    assert [r["variant"] for r in rows] == VARIANTS
    for r in rows:  # every flat buffer here has a size divisible by 2: no padding
        assert r["model_states_bytes"] == r["formula_bytes"], r["variant"]
    assert "fsdp2" in capsys.readouterr().out


def test_demo_section_rows_are_all_correct():
    from minidist_course.lessons.sharding_demo import demo_rows
    rows = demo_rows()
    assert len(rows) == 7 and all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]
