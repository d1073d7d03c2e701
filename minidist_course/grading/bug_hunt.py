"""Grade exercise 12b, the bug hunt: name three bugs of :mod:`minidist_course.zoo` from their
symptoms alone, then fix one of them.

Part A. Each *mystery* is a zoo bug switched on in a 3-D run of the tiny GPT. The learner sees only
symptoms (:func:`symptoms`): on four configurations — one replica; two replicas; two replicas with
a tied embedding; two replicas whose micro-batches differ in size — the loss and the gradient
norm of one step, each divided by the correct run's. The learner answers with a bug's name. The
grader does not compare names: it switches the *answer* on and compares its symptoms with the
mystery's, so any bug that looks the same everywhere is accepted, and a wrong answer is told where
its symptoms differ ("dp-divide-twice would make the gradient norm 0.5 of the correct run's with
two replicas; the mystery makes it 2").

Part B. The fix of the micro-batch bug: ``loss_weights(batch_size, M) -> list[float]``, the weight
of each micro-batch's mean loss so that their sum is the mean over the batch. Checked on every
``1 <= M <= N <= 40`` against :func:`minidist.pipeline_parallel.microbatch.loss_weights` (the
smallest failing case is shown), then used by the pipeline engine in place of the library's in a
two-replica run with uneven micro-batches, which must equal the correct run.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch

from .. import zoo
from .core import Report

__all__ = ["MYSTERIES", "VARIANTS", "CHOICES", "symptoms", "show_symptoms", "grade_diagnosis",
           "grade_loss_weights", "DIAGNOSIS_RULES", "WEIGHT_RULES"]

# the three mysteries, and the rule of Part A that each one teaches
MYSTERIES = {1: "dp-sum-not-average", 2: "tied-embedding-not-summed", 3: "microbatch-mean-of-means"}
CHOICES = sorted(zoo.BUGS)
# (label, dp, tied embedding, micro-batches) on a two-stage pipeline; the global batch is 8
VARIANTS = [("one replica", 1, False, 2), ("two replicas", 2, False, 2),
            ("two replicas, tied embedding", 2, True, 2),
            ("two replicas, micro-batches of 2, 1, 1", 2, False, 3)]
BATCH = 8
# what to look at in the tables, not the answers: each rule is the reading one mystery needs
DIAGNOSIS_RULES = {
    "scale": "a ratio that is a clean number (2, 1/2, ...) is a count: which count, and in which "
             "configurations does it appear?",
    "tied": "a difference in one configuration only belongs to the feature that configuration adds",
    "weights": "a loss that is off itself points to how the loss is formed, not to the gradient "
               "reductions (they run after it)",
}
RULE_OF = {1: "scale", 2: "tied", 3: "weights"}
WEIGHT_RULES = {
    "count": "one weight per micro-batch: exactly M of them (tensor_split always gives M pieces)",
    "proportional": "micro-batch m weighs n_m / N, its share of the samples (the weights sum to 1)",
    "order": "the larger micro-batches come first, as tensor_split cuts them (10 into 4: 3, 3, 2, 2)",
}


def _run_variants(rank, world, variants, bugs, weights_fn):
    """On each rank: for every variant of this world size and every bug (None: correct), one step's
    (loss, gradient norm); ``weights_fn`` replaces the engine's micro-batch weights."""
    from minidist.grid import ProcessGrid
    from minidist.hybrid import HybridGPT, train_step, wrap_stages
    from minidist.hybrid.clip import global_grad_norm
    from minidist.models.gpt import GPTConfig
    from minidist.pipeline_parallel import microbatch
    out = {}
    original = microbatch.loss_weights
    if weights_fn is not None:
        microbatch.loss_weights = weights_fn
    try:
        for label, dp, tie, M in variants:
            for bug in bugs:
                cfg = GPTConfig(vocab_size=37, block_size=8, n_layer=4, n_head=2, n_embd=16,
                                tie_embeddings=tie)
                model = HybridGPT(cfg, ProcessGrid(dp, 2, 1), seed=0)
                g = torch.Generator().manual_seed(1)
                ids = torch.randint(0, 37, (BATCH, 8), generator=g)
                with zoo.inject(bug) if bug else contextlib.nullcontext():
                    res = train_step(model, None, wrap_stages(model, "flat"), ids, ids.roll(-1, 1),
                                     M, loss_reduction="mean", step=False)
                    out[(label, bug)] = (res.loss, global_grad_norm(model))
    finally:
        microbatch.loss_weights = original
    return out


@functools.lru_cache(maxsize=None)
def _all_symptoms() -> dict:
    """``{(variant label, bug or None): (loss, grad norm)}`` for every zoo bug: two launches."""
    from minidist.launch import run
    bugs = [None] + CHOICES
    out = {}
    for world in (2, 4):
        todo = [v for v in VARIANTS if 2 * v[1] == world]
        out.update(run(_run_variants, world, todo, bugs, None, timeout=240)[0])
    return out


def symptoms(bug: str) -> list[tuple[str, float, float]]:
    """``[(variant, loss / correct loss, grad norm / correct grad norm)]`` with ``bug`` on."""
    table = _all_symptoms()
    return [(label, table[(label, bug)][0] / table[(label, None)][0],
             table[(label, bug)][1] / table[(label, None)][1]) for label, *_ in VARIANTS]


