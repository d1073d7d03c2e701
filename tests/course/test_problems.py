"""The worked problems: every answer computed by the course's planner and cost functions, right
by hand where a hand can check it, shown in its chapter, and checked against a learner's number;
the ledger of answers and predictions."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from minidist_course import problems
from minidist_course.problems.core import Problem, register

ROOT = Path(__file__).resolve().parents[2]


def test_every_answer_is_a_finite_number_and_its_check_accepts_it_and_rejects_half(tmp_path,
                                                                                   monkeypatch):
    monkeypatch.setenv("MINIDIST_LEDGER", str(tmp_path / "ledger.json"))
    assert len(problems.REGISTRY) >= 15
    for pid, p in problems.REGISTRY.items():
        a = p.answer()
        assert isinstance(a, (int, float)) and math.isfinite(a) and a > 0, pid
        assert problems.check(pid, a) and not problems.check(pid, a * 1.5), pid
        assert p.worked(a), pid


@pytest.mark.parametrize("pid, want", [
    ("00.1", 14), ("00.2", 8.4e22), ("03.1", 9.1e9), ("03.3", 32e6), ("07.2", 134),
    ("09.1", 17.5e9), ("09.3", 23), ("13.1", 88), ("13.3", 1314.53)])
def test_answers_equal_the_hand_computation(pid, want):
    assert problems.REGISTRY[pid].answer() == pytest.approx(want, rel=1e-5)


def test_every_chapter_with_problems_shows_them():
    for chapter in sorted({p.chapter for p in problems.REGISTRY.values()}):
        (nb,) = ROOT.glob(f"course/{chapter}_*.ipynb")
        cells = json.loads(nb.read_text())["cells"]
        assert any(f'problems.show("{chapter}")' in "".join(c["source"]) for c in cells), nb.name
        text = problems.render(chapter)
        assert text.count("<details>") == sum(p.chapter == chapter
                                              for p in problems.REGISTRY.values())


def test_ids_are_unique_and_unknown_ones_are_named():
    with pytest.raises(ValueError, match="used twice"):
        register(Problem("00.1", "q", lambda: 1.0, "", lambda a: ""))
    with pytest.raises(KeyError, match="no problem '99.9'"):
        problems.check("99.9", 1.0)
    with pytest.raises(KeyError, match="no problem for chapter '99'"):
        problems.render("99")


def test_the_ledger_records_answers_and_predictions(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MINIDIST_LEDGER", str(tmp_path / "sub" / "ledger.json"))
    assert problems.ledger_summary() == "problems: none recorded\npredictions: none recorded"
    problems.check("00.1", 28)                      # off by 2
    problems.predict("03.busbw", 1.0)
    assert problems.compare("03.busbw", 0.5) == 2.0
    assert problems.compare("never.predicted", 3.0) is None
    out = capsys.readouterr().out
    assert "✗ problem 00.1: yours 28, answer 14 GPUs (yours/answer = 2)" in out
    assert "predicted 1, measured 0.5" in out and "no prediction recorded" in out
    assert problems.ledger_summary() == ("problems: 1, median factor off 2, worst 2\n"
                                         "predictions: 1, median factor off 2, worst 2")


def test_a_measurement_without_a_prediction_leaves_no_ledger(tmp_path, monkeypatch):
    """Running a chapter (as the tests do) with no guess entered writes nothing to the home."""
    ledger = tmp_path / "ledger.json"
    monkeypatch.setenv("MINIDIST_LEDGER", str(ledger))
    assert problems.compare("07.bubble", 0.3, None) is None and not ledger.exists()
    assert problems.compare("07.bubble", 0.3, 0.27) == pytest.approx(0.9)
    assert json.loads(ledger.read_text())["07.bubble"] == {"kind": "prediction",
                                                            "prediction": 0.27, "truth": 0.3}
