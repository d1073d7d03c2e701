"""Run the composition matrix: each configuration of :mod:`.covering` trains one step of the tiny
GPT through :func:`minidist.hybrid.train_step` and is compared with one process on the global
batch (:mod:`minidist_course.references.hybrid`), or must be refused naming both features.

One launch per world size runs that size's configurations in turn, at most :data:`PER_LAUNCH`
per launch (each builds its own :class:`~minidist.grid.ProcessGrid`): a handful of launches. A configuration is

* ``✓`` — it ran and the loss and the gradient norm are within :data:`TOL` (relative) of one
  process (with experts: the one process of :func:`~minidist_course.references.hybrid.moe_reference`,
  whose aux losses are per micro-batch), the gathered (clipped) gradients within :data:`TOL` model-wide, every parameter
  covered, and DP/CP replicas and the tied embedding's two copies bitwise equal;
* ``refused`` — :data:`~.covering.REFUSED` says it must be, and every rank raised ``ValueError``
  containing the words listed there (the two features), before the step;
* ``✗`` — anything else: a difference beyond the tolerance, a refusal that should not happen or
  does not name the features, a missing refusal.

Tolerance: fp32, one step, clipping active (max norm 0.25): the shards sum in another order than
one process, measured up to 1e-6 relative (as the 3-D tests).
"""

from __future__ import annotations

import dataclasses
import time

import torch

import minidist
from minidist.grid import ProcessGrid
from minidist.hybrid import HybridGPT, make_optimizer, train_step, wrap_stages
from minidist.models.gpt import GPTConfig
from minidist.sharding import close_units

from ..references import hybrid as ref_hybrid
from .covering import DIMENSIONS, PP, cp_size, ep_size, pairs_of, refusal, world_size

__all__ = ["TOL", "TOL_BF16", "MOE", "build", "moe_options", "run_matrix", "check", "summarise",
           "release"]

TOL = 1e-6
PER_LAUNCH = 30        # configurations per launch: a launch's timeout covers all of them
BATCH = 14             # dp = 2: 7 samples per replica: 4 or 6 micro-batches, ragged (2,2,2,1)
TOL_BF16 = 3e-2        # bf16 autocast: see the module docstring
# the mixture of experts of the "moe" values: top-2 of 4 experts, both aux losses on (so their
# gradients through the pipeline are checked); "ep2/drop" adds a capacity that drops tokens
MOE = dict(num_experts=4, top_k=2, aux_loss_coeff=1e-2, z_loss_coeff=1e-3)


def moe_options(config) -> dict | None:
    """``HybridGPT``'s ``moe=`` for a configuration (None: dense MLPs)."""
    if config["moe"] == "none":
        return None
    return {**MOE, "capacity_factor": 1.0} if config["moe"] == "ep2/drop" else dict(MOE)


def _token_groups(config):
    """The ranks' token groups a capacity applies to (:func:`~..references.hybrid.token_groups`)."""
    _, _, split = config["cp"].partition("/")
    return ref_hybrid.token_groups(config["dp"], cp_size(config), split or "zigzag",
                                   2 if config["tp"] == "2+sp" else 1)


def _cfg(config) -> GPTConfig:
    return GPTConfig(**{**vars(ref_hybrid.CFG), "tie_embeddings": config["tie"]})


def _ignore(config) -> float:
    return 0.3 if config["loss"] == "per_token" else 0.0   # "mean" over shards needs none ignored


def build(config, seed: int = 0, dropout: float = 0.0) -> HybridGPT:
    """The tiny GPT of one configuration on its grid (this rank's stages); raises the library's
    ``ValueError`` for a refused one."""
    tp = 1 if config["tp"] == "1" else 2
    chunks = 2 if config["schedule"] in ("interleaved", "zb-v", "dualpipe-v") else 1
    placement = "v" if config["schedule"] in ("zb-v", "dualpipe-v") else "loop"
    attention, _, split = config["cp"].partition("/")   # "ring/zigzag", "ulysses" (zigzag)
    grid = ProcessGrid(config["dp"], PP, tp, cp=cp_size(config), ep=ep_size(config))
    cfg = dataclasses.replace(_cfg(config), dropout=dropout)
    return HybridGPT(cfg, grid, chunks=chunks, sequence_parallel=config["tp"] == "2+sp",
                     seed=seed, placement=placement, recompute=config["recompute"],
                     cp_attention="ulysses" if attention == "ulysses" else "ring",
                     cp_split=split or "zigzag", moe=moe_options(config))


def _autocast_dtype(config) -> torch.dtype | None:
    return torch.bfloat16 if config["precision"] == "bf16" else None


def release(model, modules, opt) -> None:
    """Close what one configuration built, then its grid's process groups: the wrappers' and the
    sharded optimizer's communication threads first. Without it a launch's groups and threads pile
    up and each configuration runs slower than the last (the 8-rank launches of the 3-wise array:
    2 s a configuration at the start, 25 s after thirty)."""
    for m in modules.values():
        if hasattr(m, "close"):
            m.close()
        elif isinstance(m, torch.nn.Module):
            close_units(m)     # ZeRO-3 / HSDP stages: their comm thread's groups
    if hasattr(opt, "close"):
        opt.close()            # ZeRO-1/2: the sharded optimizer's comm thread
    model.grid.close()


