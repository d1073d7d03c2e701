"""Exercise 12: the learner's global gradient norm of a 3-D (dp x tp x pp) model, counting each
parameter once, against ``torch.nn.utils.clip_grad_norm_`` on the one-process GPT.

The learner writes ``global_grad_norm(model) -> float`` for a :class:`minidist.hybrid.HybridGPT`
whose gradients are final (DP-averaged, tied copies summed). The grader runs one step of the tiny
GPT (tied embedding, vocabulary padded when tp > 1) on several grids, calls the learner's function
on every rank, and compares every rank's answer with torch's norm of the one-process model's
gradients (relative tolerance 1e-5: the learner may sum in fp32).

When the answer is wrong the grader says which rule was broken, by recomputing the norms that
the usual mistakes give from per-rank sums of squares it collects itself:

* TP-replicated parameters (LayerNorm, biases of row-parallel layers, position embedding) counted
  on every TP rank: ``sqrt(a + tp·b)`` instead of ``sqrt(a + b)``;
* the last stage's copy of the tied embedding counted too: ``sqrt(a + b + c)``;
* summed over the DP replicas, which hold the same gradient: ``sqrt(dp·(a + b))``;
* not summed over the TP group or the pipeline group: the ranks of a stage, or the stages, give
  different answers.

Mistakes combine (summing every local gradient over the whole world is all three of the first:
``sqrt(dp·(a + tp·b + c))``); the grader tries every combination, fewest first, and names each rule
the matching one breaks. A run that does not finish within ``timeout`` (60 s: one step of this
model takes seconds) is reported as what it almost always is here, a collective that only some
ranks of a group called.

Here ``a`` is the sum of squares of the tensor-parallel shards (over the TP group and the stages),
``b`` that of the replicated parameters (once), ``c`` that of the tied copy.
"""

from __future__ import annotations

import math

import torch

from .core import Report
from .generated import examples, st

__all__ = ["GRIDS", "grade_global_grad_norm", "NORM_RULES"]

# (dp, tp, pp): one process; TP only; PP only (tied copy on the last stage); DP x PP; TP x PP; all
GRIDS = [(1, 1, 1), (1, 2, 1), (1, 1, 2), (2, 1, 2), (1, 2, 2), (2, 2, 2)]
RTOL = 1e-5
N = 4                       # samples in the global batch (2 micro-batches per replica at dp = 2)


def _cfg():
    from minidist.models.gpt import GPTConfig
    # vocabulary 37: padded to 38 at tp = 2; 4 layers fill 2 stages; 2 heads split over tp = 2
    return GPTConfig(vocab_size=37, block_size=8, n_layer=4, n_head=2, n_embd=16,
                     tie_embeddings=True)


def _rank(rank, world, dims, fn, cfg=None):
    import torch.distributed as dist

    from minidist.grid import ProcessGrid
    from minidist.hybrid import HybridGPT, train_step, wrap_stages
    from ..references.hybrid import batch
    dp, tp, pp = dims
    cfg = cfg or _cfg()
    grid = ProcessGrid(dp, pp, tp)
    model = HybridGPT(cfg, grid, seed=0)
    ids, targets = batch(N, cfg)
    train_step(model, None, wrap_stages(model, "flat"), ids, targets, 2,
               loss_reduction="per_token", step=False)
    # sums of squares the grader uses to name a mistake: shards, replicated (every TP rank), tied copy
    parts = torch.zeros(3, dtype=torch.float64)
    for p in model.parameters():
        if p.grad is not None:
            k = 2 if model.is_tied_copy(p) else 0 if getattr(p, "tensor_model_parallel", False) else 1
            parts[k] += p.grad.detach().double().pow(2).sum()
    # this rank's correct share: shards, replicated ones on TP rank 0, never the tied copy
    local = sum(float(p.grad.detach().double().pow(2).sum()) for p in model.parameters()
                if p.grad is not None and not model.is_tied_copy(p)
                and (getattr(p, "tensor_model_parallel", False) or grid.tp_rank == 0))
    before = {id(p): p.grad.clone() for p in model.parameters() if p.grad is not None}
    value = fn(model)
    changed = any(not torch.equal(before[id(p)], p.grad) for p in model.parameters()
                  if p.grad is not None)
    dist.all_reduce(parts)          # over the world: a·dp, b·dp·tp, c·dp (c is TP-sharded)
    return (grid.dp_rank, grid.pp_rank, grid.tp_rank), value, parts.tolist(), changed, local


