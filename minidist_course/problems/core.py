"""Worked problems with answers, and predictions against measurements.

A :class:`Problem` is a question with numbers from real hardware, in the style of the Scaling
Book's worked problems (Austin et al. 2025, "How to Scale Your Model"). Its answer is computed by
the course's own planner and cost functions, and its worked solution prints numbers computed the
same way, so neither can drift from the code (``tests/course/test_problems.py`` checks every one).

In a notebook:

* ``show("03")`` prints chapter 03's problems, each answer folded in a ``<details>`` block the
  learner opens after trying;
* ``check("03.2", 0.5)`` compares the learner's own number with the answer (within the
  problem's tolerance) and records it in the ledger;
* a guess before a cell that measures — ``MY_GUESS = 1.2`` in the chapter's prediction cell,
  then ``compare("03.busbw", measured, MY_GUESS)`` after it (or ``predict`` / ``compare``
  separately): the guess against the measurement, recorded too;
* ``ledger_summary()``: how far off the learner's numbers were across the course.

The ledger is a JSON file per learner: ``$MINIDIST_LEDGER`` or ``~/.minidist/ledger.json``.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

__all__ = ["Problem", "REGISTRY", "register", "show", "check", "predict", "compare",
           "ledger_path", "ledger_summary"]


@dataclass(frozen=True)
class Problem:
    """``id`` ("03.2": chapter, number); ``question`` (markdown); ``answer()`` the number;
    ``unit`` (words); ``worked(answer)`` the worked solution (markdown, its numbers computed);
    ``rel_tol``: a learner's answer this close (relative) counts as right; ``source``: where the
    hardware numbers or formulas come from."""

    id: str
    question: str
    answer: Callable[[], float]
    unit: str
    worked: Callable[[float], str]
    rel_tol: float = 0.05
    source: str = ""

    @property
    def chapter(self) -> str:
        return self.id.split(".")[0]


REGISTRY: dict[str, Problem] = {}


def register(*problems: Problem) -> None:
    """Add problems to :data:`REGISTRY`; raises ``ValueError`` for an id used twice."""
    for p in problems:
        if p.id in REGISTRY:
            raise ValueError(f"problems.register: id {p.id!r} is used twice")
        REGISTRY[p.id] = p


def _number(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 100 and float(x).is_integer() else f"{x:.4g}"


def render(chapter: str) -> str:
    """Chapter ``chapter``'s problems as markdown, each answer folded in ``<details>``."""
    chosen = [p for p in REGISTRY.values() if p.chapter == chapter]
    if not chosen:
        raise KeyError(f"problems: no problem for chapter {chapter!r}; chapters: "
                       f"{sorted({p.chapter for p in REGISTRY.values()})}")
    parts = []
    for p in chosen:
        a = p.answer()
        parts.append(f"**Problem {p.id}.** {p.question}\n\n<details><summary>Answer</summary>\n\n"
                     f"**{(_number(a) + ' ' + p.unit).strip()}.** {p.worked(a)}"
                     + (f"\n\n*Source: {p.source}.*" if p.source else "") + "\n\n</details>")
    return "\n\n".join(parts)


def show(chapter: str) -> None:
    """Display :func:`render` (markdown in a notebook, text elsewhere)."""
    text = render(chapter)
    try:
        from IPython import get_ipython
        from IPython.display import Markdown, display
        if get_ipython() is not None:
            display(Markdown(text))
            return
    except ImportError:
        pass
    print(text)


def ledger_path() -> Path:
    return Path(os.environ.get("MINIDIST_LEDGER") or Path.home() / ".minidist" / "ledger.json")


def _load() -> dict:
    path = ledger_path()
    try:
        return json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        return {}


def _record(key: str, kind: str, **fields: float) -> None:
    """Merge ``fields`` (``yours``/``prediction``/``truth``) into the ledger's entry ``key``."""
    data = _load()
    data.setdefault(key, {"kind": kind}).update(fields)
    path = ledger_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1, sort_keys=True))
    except OSError:
        pass   # a read-only home: the check still prints


def check(problem_id: str, yours: float) -> bool:
    """Compare ``yours`` with problem ``problem_id``'s answer; print and record; True if right."""
    if problem_id not in REGISTRY:
        raise KeyError(f"problems.check: no problem {problem_id!r}; known: {sorted(REGISTRY)}")
    p = REGISTRY[problem_id]
    truth = p.answer()
    _record(problem_id, "problem", yours=float(yours), truth=truth)
    ok = math.isclose(float(yours), truth, rel_tol=p.rel_tol)
    ratio = float(yours) / truth if truth else math.inf
    print(f"{'✓' if ok else '✗'} problem {problem_id}: yours {_number(float(yours))}, answer "
          f"{_number(truth)} {p.unit}" + ("" if ok else f" (yours/answer = {ratio:.3g})"))
    return ok


def predict(key: str, value: float) -> None:
    """Record a prediction for the measurement ``key`` before the cell that measures it."""
    _record(key, "prediction", prediction=float(value))
    print(f"prediction for {key}: {_number(float(value))}")


def compare(key: str, measured: float, prediction: float | None = None) -> float | None:
    """The prediction for ``key`` (``prediction``, else the one :func:`predict` recorded) against
    ``measured``: prints the ratio, records, returns it (None when nothing was predicted)."""
    if prediction is not None:
        _record(key, "prediction", prediction=float(prediction))
    guess = _load().get(key, {}).get("prediction")
    if guess is None:   # nothing to compare: the ledger is not touched
        print(f"{key}: measured {_number(float(measured))} (no prediction recorded)")
        return None
    _record(key, "prediction", truth=float(measured))
    ratio = guess / measured if measured else math.inf
    print(f"{key}: predicted {_number(guess)}, measured {_number(float(measured))} "
          f"(prediction/measurement = {ratio:.3g})")
    return ratio


def ledger_summary() -> str:
    """How far off the learner's numbers were: per kind, the count and the median and worst
    factor (max(ratio, 1/ratio))."""
    data = _load()
    lines = []
    for kind in ("problem", "prediction"):
        factors = []
        for e in data.values():
            yours = e.get("yours" if kind == "problem" else "prediction")
            truth = e.get("truth")
            if e.get("kind") == kind and yours and truth:
                r = abs(yours / truth)
                factors.append(max(r, 1 / r) if r else math.inf)
        if factors:
            lines.append(f"{kind}s: {len(factors)}, median factor off "
                         f"{statistics.median(factors):.3g}, worst {max(factors):.3g}")
        else:
            lines.append(f"{kind}s: none recorded")
    return "\n".join(lines)
