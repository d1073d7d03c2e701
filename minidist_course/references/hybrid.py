"""One process on the whole global batch: the oracle every 3-D (dp x tp x pp) check compares with.

The tiny GPT (tied embedding), its global batch with ignored target positions (-100, spread
unevenly over samples so micro-batches and replicas count different numbers of tokens), the
one-process step (``F.cross_entropy`` over the counted tokens, backward,
``torch.nn.utils.clip_grad_norm_``) and :func:`compare`, which says how far a grid's gathered
gradients, loss and norm are from it. Used by ``minidist demo``'s 3-D section
(:mod:`minidist_course.lessons.hybrid_demo`), chapter 12, exercise 12's grader and the tests.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from minidist.context_parallel.sharding import positions
from minidist.expert_parallel.gpt import MoEGPT
from minidist.models.gpt import GPT, GPTConfig

__all__ = ["CFG", "BATCH", "MAX_NORM", "TOL", "batch", "reference", "moe_reference", "compare"]

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


def _autocast(dtype: torch.dtype | None):
    """The forward's mixed precision (``torch.autocast`` on the CPU), or nothing."""
    return torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext()


def reference(max_norm: float | None = MAX_NORM, cfg: GPTConfig = CFG, n: int = BATCH,
              ignore: float = 0.3, reduction: str = "mean",
              autocast_dtype: torch.dtype | None = None) -> dict:
    """One process, the whole batch: ``F.cross_entropy`` (``reduction`` "mean": over the counted
    tokens, ignore_index -100; or "sum"), backward, ``clip_grad_norm_``; with ``autocast_dtype``
    the forward under ``torch.autocast`` and the cross-entropy on fp32 logits. Returns ``{"loss",
    "grad_norm" (before clipping), "grads" (after clipping)}``."""
    torch.manual_seed(0)
    model = GPT(cfg)
    ids, targets = batch(n, cfg, ignore)
    with _autocast(autocast_dtype):
        logits = model(ids)[0].float()
    loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), targets.reshape(-1),
                           reduction=reduction)
    loss.backward()
    norm = None
    if max_norm is not None:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item()
    return {"loss": loss.item(), "grad_norm": norm,
            "grads": {k: p.grad.clone() for k, p in model.named_parameters()}}


def token_groups(dp: int, cp: int = 1, split: str = "zigzag", sp: int = 1):
    """``(b, s) -> [index tensor, ...]``: the tokens of a micro-batch of ``b`` samples (the ``dp``
    replicas' slices, in order) that each rank of a grid holds, in the order it holds them: the
    replica's samples, each at the positions its CP rank holds (``split``; increasing), cut again
    into ``sp`` contiguous pieces with sequence parallelism. The capacity rule of one process
    applied to each group is the grid's, where each rank drops among its own tokens."""
    def groups(b: int, s: int) -> list[torch.Tensor]:
        out, per = [], b // dp
        for d in range(dp):
            rows = torch.arange(d * per, (d + 1) * per)
            for c in range(cp):
                for piece in positions(split, s, cp, c).tensor_split(sp):
                    out.append((rows[:, None] * s + piece[None, :]).reshape(-1))
        return out
    return groups


def moe_reference(moe: dict, dp: int, microbatches: int, max_norm: float | None = MAX_NORM,
                  cfg: GPTConfig = CFG, n: int = BATCH, ignore: float = 0.3,
                  reduction: str = "mean", autocast_dtype: torch.dtype | None = None,
                  groups=None) -> dict:
    """One process with mixture-of-experts blocks (:class:`MoEGPT`, options ``moe``), as
    :func:`reference`, with the aux losses of :mod:`minidist.hybrid.moe`: micro-batch ``m`` is the
    ``m``-th micro-batch of each of the ``dp`` replicas' slices together (the capacity rule applied
    to each replica's part: ``drop_chunks=dp``, or to each group of ``groups``, a
    :func:`token_groups`, with context or sequence parallelism); the loss is the cross-entropy over
    the whole batch plus ``Σ_m (n_m / n)·aux(m)``, one backward. Returns what :func:`reference`
    returns, plus ``"aux_loss"``."""
    torch.manual_seed(0)
    model = (MoEGPT(cfg, **moe, drop_chunks=dp) if groups is None else
             MoEGPT(cfg, **moe, drop_groups=groups))
    ids, targets = batch(n, cfg, ignore)
    parts = [t.tensor_split(dp) for t in (ids, targets)]
    logits, labels, aux = [], [], 0.0
    for m in range(microbatches):
        x = torch.cat([r.tensor_split(microbatches)[m] for r in parts[0]])
        y = torch.cat([r.tensor_split(microbatches)[m] for r in parts[1]])
        with _autocast(autocast_dtype):
            logits.append(model(x)[0].float())
        labels.append(y)
        aux = aux + x.shape[0] / n * model.aux_loss
    logits_all, labels_all = torch.cat(logits), torch.cat(labels)
    loss = F.cross_entropy(logits_all.reshape(-1, cfg.vocab_size), labels_all.reshape(-1),
                           reduction=reduction) + aux
    loss.backward()
    norm = None
    if max_norm is not None:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item()
    return {"loss": loss.item(), "grad_norm": norm, "aux_loss": float(aux.detach()),
            "grads": {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}}


def compare(results: list[dict], ref: dict) -> dict:
    """How far the grid's results are from ``ref``: ``loss`` and ``grad_norm`` (worst relative
    error over ranks), ``grads`` (model-wide relative error ``‖Δ‖/‖ref‖`` of the gathered
    gradients), ``tied`` (largest difference between the tied embedding's two copies' gradients;
    0 when there is no copy), ``replicas`` (largest difference between DP replicas: on the names
    both hold, as EP ranks hold other experts), ``missing`` (GPT names no rank returned)."""
    rel = lambda a, b: abs(a - b) / abs(b)   # noqa: E731
    out = {"loss": max(rel(r["loss"], ref["loss"]) for r in results), "tied": 0.0,
           "replicas": 0.0}
    if ref["grad_norm"] is not None:
        out["grad_norm"] = max(rel(r["grad_norm"], ref["grad_norm"]) for r in results)
    by_place: dict = {}
    got = {}
    for r in results:   # replicas hold the same names (experts: the ones both hold)
        _, p, t = r["coords"]
        other = by_place.setdefault((p, t), r["grads"])
        out["replicas"] = max([out["replicas"]] + [(other[k] - r["grads"][k]).abs().max().item()
                                                   for k in r["grads"] if k in other])
        got.update(r["grads"])
    if "head.weight" not in ref["grads"] and "head.weight" in got:   # the tied copy
        out["tied"] = (got.pop("head.weight") - got["tok_emb.weight"]).abs().max().item()
    out["missing"] = sorted(set(ref["grads"]) - set(got))
    common = [k for k in ref["grads"] if k in got]
    diff = torch.cat([(got[k] - ref["grads"][k]).reshape(-1) for k in common]).norm()
    whole = torch.cat([ref["grads"][k].reshape(-1) for k in common]).norm()
    out["grads"] = (diff / whole).item()
    return out