def _run(dims, fn, timeout):
    from minidist.launch import run
    return run(_rank, dims[0] * dims[1] * dims[2], dims, fn, timeout=timeout)


def _reference_norm(cfg=None) -> float:
    from ..references.hybrid import reference
    return reference(max_norm=float("inf"), cfg=cfg or _cfg(), n=N)["grad_norm"]


def _rank_many(rank, world, dims, fn, cfgs):
    return [_rank(rank, world, dims, fn, cfg) for cfg in cfgs]


# (vocab_size, n_embd, n_layer, tied): odd vocabularies are padded at tp = 2
MODELS = st.tuples(st.integers(17, 41), st.sampled_from([8, 16]), st.sampled_from([2, 4]),
                   st.booleans())


def _generated_models(fn, timeout, dims=(1, 2, 2)):
    """Models hypothesis draws, all in one launch of the grid ``dims``; the first whose norm is
    off, explained as the named grids are."""
    from dataclasses import replace
    from minidist.launch import run
    drawn = examples(MODELS, 4)
    cfgs = [replace(_cfg(), vocab_size=v, n_embd=e, n_layer=n, tie_embeddings=t)
            for v, e, n, t in drawn]
    per_rank = run(_rank_many, dims[0] * dims[1] * dims[2], dims, fn, cfgs, timeout=timeout)
    for i, (cfg, (v, e, n, t)) in enumerate(zip(cfgs, drawn)):
        problem = _explain(dims, [results[i] for results in per_rank], _reference_norm(cfg))
        if problem:
            return problem[0], (f"(dp,tp,pp)=({dims[0]},{dims[1]},{dims[2]}), vocabulary {v}, "
                                f"width {e}, {n} layers, {'tied' if t else 'untied'} (generated): "
                                f"{problem[1]}")
    return None


def _explain(dims, results, want) -> tuple[str, str] | None:
    """``(rule, message)`` for the first rule this grid's answers break, or ``None``."""
    dp, tp, pp = dims
    values = {}
    for coords, value, *_ in results:
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                return "measure", (f"global_grad_norm returned a tensor of shape "
                                   f"{tuple(value.shape)}, expected a number")
            value = value.item()
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return "measure", f"global_grad_norm returned {type(value).__name__}, expected a float"
        values[coords] = float(value)
    if any(r[3] for r in results):
        return "measure", "global_grad_norm changed the gradients: it should only measure them"
    bad = {c: v for c, v in values.items() if not math.isclose(v, want, rel_tol=RTOL)}
    if not bad:
        return None
    stages = {}
    for (d, p, t), v in values.items():
        stages.setdefault((d, p), set()).add(v)
    if any(len(vs) > 1 for vs in stages.values()):
        return "tp", ("the TP ranks of one stage disagree (" + ", ".join(
            f"dp {d} pp {p} tp {t}: {v:.6g}" for (d, p, t), v in sorted(values.items())[:tp]) +
            "): sum the squares over the TP group (every rank holds only its shards)")
    if len({v for (d, p, t), v in values.items() if d == 0}) > 1:
        return "pp", ("the pipeline stages disagree: sum the squares over the pipeline group too "
                      "(each stage holds different layers)")
    a, b, c = (x / dp for x in results[0][2])
    b /= tp
    got = next(iter(bad.values()))
    head = f"expected {want:.6g} (torch.nn.utils.clip_grad_norm_ on one process), got {got:.6g}"
    matched = _match(dims, (a, b, c), got, want)
    if matched:
        return matched[0], f"{head}: {matched[1]}"
    early = _sqrt_too_early(results, got)
    if early:
        return "sqrt_last", f"{head}: {early}"
    return "equal", head


def _sqrt_too_early(results, got) -> str | None:
    """Norms do not add: does ``got`` equal a root taken before one of the sums?"""
    local = {r[0]: r[4] for r in results if r[0][0] == 0}
    per_stage = {}
    for (_, p, _t), v in local.items():
        per_stage[p] = per_stage.get(p, 0.0) + v
    candidates = {
        "the root of every rank's own sum, then those roots added over TP and PP":
            sum(math.sqrt(v) for v in local.values()),
        "the root after the TP sum, then the stages' roots added over PP":
            sum(math.sqrt(v) for v in per_stage.values()),
        "the roots of every rank's sum added, then a root again":
            math.sqrt(sum(math.sqrt(v) for v in local.values())),
    }
    exact = math.sqrt(sum(local.values()))
    for what, value in candidates.items():
        if not math.isclose(value, exact, rel_tol=RTOL) and math.isclose(got, value, rel_tol=RTOL):
            return (f"your answer is {what}: norms do not add — sum the squares over every group "
                    "first, take one square root at the end")
    return None


