"""The 3-D section of ``minidist demo`` and the capstone's checks: the tiny GPT on a
``dp x tp x pp`` grid against one process on the whole global batch.

One training step (:func:`minidist.hybrid.train_step`, 1F1B, no optimizer step) on every rank of
the grid; the tied embedding, ignored target positions (-100, spread unevenly over micro-batches
and replicas) and clipping by the global norm are all on, so every combination duty is exercised:
the loss per counted token over the global batch, the tied copies' gradient sum, the norm that
counts each parameter once. The gathered gradients (over TP shards and pipeline stages) are then
compared with ``torch.nn.utils.clip_grad_norm_`` applied to the one-process GPT's gradients.

``demo_rows()`` returns rows ``{"section": "3-D", "check", "world_size", "max_error", "ok",
"detail"}`` (one launch of 8 ranks, about 10 s on 2 cores). :func:`step_on_grid`,
:func:`reference` and :func:`compare` are what the chapter and the exercise grader reuse.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..models.gpt import GPT, GPTConfig

__all__ = ["CFG", "BATCH", "MAX_NORM", "TOL", "batch", "step_on_grid", "reference", "compare",
           "demo_rows"]

# 4 layers over 2 stages, 4 heads over 2 TP ranks; vocabulary 93 is padded to 94 at tp = 2
CFG = GPTConfig(vocab_size=93, block_size=16, n_layer=4, n_head=4, n_embd=32, tie_embeddings=True)
BATCH, MAX_NORM = 8, 0.25       # clipping is active: every reference norm here is > 0.25
TOL = 1e-6                      # relative, fp32 (sums over shards and micro-batches reordered)


def batch(n: int = BATCH, cfg: GPTConfig = CFG, ignore: float = 0.3, seed: int = 3):
    """The global batch ``ids, targets`` (int64 ``[n, block_size]``), the same on every rank; about
    ``ignore`` of the target positions are -100 (ignored), more in the first samples than in the
    last, so micro-batches and replicas count different numbers of tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (n, cfg.block_size), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (n, cfg.block_size), generator=g)
    if ignore:
        rate = torch.linspace(2 * ignore, 0, n).clamp(max=0.9)[:, None]   # uneven over samples
        targets[torch.rand(targets.shape, generator=g) < rate] = -100
    return ids, targets


def step_on_grid(rank: int, world: int, dp: int, tp: int, pp: int,
                 loss_reduction: str = "per_token", microbatches: int = 2,
                 max_norm: float | None = MAX_NORM, cfg: GPTConfig = CFG, n: int = BATCH,
                 ignore: float = 0.3, tied_sum: bool = True) -> dict:
    """Run inside ``minidist.run(step_on_grid, dp·tp·pp, dp, tp, pp)``: one ``train_step`` without
    the optimizer step. ``tied_sum=False`` skips the tied embedding's gradient sum (the bug the
    chapter shows). Returns ``{"coords": (dp_rank, pp_rank, tp_rank), "loss", "grad_norm",
    "grads": {GPT name: full gradient of this rank's stages}}``."""
    from ..grid import ProcessGrid
    from ..hybrid import HybridGPT, train_step, wrap_stages

    grid = ProcessGrid(dp, pp, tp)
    model = HybridGPT(cfg, grid, seed=0)
    if not tied_sum:
        model.allreduce_tied_grads = lambda: None
    ids, targets = batch(n, cfg, ignore)
    out = train_step(model, None, wrap_stages(model, "flat"), ids, targets, microbatches,
                     loss_reduction=loss_reduction, max_norm=max_norm, step=False)
    return {"coords": (grid.dp_rank, grid.pp_rank, grid.tp_rank), "loss": out.loss,
            "grad_norm": out.grad_norm, "grads": model.gather(grads=True)}


