"""`minidist demo`'s TP section: every row correct and in the shape cli.py prints."""

from minidist_course.lessons.tensor_parallel_demo import demo_rows


def test_tp_demo_rows_are_all_correct():
    rows = demo_rows()
    assert {r["world_size"] for r in rows} == {2, 4} and len(rows) == 10
    for r in rows:
        assert set(r) >= {"section", "check", "world_size", "max_error", "ok", "detail"}
        assert r["section"] == "TP" and r["ok"], r
