"""The tensor-parallel section of ``minidist demo``: a few end-to-end checks in a few seconds.

Each row compares a TP computation with its single-process reference (the checks of
:mod:`minidist_course.references.tensor_parallel`, which the tests and the lesson use too): the f/g MLP, vocab-parallel
cross-entropy with 1e4 logits and a padded vocabulary, the tiny GPT (plain TP and with sequence parallelism), and the communication of one
block against the formula.
"""

from __future__ import annotations

from minidist import launch
from minidist.tensor_parallel import accounting
from ..references.tensor_parallel import TOL, cross_entropy_error, gpt_errors, mlp_error

__all__ = ["demo_rows"]


def _rank(rank, world):
    out = {"mlp": mlp_error(), "ce": cross_entropy_error(world)}
    out["gpt"], out["block"] = gpt_errors(False)
    out["gpt_sp"], out["block_sp"] = gpt_errors(True)
    return out


def demo_rows() -> list[dict]:
    """Rows for ``minidist demo`` (each ``{"section", "check", "world_size", "max_error", "ok",
    "detail"}``); runs TP = 2 and 4 on CPU ranks in a few seconds."""
    rows = []
    for world in (2, 4):
        res = launch.run(_rank, world, timeout=120)
        worst = {k: max(r[k] for r in res) for k in ("mlp", "ce", "gpt", "gpt_sp")}
        want = accounting.block_formula(2, 8, 16, world)["bytes_sent"]
        got = res[0]["block"]
        rows += [
            {"check": "column+row MLP (f, g) = one process", "max_error": worst["mlp"],
             "detail": "output, x.grad, weight grads"},
            {"check": "vocab-parallel CE = F.cross_entropy", "max_error": worst["ce"],
             "detail": "V=10 padded, 1e4 logit, eps 0 and 0.1"},
            {"check": "tiny GPT (TP) = one process", "max_error": worst["gpt"],
             "detail": "logits, loss, every gradient"},
            {"check": "tiny GPT (TP + sequence parallel) = one process", "max_error": worst["gpt_sp"],
             "detail": "logits, loss, every gradient"},
        ]
        for r in rows[-4:]:
            r.update(section="TP", world_size=world, ok=r["max_error"] < TOL)
        ok = got["forward"] == want and got["backward"] == want
        rows.append({"section": "TP", "check": "block comm = 2 all-reduces/pass formula",
                     "world_size": world, "max_error": 0.0 if ok else 1.0, "ok": ok,
                     "detail": f"{got['forward']} B fwd, {got['backward']} B bwd sent, formula {want}"})
    return rows
