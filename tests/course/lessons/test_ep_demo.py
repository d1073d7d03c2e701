"""`minidist demo`'s expert-parallel section: every row correct and in the shape cli.py prints."""

import pytest

from minidist_course.lessons.expert_parallel_demo import demo_rows


@pytest.mark.timeout(200)
def test_ep_demo_rows_are_all_correct():
    rows = demo_rows()
    assert [r["world_size"] for r in rows] == [2, 2, 4, 4, 4]
    for r in rows:
        assert set(r) >= {"section", "check", "world_size", "max_error", "ok", "detail"}
        assert r["section"] == "EP" and r["ok"], r