NORM_RULES = {
    "replicated": "TP-replicated parameters (LayerNorm, row-parallel biases, position embedding) "
                  "are counted on one TP rank only",
    "tied": "the last stage's copy of the tied embedding is not counted (skip "
            "model.is_tied_copy(p): it is the first stage's embedding again)",
    "dp": "no sum over the DP replicas: they hold the same averaged gradient",
    "tp": "the squares are summed over the TP group (every rank holds only its shards)",
    "pp": "the squares are summed over the pipeline group (the stages hold different layers)",
    "square": "the norm, not its square: take the square root",
    "sqrt_last": "one square root, after every sum (norms do not add)",
    "measure": "only measure: return a float and leave the gradients unchanged",
    "equal": "every rank returns torch.nn.utils.clip_grad_norm_'s norm of the one-process model "
             "(relative tolerance 1e-5)",
    "collective": "every rank of a group makes the same collectives, whatever its pp_rank (no "
                  "answer within the timeout: a collective only some ranks called)",
}


_RULES = {   # each mistake: what the learner did, and what to do instead
    "replicated": "your sum has them counted on every TP rank; count them on TP rank 0 only",
    "tied": "the last stage's copy of the tied embedding is counted as well; skip "
            "model.is_tied_copy(p), it is the first stage's embedding again",
    "dp": "summed over the DP replicas, which hold the same averaged gradient; do not reduce over "
          "the DP group",
    "square": "the squared norm: take the square root",
}


def _match(dims, parts, got, want) -> tuple[str, str] | None:
    """(first rule, text naming every rule) of the fewest-mistakes combination whose norm equals
    ``got``, or None.

    A mistake that changes nothing on this grid (``tp = 1``, ``dp = 1``, no tied copy) is not tried:
    the grid cannot tell it apart, and a rule the answer did not break must not be named."""
    from itertools import combinations
    dp, tp, _ = dims
    a, b, c = parts
    possible = [k for k, live in (("replicated", tp > 1), ("tied", c > 0), ("dp", dp > 1),
                                  ("square", True)) if live]
    for n in range(1, len(possible) + 1):
        for combo in combinations(possible, n):
            sq = (a + (tp * b if "replicated" in combo else b) + (c if "tied" in combo else 0.0))
            sq *= dp if "dp" in combo else 1
            value = sq if "square" in combo else math.sqrt(sq)
            if value != want and math.isclose(got, value, rel_tol=RTOL):
                rules = [f"[{k}] {_RULES[k]}" for k in combo]
                if len(rules) == 1:
                    return combo[0], _RULES[combo[0]]
                return combo[0], f"{len(rules)} rules broken: " + "; ".join(
                    f"({i}) {r}" for i, r in enumerate(rules, 1))
    return None


DEADLOCK = ("no answer within {timeout:g} s (one step of this model takes seconds): likely a "
            "collective that only some ranks of a group called (e.g. inside `if pp_rank == 0`) "
            "— every rank of the group must call it, the same calls in the same order")


def grade_global_grad_norm(fn, total: float = 5, grids=GRIDS, timeout: float = 60.0) -> Report:
    """Grade ``fn(model) -> float`` on each (dp, tp, pp) of ``grids``; prints a ✓/✗ line per grid.

    ``timeout``: seconds per grid before the run counts as a deadlock (a margin of about ten over
    one step on a loaded 2-core machine); the later grids are then not run."""
    report = Report("global gradient norm on a 3-D grid", total=total, rules=NORM_RULES)
    want = _reference_norm()
    for dims in grids:
        name = "(dp,tp,pp)=({},{},{}) equals clip_grad_norm_ on one process".format(*dims)
        result = report.check(name, lambda d=dims: _explain(d, _run(d, fn, timeout), want))
        if result.stop == "timeout":   # say the likely cause in the exercise's terms first
            result.rule = "collective"
            result.message = (f"[collective] {NORM_RULES['collective']}: "
                              + DEADLOCK.format(timeout=timeout) + "\n" + result.message)
    if not report.failed:   # the named grids pass: models hypothesis draws, one launch
        report.check("(dp,tp,pp)=(1,2,2): 4 generated models (vocabulary, width, depth, tied) in "
                     "one launch", lambda: _generated_models(fn, 2 * timeout))
    return report