def show_symptoms(mystery: int) -> None:
    """Print mystery ``mystery``'s symptoms: per configuration, its loss and gradient norm over
    the correct run's (1.000000 where nothing differs)."""
    print(f"mystery {mystery}: one step of the tiny GPT on a two-stage pipeline, global batch "
          f"{BATCH}, mean loss")
    print(f"  {'configuration':40s}{'loss / correct':>16s}{'grad norm / correct':>22s}")
    for label, loss, norm in symptoms(MYSTERIES[mystery]):
        print(f"  {label:40s}{loss:>16.6f}{norm:>22.6f}")


def _same(a: list, b: list) -> bool:
    return all(abs(x[1] - y[1]) <= 1e-6 and abs(x[2] - y[2]) <= 1e-6 for x, y in zip(a, b))


def _explain(answer: str, mystery: int) -> str:
    got, want = symptoms(answer), symptoms(MYSTERIES[mystery])
    for (label, l1, n1), (_, l2, n2) in zip(got, want):
        if abs(l1 - l2) > 1e-6 or abs(n1 - n2) > 1e-6:
            return (f"{answer} would give, on {label}, loss × {l1:.4g} and gradient norm × {n1:.4g}; "
                    f"the mystery gives loss × {l2:.4g} and gradient norm × {n2:.4g}")
    return ""


def grade_diagnosis(diagnosis: dict, total: float = 3) -> Report:
    """Part A: ``diagnosis`` maps 1, 2, 3 to a name of :data:`CHOICES`."""
    report = Report("Part A: name the bug from its symptoms", total=total, rules=DIAGNOSIS_RULES)
    for m in MYSTERIES:
        report.check(f"mystery {m}", lambda m=m: _diagnosis_check(diagnosis, m), rule=RULE_OF[m])
    return report


def _diagnosis_check(diagnosis, m):
    if not isinstance(diagnosis, dict) or m not in diagnosis:
        return RULE_OF[m], f"diagnosis has no answer for mystery {m} (a dict {{1: name, 2: ..., 3: ...}})"
    answer = diagnosis[m]
    if answer not in CHOICES:
        return RULE_OF[m], f"{answer!r} is not one of the zoo's bugs: {CHOICES}"
    if not _same(symptoms(answer), symptoms(MYSTERIES[m])):
        return RULE_OF[m], _explain(answer, m)
    return None


def _expected(N: int, M: int) -> list[float]:
    from minidist.pipeline_parallel.microbatch import loss_weights
    return loss_weights(N, M)


# float32 weights or weights rounded to 6 decimals make the same run as the exact ones (the run's
# check is 1e-6 relative): the sweep accepts them too, and says so when it prints a difference
REL_TOL, ABS_TOL = 1e-6, 5e-7


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=REL_TOL, abs_tol=ABS_TOL)


def _weights_sweep(fn):
    for N in range(1, 41):
        for M in range(1, N + 1):
            want = _expected(N, M)
            got = fn(N, M)
            try:
                got = [float(w) for w in got]
            except TypeError:
                return "count", f"loss_weights({N}, {M}) returned {got!r}, not a list of numbers"
            if len(got) != M:
                return "count", f"loss_weights({N}, {M}) gave {len(got)} weights, expected {M}"
            if all(_close(a, b) for a, b in zip(got, want)):
                continue
            digits = 4
            while _fmt(got, digits) == _fmt(want, digits) and digits < 17:
                digits += 3   # values that print alike: show the digits where they differ
            text = (f"loss_weights({N}, {M}) = {_fmt(got, digits)}, expected {_fmt(want, digits)}"
                    f" (each within {REL_TOL:g} relative or {ABS_TOL:g} absolute)")
            if all(_close(a, b) for a, b in zip(sorted(got), sorted(want))):
                return "order", text
            return "proportional", text
    return None


def _fmt(ws: list, digits: int = 4) -> str:
    return "[" + ", ".join(f"{w:.{digits}g}" for w in ws) + "]"


def _weights_in_a_run(fn):
    from minidist.launch import run
    label = VARIANTS[3][0]
    got = run(_run_variants, 4, [VARIANTS[3]], [None], fn, timeout=240)[0][(label, None)]
    want = _all_symptoms()[(label, None)]
    if abs(got[0] - want[0]) > 1e-6 * abs(want[0]) or abs(got[1] - want[1]) > 1e-6 * abs(want[1]):
        per_replica = BATCH // VARIANTS[3][1]
        mine, right = [float(w) for w in fn(per_replica, 3)], _expected(per_replica, 3)
        rule = "order" if sorted(mine) == sorted(right) and mine != right else "proportional"
        return rule, (f"with your weights, the run with micro-batches of 2, 1, 1 gives loss "
                                f"{got[0]:.6f} and gradient norm {got[1]:.6f}; the correct run "
                                f"{want[0]:.6f} and {want[1]:.6f}")
    return None


def grade_loss_weights(fn, total: float = 3) -> Report:
    """Part B: ``fn(batch_size, M) -> list[float]``, on every 1 <= M <= N <= 40, then in a run."""
    report = Report("Part B: fix the micro-batch weights", total=total, rules=WEIGHT_RULES)
    report.check("every 1 <= M <= N <= 40 against the library's weights", lambda: _weights_sweep(fn),
                 points=2)
    report.check("used by the pipeline engine: two replicas, micro-batches of 2, 1, 1",
                 lambda: _weights_in_a_run(fn))
    return report
