"""The planner on this machine: ranks are processes sharing C CPU cores, talking over loopback.

A rank computes at the measured single-rank FLOP rate (``minidist bench flops``, 1 thread)
× min(1, C / ranks) — with more ranks than cores they take turns — and its fixed per-layer cost
(Python dispatch, kernel set-up: :func:`calibrate_overhead`) stretches by the same factor. Every
group talks over one link, the measured gloo loopback (``minidist bench alpha-beta``), with no
overlap: the communication thread competes for the same cores. Weights, gradients and
activations are fp32, AdamW keeps two fp32 moments (``precision="fp32"``).

Also here: :func:`load_link` (a link from numbers, a preset, or the alpha-beta JSON) and
:func:`spearman`, to compare a predicted ranking of configurations with a measured one.
Re-exported by :mod:`minidist.plan`.
"""

from __future__ import annotations

import json
import os

from .plan import Config, Link, Links, ModelSpec, Prediction, plan, predict
from .plan_reference import LINKS

__all__ = ["this_machine", "predict_step_seconds", "calibrate_overhead", "load_link", "spearman"]

CPU = dict(precision="fp32", act_bytes=4, overlap=0.0)


def _share(n_ranks: int, cores: int | None) -> float:
    cores = cores or len(os.sched_getaffinity(0))
    return min(1.0, cores / n_ranks)


def this_machine(model: ModelSpec, global_batch: int, n_ranks: int, flop_rate: float, link: Link,
                 cores: int | None = None, memory: float | None = None, layer_overhead: float = 0.0,
                 **kw) -> list[Prediction]:
    """:func:`~minidist.plan.plan` for ``n_ranks`` processes on this machine (module docstring).
    ``cores``: default ``len(os.sched_getaffinity(0))``; ``memory``: bytes per rank, default the
    machine's RAM / ranks; ``layer_overhead``: seconds, single-rank (:func:`calibrate_overhead`).
    ``kw``: plan's options (zero_stages, recompute, interleave, overlap, ...)."""
    share = _share(n_ranks, cores)
    if memory is None:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / n_ranks
    opts = CPU | dict(devices_per_node=n_ranks, layer_overhead=layer_overhead / share) | kw
    return plan(model, global_batch, n_ranks, memory, flop_rate * share, Links(link, link), **opts)


def predict_step_seconds(gpt_config, global_batch: int, n_ranks: int, flop_rate: float, link: Link,
                         cores: int | None = None, **kw) -> dict[Config, float]:
    """{Config: predicted step seconds} of every valid configuration of the capstone's GPT
    (a :class:`~minidist.models.gpt.GPTConfig`) on ``n_ranks`` ranks here; ``kw`` as
    :func:`this_machine` (e.g. ``zero_stages=(0, 1)``, ``layer_overhead=...``). Compare with
    measured step times through :func:`spearman` and the ratio."""
    preds = this_machine(ModelSpec.from_gpt_config(gpt_config), global_batch, n_ranks, flop_rate,
                         link, cores, **kw)
    return {q.config: q.step_s for q in preds}


def calibrate_overhead(model: ModelSpec, global_batch: int, measured_step_s: float, flop_rate: float,
                       microbatches: int = 1, recompute: str = "none") -> float:
    """The ``layer_overhead`` (s) that makes the single-rank prediction (dp = tp = pp = 1,
    ``microbatches``) equal ``measured_step_s``: the step is linear in it, so one measured step
    fixes it; the other configurations are then predicted, not fitted. 0 when the FLOPs alone
    already take longer (the rate is then too low for this model: say so rather than go negative)."""
    if measured_step_s <= 0:
        raise ValueError(f"calibrate_overhead: measured_step_s must be > 0, got {measured_step_s}")
    cfg = Config(1, 1, 1, microbatches, 0, recompute)
    q0, q1 = (predict(model, cfg, global_batch, flop_rate, float("inf"), layer_overhead=x, **CPU)
              for x in (0.0, 1.0))
    return max(0.0, (measured_step_s - q0.step_s) / (q1.step_s - q0.step_s))


def load_link(source, world_size: int | None = None) -> Link:
    """A Link from a Link, (alpha, beta), {"alpha": .., "beta": ..}, a preset name of
    :data:`~minidist.plan_reference.LINKS`, or the JSON file of ``minidist bench alpha-beta``
    (format ``minidist-alpha-beta/1``: its all-reduce fits, torch's first, nearest
    ``world_size``). Raises ValueError for a file without fits."""
    if isinstance(source, Link):
        return source
    if isinstance(source, str) and source in LINKS:
        return Link(*LINKS[source])
    if isinstance(source, (str, os.PathLike)):
        with open(source) as f:
            doc = json.load(f)
        fits = [x for x in doc.get("fits", []) if x.get("op") == "all_reduce"] or doc.get("fits", [])
        if not fits:
            raise ValueError(f"load_link: {source} holds no alpha-beta fits (expected the format "
                             f"minidist-alpha-beta/1 with a 'fits' list)")
        fits.sort(key=lambda x: (x.get("algorithm") != "torch",
                                 abs(x.get("world_size", 0) - (world_size or 0))))
        source = fits[0]
    if isinstance(source, dict):
        return Link(float(source["alpha"]), float(source["beta"]))
    alpha, beta = source
    return Link(float(alpha), float(beta))


def spearman(a, b) -> float:
    """Spearman rank correlation of two equal-length sequences (ties get average ranks), from
    scipy.stats.spearmanr (scipy comes with scikit-learn, a dependency). ValueError if the
    lengths differ or are < 2."""
    if len(a) != len(b) or len(a) < 2:
        raise ValueError(f"spearman: need two sequences of equal length >= 2, got {len(a)} and {len(b)}")
    from scipy.stats import spearmanr
    return float(spearmanr(a, b)[0])
