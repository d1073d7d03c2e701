"""Exercises: generated from solutions/ (one source of truth), failing when run unmodified, and the
solutions passing. Parametrised over every solutions/*.ipynb, so new chapters are picked up."""

import json
from pathlib import Path

import pytest

from minidist import exercises

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))
CELL_TIMEOUT = 300  # seconds; grading turns a learner's deadlock into a failed check well before


def _grade_cells(nb):
    return [c for c in nb.cells
            if c.cell_type == "code" and c.metadata.get("nbgrader", {}).get("grade")]


def _execute(path: Path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT, kernel_name="python3",
                                     allow_errors=True, resources={"metadata": {"path": str(ROOT)}})
    client.execute()
    return nb


def _errors(cell):
    return [o for o in cell.get("outputs", []) if o.output_type == "error"]


def test_there_are_solutions():
    assert SOLUTIONS, "no solutions/*.ipynb found"


@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.name)
def test_exercise_is_up_to_date(solution):
    expected = exercises.render(exercises.strip_solutions(json.loads(solution.read_text()),
                                                          str(solution)))
    target = ROOT / "exercises" / solution.name
    assert target.exists(), f"{target} missing: run `python -m minidist.exercises`"
    assert target.read_text() == expected, \
        f"{target.name} is out of date: run `python -m minidist.exercises`"


@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.name)
def test_unmodified_exercise_fails_every_grading_cell(solution):
    nb = _execute(ROOT / "exercises" / solution.name)
    graded = _grade_cells(nb)
    assert graded, f"{solution.name}: no nbgrader grading cells"
    for cell in graded:
        errs = _errors(cell)
        gid = cell.metadata["nbgrader"]["grade_id"]
        assert errs, f"{solution.name}: grading cell {gid} passed on the unmodified exercise"
        # the grader ran and said no (not a NameError or a typo in the grading cell)
        assert errs[0].ename == "AssertionError", (gid, errs[0].ename, errs[0].evalue)


@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.name)
def test_solution_passes_every_grading_cell(solution):
    nb = _execute(solution)
    graded = _grade_cells(nb)
    assert graded, f"{solution.name}: no nbgrader grading cells"
    for i, cell in enumerate(nb.cells):
        errs = _errors(cell)
        assert not errs, (f"{solution.name} cell {i}: {errs[0].ename}: {errs[0].evalue}"
                          if errs else "")
    for cell in graded:
        text = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
        assert "score:" in text and "✗" not in text, text


# --------------------------------------------------------------------------- the generator itself
def _nb(*cells):
    return {"cells": list(cells), "metadata": {}, "nbformat": 4, "nbformat_minor": 5}


def _code(src, **meta):
    return {"cell_type": "code", "source": src, "metadata": meta, "outputs": [{"x": 1}],
            "execution_count": 3}


def test_strip_solutions_code_markdown_hidden():
    nb = _nb(_code("def f(x):\n    y = 1\n    ### BEGIN SOLUTION\n    y = x * 2\n    ### END SOLUTION\n"
                   "    return y", nbgrader={"solution": True}),
             {"cell_type": "markdown", "metadata": {},
              "source": "Why?\n### BEGIN SOLUTION\nBecause.\n### END SOLUTION"},
             _code("assert f(2) == 4\n### BEGIN HIDDEN TESTS\nassert f(3) == 6\n### END HIDDEN TESTS"))
    out = exercises.strip_solutions(nb)
    code, mdc, test = out["cells"]
    assert "".join(code["source"]) == ("def f(x):\n    y = 1\n    # YOUR CODE HERE\n"
                                       "    raise NotImplementedError()\n    return y")
    assert code["outputs"] == [] and code["execution_count"] is None
    assert code["metadata"] == {"nbgrader": {"solution": True}}
    assert "".join(mdc["source"]) == "Why?\nYOUR ANSWER HERE"
    assert "".join(test["source"]) == "assert f(2) == 4"
    assert nb["cells"][0]["outputs"] == [{"x": 1}]  # the input is not modified


@pytest.mark.parametrize("src,match", [
    ("### BEGIN SOLUTION\nx = 1", "without its END"),
    ("x = 1\n### END SOLUTION", "unbalanced"),
    ("x = 1", "no '### BEGIN SOLUTION'"),
])
def test_bad_markers_are_errors(src, match):
    with pytest.raises(exercises.ExerciseError, match=match):
        exercises.strip_solutions(_nb(_code(src)))


def test_check_mode_exit_codes(tmp_path, capsys):
    sol, ex = tmp_path / "solutions", tmp_path / "exercises"
    sol.mkdir()
    (sol / "a.ipynb").write_text(json.dumps(_nb(_code("### BEGIN SOLUTION\nx = 1\n### END SOLUTION"))))
    args = ["--solutions", str(sol), "--exercises", str(ex)]
    assert exercises.main(args + ["--check"]) == 1
    assert "a.ipynb" in capsys.readouterr().err
    assert not ex.exists()  # --check never writes
    assert exercises.main(args) == 0
    assert exercises.main(args + ["--check"]) == 0
    (sol / "a.ipynb").write_text(json.dumps(_nb(_code("y = 0\n### BEGIN SOLUTION\nx = 1\n### END SOLUTION"))))
    assert exercises.main(args + ["--check"]) == 1
    (sol / "a.ipynb").write_text(json.dumps(_nb(_code("x = 1"))))
    assert exercises.main(args) == 2  # no solution block: an error, not an identical "exercise"
