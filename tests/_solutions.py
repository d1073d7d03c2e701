"""Load a solution (or exercise) notebook's code into a namespace, optionally with a cell's code
replaced, and run its grading cells in this process: the tests inject a learner's plausible wrong
solution and check that the grader rejects it, check that every solution passes and that every
unmodified exercise fails, without a notebook kernel per case."""

import contextlib
import io
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Exercises whose grading cells start ranks (a grade is 2-15 s, not milliseconds): the default
# tier runs a representative part of their sweeps, the integration tier all of it.
LAUNCHING = ("01_token_ring", "02_collectives_by_composition", "03_ring_allreduce",
             "04_bucketed_ddp", "05_sampler_and_evaluation", "06_tensor_parallel", "07_one_f_one_b",
             "09_zero", "12_global_grad_norm", "14_context_parallel", "12b_bug_hunt",
             "08b_hierarchical_allreduce")


def _cells(name, folder="solutions"):
    nb = json.loads((ROOT / folder / name).read_text())
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            src = cell["source"]
            yield cell.get("metadata", {}).get("nbgrader", {}), "".join(src) if isinstance(
                src, list) else src


def load(name, replace=None, upto=None, folder="solutions"):
    """Execute the code cells of ``folder/name`` that define things (solution cells, set-up
    cells; not grading cells, not cells that run ranks) into a fresh namespace and return it.

    ``replace``: {grade_id: source} replaces a solution cell; ``upto``: stop before that grade_id;
    ``folder="exercises"``: the learner's notebook, whose unfilled cells may raise
    NotImplementedError where they run (the grading cells then find what is missing).
    """
    ns = {"__name__": f"solution_{Path(name).stem}"}
    for meta, src in _cells(name, folder):
        gid = meta.get("grade_id")
        if upto is not None and gid == upto:
            break
        if meta.get("grade") or "minidist.run(" in src or "plt." in src:
            continue
        src = (replace or {}).get(gid, src)
        with contextlib.redirect_stdout(io.StringIO()):
            if meta.get("solution"):
                try:
                    exec(compile(src, f"<{name}:{gid}>", "exec"), ns)
                except NotImplementedError:
                    if folder != "exercises":
                        raise
            else:
                with contextlib.suppress(Exception):
                    exec(compile(src, f"<{name}>", "exec"), ns)
    return ns


def grading_cells(name, folder="solutions"):
    """The grade_ids of the grading cells of ``folder/name``, in order."""
    return [meta["grade_id"] for meta, _ in _cells(name, folder) if meta.get("grade")]


def grade(name, grade_id, ns, folder="solutions", timeout: int | None = None):
    """Run grading cell ``grade_id`` in ``ns``; return (printed text, AssertionError or None).
    Any other exception (a NameError, a typo in the grading cell) propagates. ``timeout``: the
    cell's ``timeout=`` arguments replaced by this many seconds (a deadlock found sooner)."""
    for meta, src in _cells(name, folder):
        if meta.get("grade_id") == grade_id:
            if timeout is not None:
                assert "timeout=" in src, f"{grade_id} passes no timeout to replace"
                src = re.sub(r"timeout=\d+", f"timeout={timeout}", src)
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                try:
                    exec(compile(src, f"<{name}:{grade_id}>", "exec"), ns)
                except AssertionError as e:
                    return out.getvalue(), e
            return out.getvalue(), None
    raise KeyError(grade_id)