def _one(config) -> dict:
    """This rank's part of one configuration (runs on every rank of a launch of its world size)."""
    model = None
    try:
        model = build(config)
        grid = model.grid
        modules = wrap_stages(model, config["dp_mode"])
        opt = (make_optimizer(model, config["dp_mode"], torch.optim.SGD, lr=0.0)
               if config["dp_mode"] in ("zero1", "zero2") else None)
        ids, targets = ref_hybrid.batch(BATCH, _cfg(config), _ignore(config))
        out = train_step(model, opt, modules, ids, targets, config["microbatches"],
                         schedule=config["schedule"], dp_mode=config["dp_mode"],
                         loss_reduction=config["loss"], max_norm=ref_hybrid.MAX_NORM, step=False,
                         autocast_dtype=_autocast_dtype(config))
    except ValueError as e:
        if model is not None:
            model.grid.close()
        return {"refused": str(e)}
    if opt is not None:
        opt.full_gradients_()
    result = {"coords": (grid.dp_rank * grid.cp_size + grid.cp_rank, grid.pp_rank, grid.tp_rank),
              "loss": out.loss, "grad_norm": out.grad_norm, "grads": model.gather(grads=True)}
    release(model, modules, opt)
    return result


def _rank(rank, world, configs):
    return [_one(c) for c in configs]


def check(config: dict, results: list[dict], refs: dict) -> tuple[str, str]:
    """``("✓" | "refused" | "✗", detail)`` for one configuration's per-rank results."""
    words = refusal(config)
    refused = [r["refused"] for r in results if "refused" in r]
    if words is not None:
        if len(refused) != len(results):
            return "✗", f"should be refused (naming {' and '.join(words)}) on every rank"
        bad = [m for m in refused if not all(w in m for w in words)]
        return ("✗", f"refusal does not name {words}: {bad[0]}") if bad else ("refused", refused[0])
    if refused:
        return "✗", f"refused, but should run: {refused[0]}"
    moe = moe_options(config)
    groups = _token_groups(config) if moe is not None and "capacity_factor" in moe else None
    key = (config["tie"], config["loss"], config["precision"]) + (
        (config["moe"], config["dp"], config["microbatches"]) if moe else ()) + (
        (config["cp"], config["tp"]) if groups is not None else ())
    if key not in refs:
        reduction = "sum" if config["loss"] == "sum" else "mean"
        dtype = _autocast_dtype(config)
        refs[key] = (ref_hybrid.reference(ref_hybrid.MAX_NORM, _cfg(config), BATCH,
                                          _ignore(config), reduction, dtype) if moe is None else
                     ref_hybrid.moe_reference(moe, config["dp"], config["microbatches"],
                                              ref_hybrid.MAX_NORM, _cfg(config), BATCH,
                                              _ignore(config), reduction, dtype, groups))
    err = ref_hybrid.compare(results, refs[key])
    worst = max(err["loss"], err["grad_norm"], err["grads"])
    detail = f"loss {err['loss']:.1e}, norm {err['grad_norm']:.1e}, grads {err['grads']:.1e}"
    if err["missing"]:
        return "✗", f"no rank returned {err['missing'][:3]}"
    if worst > (TOL if config["precision"] == "fp32" else TOL_BF16) or err["replicas"] > 0 or err["tied"] > 0:
        return "✗", detail + f", replicas {err['replicas']:.1e}, tied {err['tied']:.1e}"
    return "✓", detail


def run_matrix(configs: list[dict], timeout: float = 600, progress=None) -> list[dict]:
    """Run ``configs`` (one launch per world size); each row is the config plus ``"world"``,
    ``"status"``, ``"detail"``. ``progress(text)`` is called after each launch."""
    by_world: dict[int, list[dict]] = {}
    for c in configs:
        by_world.setdefault(world_size(c), []).append(c)
    rows, refs = [], {}
    launches = [(w, by_world[w][i:i + PER_LAUNCH]) for w in sorted(by_world)
                for i in range(0, len(by_world[w]), PER_LAUNCH)]
    for w, todo in launches:
        start = time.perf_counter()
        per_rank = minidist.run(_rank, w, todo, timeout=timeout)
        for i, c in enumerate(todo):
            status, detail = check(c, [r[i] for r in per_rank], refs)
            rows.append({**c, "world": w, "status": status, "detail": detail})
        if progress:
            progress(f"W={w}: {len(todo)} configurations in {time.perf_counter() - start:.0f} s")
    return rows


def summarise(rows: list[dict]) -> dict:
    """Per pair of values held by some row: ``"✗"`` if a configuration that holds it failed,
    else ``"✓"`` if one ran correctly, else ``"refused"`` (checked refused). Returns
    ``{"pairs": {pair: status}, "failed": rows with ✗, "dimensions": names}``."""
    seen: dict = {}
    for r in rows:
        for p in pairs_of(r):
            seen.setdefault(p, set()).add(r["status"])
    pairs = {p: next(s for s in ("✗", "✓", "refused") if s in got) for p, got in seen.items()}
    return {"pairs": pairs, "failed": [r for r in rows if r["status"] == "✗"],
            "dimensions": list(DIMENSIONS)}