def reference(max_norm: float | None = MAX_NORM, cfg: GPTConfig = CFG, n: int = BATCH,
              ignore: float = 0.3, reduction: str = "mean") -> dict:
    """One process, the whole batch: ``F.cross_entropy`` (``reduction`` "mean": over the counted
    tokens, ignore_index -100; or "sum"), backward, ``clip_grad_norm_``. Returns ``{"loss",
    "grad_norm" (before clipping), "grads" (after clipping)}``."""
    torch.manual_seed(0)
    model = GPT(cfg)
    ids, targets = batch(n, cfg, ignore)
    logits, _ = model(ids)
    loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), targets.reshape(-1),
                           reduction=reduction)
    loss.backward()
    norm = None
    if max_norm is not None:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item()
    return {"loss": loss.item(), "grad_norm": norm,
            "grads": {k: p.grad.clone() for k, p in model.named_parameters()}}


def compare(results: list[dict], ref: dict) -> dict:
    """How far the grid's results are from ``ref``: ``loss`` and ``grad_norm`` (worst relative
    error over ranks), ``grads`` (model-wide relative error ``‖Δ‖/‖ref‖`` of the gathered
    gradients), ``tied`` (largest difference between the tied embedding's two copies' gradients;
    0 when there is no copy), ``replicas`` (largest difference between DP replicas), ``missing``
    (GPT names no rank returned)."""
    rel = lambda a, b: abs(a - b) / abs(b)   # noqa: E731
    out = {"loss": max(rel(r["loss"], ref["loss"]) for r in results), "tied": 0.0,
           "replicas": 0.0}
    if ref["grad_norm"] is not None:
        out["grad_norm"] = max(rel(r["grad_norm"], ref["grad_norm"]) for r in results)
    by_place: dict = {}
    for r in results:
        _, p, t = r["coords"]
        if (p, t) in by_place:
            other = by_place[(p, t)]
            out["replicas"] = max([out["replicas"]] + [(other[k] - r["grads"][k]).abs().max().item()
                                                       for k in r["grads"]])
        by_place[(p, t)] = r["grads"]
    got = {}
    for grads in by_place.values():
        got.update(grads)
    if "head.weight" not in ref["grads"] and "head.weight" in got:   # the tied copy
        out["tied"] = (got.pop("head.weight") - got["tok_emb.weight"]).abs().max().item()
    out["missing"] = sorted(set(ref["grads"]) - set(got))
    common = [k for k in ref["grads"] if k in got]
    diff = torch.cat([(got[k] - ref["grads"][k]).reshape(-1) for k in common]).norm()
    whole = torch.cat([ref["grads"][k].reshape(-1) for k in common]).norm()
    out["grads"] = (diff / whole).item()
    return out


def demo_rows(dims: tuple[int, int, int] = (2, 2, 2), timeout: float = 180) -> list[dict]:
    """Rows for ``minidist demo``: one 1F1B step of the tiny GPT on ``dims`` = (dp, tp, pp)."""
    from ..launch import run

    dp, tp, pp = dims
    world = dp * tp * pp
    ref = reference()
    err = compare(run(step_on_grid, world, dp, tp, pp, timeout=timeout), ref)
    where = f"({dp},{tp},{pp})"
    rows = [
        dict(check=f"{where} loss per counted token = 1 process", max_error=err["loss"],
             ok=err["loss"] <= TOL,
             detail=f"(dp,tp,pp), batch {BATCH}, 2 micro-batches/replica, ~25% targets ignored; relative"),
        dict(check=f"{where} global grad norm = clip_grad_norm_", max_error=err["grad_norm"],
             ok=err["grad_norm"] <= TOL, detail="each parameter once: TP-replicated, tied copy"),
        dict(check=f"{where} gathered clipped grads = 1 process", max_error=err["grads"],
             ok=err["grads"] <= TOL and not err["missing"],
             detail=f"||g - g_ref|| / ||g_ref|| over all {len(ref['grads'])} tensors"),
        dict(check=f"{where} DP replicas, tied copies equal", max_error=max(err["replicas"],
                                                                                err["tied"]),
             ok=err["replicas"] == 0.0 and err["tied"] == 0.0,
             detail="bitwise: replica 0 vs 1, tok_emb (first stage) vs head (last stage)"),
    ]
    for r in rows:
        r.update(section="3-D", world_size=world)
    return rows
