"""The 3-D section of ``minidist demo`` and the capstone's checks: the tiny GPT on a
``dp x tp x pp`` grid against one process on the whole global batch.

One training step (:func:`minidist.hybrid.train_step`, 1F1B, no optimizer step) on every rank of
the grid; the tied embedding, ignored target positions (-100, spread unevenly over micro-batches
and replicas) and clipping by the global norm are all on, so every combination duty is exercised:
the loss per counted token over the global batch, the tied copies' gradient sum, the norm that
counts each parameter once. The gathered gradients (over TP shards and pipeline stages) are then
compared with ``torch.nn.utils.clip_grad_norm_`` applied to the one-process GPT's gradients.

``demo_rows()`` returns rows ``{"section": "3-D", "check", "world_size", "max_error", "ok",
"detail"}`` (one launch of 8 ranks, about 10 s on 2 cores). :func:`step_on_grid` is
what the chapter reuses; the one-process oracle (:func:`reference`, :func:`batch`, :func:`compare`)
lives in :mod:`minidist_course.references.hybrid` and is imported here for the chapter.
"""

from __future__ import annotations

from minidist.models.gpt import GPTConfig
from ..references.hybrid import BATCH, CFG, MAX_NORM, TOL, batch, compare, moe_reference, reference

__all__ = ["CFG", "BATCH", "MAX_NORM", "TOL", "MOE", "batch", "step_on_grid", "five_axes_step",
           "reference", "moe_reference", "compare", "demo_rows", "weighted_by_samples"]


def step_on_grid(rank: int, world: int, dp: int, tp: int, pp: int,
                 loss_reduction: str = "per_token", microbatches: int = 2,
                 max_norm: float | None = MAX_NORM, cfg: GPTConfig = CFG, n: int = BATCH,
                 ignore: float = 0.3, tied_sum: bool = True) -> dict:
    """Run inside ``minidist.run(step_on_grid, dp·tp·pp, dp, tp, pp)``: one ``train_step`` without
    the optimizer step. ``tied_sum=False`` skips the tied embedding's gradient sum (the bug the
    chapter shows). Returns ``{"coords": (dp_rank, pp_rank, tp_rank), "loss", "grad_norm",
    "grads": {GPT name: full gradient of this rank's stages}}``."""
    from minidist.grid import ProcessGrid
    from minidist.hybrid import HybridGPT, train_step, wrap_stages

    grid = ProcessGrid(dp, pp, tp)
    model = HybridGPT(cfg, grid, seed=0)
    if not tied_sum:
        model.allreduce_tied_grads = lambda: None
    ids, targets = batch(n, cfg, ignore)
    out = train_step(model, None, wrap_stages(model, "flat"), ids, targets, microbatches,
                     loss_reduction=loss_reduction, max_norm=max_norm, step=False)
    return {"coords": (grid.dp_rank, grid.pp_rank, grid.tp_rank), "loss": out.loss,
            "grad_norm": out.grad_norm, "grads": model.gather(grads=True)}


def weighted_by_samples(shards: int = 4, cfg: GPTConfig = CFG, n: int = BATCH,
                        ignore: float = 0.3) -> dict:
    """How far the per-shard token mean, averaged over ``shards`` equal cuts of the batch (2 DP
    replicas x 2 micro-batches: each weighted by its share of the *samples*), is from one
    process's mean over the counted tokens — in one process, no ranks. Returns relative errors
    ``{"loss", "grads"}`` (unclipped gradients, model-wide). ``train_step`` refuses
    ``loss_reduction="mean"`` where this is not zero (ignored targets over several shards)."""
    import torch
    import torch.nn.functional as F

    from minidist.models.gpt import GPT

    ids, targets = batch(n, cfg, ignore)
    out = {}
    for name in ("tokens", "samples"):
        torch.manual_seed(0)
        model = GPT(cfg)
        logits, _ = model(ids)
        ce = lambda lo, t: F.cross_entropy(lo.reshape(-1, cfg.vocab_size), t.reshape(-1))  # noqa: E731
        loss = (ce(logits, targets) if name == "tokens" else
                sum(ce(lo, t) for lo, t in zip(logits.tensor_split(shards),
                                               targets.tensor_split(shards))) / shards)
        loss.backward()
        out[name] = (loss.item(), torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    (right, g_right), (wrong, g_wrong) = out["tokens"], out["samples"]
    return {"loss": abs(wrong - right) / abs(right),
            "grads": ((g_wrong - g_right).norm() / g_right.norm()).item()}


def demo_rows(dims: tuple[int, int, int] = (2, 2, 2), timeout: float = 180) -> list[dict]:
    """Rows for ``minidist demo``: one 1F1B step of the tiny GPT on ``dims`` = (dp, tp, pp)."""
    from minidist.launch import run

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


# the experts of chapter 12's five-axis run: top-2 of 4, both aux losses on
MOE = dict(num_experts=4, top_k=2, aux_loss_coeff=1e-2, z_loss_coeff=1e-3)


def five_axes_step(rank: int, world: int, dp: int, pp: int, cp: int, tp: int, ep: int,
                   schedule: str = "zb-v", microbatches: int = 4) -> dict:
    """Run inside ``minidist.run(five_axes_step, dp·pp·cp·tp, dp, pp, cp, tp, ep)``: one
    ``train_step`` of the tiny GPT with mixture-of-experts blocks (:data:`MOE`) on the
    five-axis grid, recomputation on, without the optimizer step. Returns what
    :func:`step_on_grid` returns (coordinates ``(dp·cp index, pp_rank, tp_rank)``), plus
    ``"aux_loss"`` and ``"ep_group"``; compare with
    :func:`minidist_course.references.hybrid.moe_reference`."""
    from minidist.grid import ProcessGrid
    from minidist.hybrid import HybridGPT, train_step, wrap_stages

    grid = ProcessGrid(dp, pp, tp, cp=cp, ep=ep)
    model = HybridGPT(CFG, grid, chunks=2, placement="v", recompute="minidist", moe=MOE)
    ids, targets = batch(BATCH, CFG)
    out = train_step(model, None, wrap_stages(model, "flat"), ids, targets, microbatches,
                     schedule=schedule, loss_reduction="per_token", max_norm=MAX_NORM,
                     step=False)
    return {"coords": (grid.dp_rank * cp + grid.cp_rank, grid.pp_rank, grid.tp_rank),
            "loss": out.loss, "aux_loss": out.aux_loss, "grad_norm": out.grad_norm,
            "grads": model.gather(grads=True), "ep_group": grid.ep_ranks}
