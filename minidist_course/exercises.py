"""Generate ``exercises/*.ipynb`` from ``solutions/*.ipynb``: one source of truth for each exercise.

Usage (from the repository root)::

    python -m minidist_course.exercises            # regenerate every exercise from its solution
    python -m minidist_course.exercises --check    # exit 1 if an exercise is missing or out of date

The markers are nbgrader's, so an instructor can also run nbgrader on ``solutions/``
(``nbgrader generate_assignment`` does the same replacement):

* in a code cell, the lines from ``### BEGIN SOLUTION`` to ``### END SOLUTION`` become
  ``# YOUR CODE HERE`` and ``raise NotImplementedError()`` at the marker's indentation;
* in a markdown cell, they become ``YOUR ANSWER HERE``;
* ``### BEGIN HIDDEN TESTS`` ... ``### END HIDDEN TESTS`` blocks are removed;
* outputs and execution counts are stripped; cell metadata (nbgrader grade ids, points, tags)
  are kept, so the grading cells still run against the learner's code.

Only the standard library is used (notebooks are JSON), so the generator runs anywhere.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

__all__ = ["strip_solutions", "generate", "render", "main", "ExerciseError"]

_BEGIN = re.compile(r"^(\s*)### BEGIN SOLUTION\s*$")
_END = re.compile(r"^\s*### END SOLUTION\s*$")
_HBEGIN = re.compile(r"^\s*### BEGIN HIDDEN TESTS\s*$")
_HEND = re.compile(r"^\s*### END HIDDEN TESTS\s*$")


class ExerciseError(ValueError):
    """A solution notebook's markers are unbalanced, or it has no solution block at all."""


def _source(cell) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def _replace_blocks(text: str, kind: str, where: str) -> tuple[str, int]:
    out, inside, count = [], None, 0
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if inside is None and (m := _BEGIN.match(line)):
            inside, count = ("solution", m.group(1)), count + 1
            if kind == "code":
                out += [f"{m.group(1)}# YOUR CODE HERE", f"{m.group(1)}raise NotImplementedError()"]
            else:
                out.append("YOUR ANSWER HERE")
        elif inside is None and _HBEGIN.match(line):
            inside, count = ("hidden", ""), count + 1
        elif inside is not None and inside[0] == "solution" and _END.match(line):
            inside = None
        elif inside is not None and inside[0] == "hidden" and _HEND.match(line):
            inside = None
        elif _BEGIN.match(line) or _END.match(line) or _HBEGIN.match(line) or _HEND.match(line):
            raise ExerciseError(f"{where}: unbalanced marker on line {i + 1}: {line.strip()!r}")
        elif inside is None:
            out.append(line)
    if inside is not None:
        raise ExerciseError(f"{where}: '### BEGIN {inside[0].upper()}' without its END")
    return "\n".join(out), count


def strip_solutions(nb: dict, where: str = "notebook") -> dict:
    """Return the exercise version of a solution notebook (a dict as in the .ipynb JSON)."""
    nb = json.loads(json.dumps(nb))  # deep copy
    total = 0
    for i, cell in enumerate(nb.get("cells", [])):
        if cell.get("cell_type") not in ("code", "markdown"):
            continue
        text, count = _replace_blocks(_source(cell), cell["cell_type"], f"{where}, cell {i}")
        total += count
        cell["source"] = text.splitlines(keepends=True)
        if cell["cell_type"] == "code":
            cell["outputs"] = []
            cell["execution_count"] = None
            cell.get("metadata", {}).pop("execution", None)  # run timestamps of the solution
    if total == 0:
        raise ExerciseError(f"{where}: no '### BEGIN SOLUTION' block: nothing for the learner to do")
    return nb


def render(nb: dict) -> str:
    """The notebook as text, the way nbformat writes it (indent 1, sorted keys)."""
    return json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def _repo_root() -> Path:
    here = Path(__file__).resolve().parent.parent
    return here if (here / "solutions").is_dir() else Path.cwd()


def generate(solutions: Path | None = None, exercises: Path | None = None,
             check: bool = False) -> list[str]:
    """Write (or, with ``check``, compare) every exercise. Returns the out-of-date file names."""
    root = _repo_root()
    solutions = Path(solutions) if solutions else root / "solutions"
    exercises = Path(exercises) if exercises else root / "exercises"
    stale = []
    for sol in sorted(solutions.glob("*.ipynb")):
        text = render(strip_solutions(json.loads(sol.read_text(encoding="utf-8")), str(sol)))
        target = exercises / sol.name
        current = target.read_text(encoding="utf-8") if target.exists() else None
        if current != text:
            stale.append(target.name)
            if not check:
                exercises.mkdir(parents=True, exist_ok=True)
                target.write_text(text, encoding="utf-8")
    return stale


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minidist_course.exercises", description=__doc__.split(
        "\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="do not write; exit 1 if any exercise is missing or out of date")
    parser.add_argument("--solutions", type=Path, default=None, help="default: ./solutions")
    parser.add_argument("--exercises", type=Path, default=None, help="default: ./exercises")
    args = parser.parse_args(argv)
    try:
        stale = generate(args.solutions, args.exercises, check=args.check)
    except ExerciseError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.check:
        if stale:
            print("out of date (run `python -m minidist_course.exercises`): " + ", ".join(stale),
                  file=sys.stderr)
            return 1
        print("exercises are up to date")
        return 0
    print("regenerated: " + (", ".join(stale) if stale else "nothing (all up to date)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
