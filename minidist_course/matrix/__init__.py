"""The composition matrix: every pair of values of every two features of the training step, run
against one process or refused by name (``minidist matrix``; chapter 12); the user-loop matrix
(:mod:`.user_loop`, ``minidist matrix --user-loop``): the wrappers in a user's own loop.

:mod:`.covering` builds the configurations (a seeded pairwise covering array), :mod:`.run` trains
and checks them. :func:`main` prints, per pair of dimensions, how many of their value pairs ran
correctly (✓), were refused by the library with both features named (refused), or failed (✗),
then the refusals with the library's own words and every failure with its configuration.
"""

from __future__ import annotations

import argparse
import sys
import time

from .covering import DIMENSIONS, covering_array, strength_one, strength_three
from .resume import STEPS, SAVE_AT, run_resume
from .run import run_matrix, summarise

__all__ = ["main", "format_table", "strength_three"]


def format_table(rows: list[dict]) -> str:
    """The pair table and the refusal and failure lists of :func:`.run.run_matrix`'s rows."""
    s = summarise(rows)
    dims = s["dimensions"]
    lines = [f"{'dimension pair':<22}{'pairs':>6}{'✓':>5}{'refused':>9}{'✗':>4}{'not run':>9}"]
    for i, a in enumerate(dims):
        for b in dims[i + 1:]:
            mine = [v for (p, q), v in s["pairs"].items() if p[0] == a and q[0] == b]
            total = len(DIMENSIONS[a]) * len(DIMENSIONS[b])
            lines.append(f"{a + ' × ' + b:<22}{total:>6}{mine.count('✓'):>5}"
                         f"{mine.count('refused'):>9}{mine.count('✗'):>4}{total - len(mine):>9}")
    statuses = list(s["pairs"].values())
    total = sum(len(DIMENSIONS[a]) * len(DIMENSIONS[b]) for i, a in enumerate(dims)
                for b in dims[i + 1:])
    lines.append(f"{'all':<22}{total:>6}{statuses.count('✓'):>5}{statuses.count('refused'):>9}"
                 f"{statuses.count('✗'):>4}{total - len(statuses):>9}")
    reasons: dict = {}
    for r in rows:
        if r["status"] == "refused":
            reasons.setdefault(r["detail"].split(": ", 1)[-1], r)
    if reasons:
        lines.append("\nrefused (the library's words, every rank, before any communication):")
        lines += [f"  {why}" for why in reasons]
    for r in s["failed"]:
        lines.append(f"\n✗ {_config(r)} (W={r['world']}): {r['detail']}")
    return "\n".join(lines)


def _config(r: dict) -> str:
    return " ".join(f"{d}={r[d]}" for d in DIMENSIONS)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="minidist matrix", description="Train one step of the tiny "
                                "GPT in every pair of training-step features (a pairwise covering "
                                "array) against one process; print which pairs run correctly, "
                                "which the library refuses by name, which fail. Exit 1 on a failure.")
    p.add_argument("--seed", type=int, default=0, help="the covering array's seed (default 0)")
    p.add_argument("--quick", action="store_true", help="only enough configurations for every "
                   "value to appear once (seconds, not minutes)")
    p.add_argument("--list", action="store_true", help="print the configurations, run nothing")
    p.add_argument("--strength", type=int, choices=(2, 3), default=2, help="2: every pair of "
                   "values (default); 3: every triple that holds no refused pair (about 270 "
                   "configurations, half of 8 ranks: about 7 minutes on 2 cores)")
    p.add_argument("--resume", action="store_true", help="the resume matrix instead: each "
                   f"configuration trains {STEPS} steps, saved after step {SAVE_AT}, and is "
                   "resumed in a new launch; it must equal the run that never stopped, bitwise")
    p.add_argument("--user-loop", action="store_true", help="the user-loop matrix instead: the "
                   "library's wrappers in a user's own loop (evaluation forwards, accumulation, "
                   "checkpoints, freezing) against one process, torch's own wrappers beside them")
    a = p.parse_args(argv)
    if a.user_loop:
        return _user_loop(a.quick)
    configs = covering_array(a.seed) if a.strength == 2 else strength_three(a.seed)
    if a.quick:
        configs = strength_one(configs)
    if a.list:
        for c in configs:
            print(_config(c))
        return 0
    if a.resume:
        return _resume(configs, a.seed)
    print(f"composition matrix: {len(configs)} configurations (seed {a.seed}) of "
          f"{' · '.join(str(len(v)) for v in DIMENSIONS.values())} values; one step each, "
          "against one process on the global batch", flush=True)
    start = time.perf_counter()
    rows = run_matrix(configs, progress=lambda t: print("  " + t, flush=True))
    print(format_table(rows))
    bad = [r for r in rows if r["status"] == "✗"]
    print(f"\n{len(rows) - len(bad)} of {len(rows)} configurations as expected in "
          f"{time.perf_counter() - start:.0f} s")
    return 1 if bad else 0


def _user_loop(quick: bool) -> int:
    from . import user_loop as U
    models = ["plain", "tied+frozen+buffer"] if quick else None
    todo = U.cells(models=models)
    print(f"user-loop matrix: {len(todo)} cells (module x wrapper x loop event), W=2, "
          f"{U.STEPS} AdamW steps each, against one process on the global batch", flush=True)
    start = time.perf_counter()
    rows = U.run_cells(todo, world=2)
    print(U.format_table(rows))
    mine = [r for r in rows if not r["wrapper"].startswith("torch")]
    bad = sum(r["status"] == "✗" for r in mine)
    print(f"\nminidist: {len(mine) - bad} of {len(mine)} cells right or refused by name; torch's "
          f"wrappers are the references beside them; {time.perf_counter() - start:.0f} s")
    return 1 if bad else 0


def _resume(configs: list[dict], seed: int) -> int:
    import tempfile
    print(f"resume matrix: the configurations of the composition matrix (seed {seed}) that are not "
          f"refused; save after step {SAVE_AT} of {STEPS}, a new launch loads and continues",
          flush=True)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="minidist-resume-") as root:
        rows = run_resume(configs, root, progress=lambda t: print("  " + t, flush=True))
    for r in rows:
        if r["status"] != "✓":
            print(f"✗ {_config(r)} (W={r['world']}): {r['detail']}")
    bad = sum(r["status"] != "✓" for r in rows)
    print(f"{len(rows) - bad} of {len(rows)} resumed bitwise equal to the run that never stopped, "
          f"in {time.perf_counter() - start:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
