"""The planner on this machine: ranks are processes sharing C CPU cores, talking over loopback.

A rank computes at the measured single-rank FLOP rate (``minidist bench flops``, 1 thread)
× min(1, C / ranks) — with more ranks than cores they take turns — and its fixed per-layer cost
(Python dispatch, kernel set-up: :func:`calibrate_overhead`) stretches by the same factor. Every
group talks over one link, the measured gloo loopback (``minidist bench alpha-beta``), with no
overlap: the communication thread competes for the same cores. Weights, gradients and
activations are fp32, AdamW keeps two fp32 moments (``precision="fp32"``).

**Contention** (``group_links``, ``bubble_frees_cores``, ``optimizer_s``; all off by default, and
then the model is the one above). Three things the one-link, every-rank-busy model misses on a
machine with fewer cores than ranks:

* every group's collective runs at the same time as the other groups' (a (2, 2, 1) grid runs two
  TP all-reduces of 2 ranks at once, time-sliced on the same cores), so one all-reduce over all W
  ranks is not the link a TP, PP or DP group sees. ``group_links`` = {n: Link measured with all
  W/n groups of n ranks all-reducing at once} (``minidist bench 3d`` measures it): TP uses n = t,
  DP n = d, PP's point-to-point messages n = 2; a size without a measurement falls back to ``link``;
* a pipeline rank waiting in the bubble sleeps in a receive and frees its core, so on average only
  W·m/(m + p - 1) ranks compute (1F1B: each stage is busy m of the m + p - 1 slots); with
  ``bubble_frees_cores`` the share of a core is min(1, C / that) instead of min(1, C / W);
* the optimizer step: ``optimizer_s`` = its measured seconds on one rank holding the whole model
  (the calibration step's). On a tiny model it is per-tensor dispatch, so a rank's takes the
  fraction (layers it holds + 1)/(L + 1) of it, whatever t; all ranks step at once, so it stretches
  by min(1, C / W). :func:`calibrate_overhead` takes it out of the single-rank step first.

Not modelled: the time DP's all-reduce waits for the slowest replica (replicas drift apart on
shared cores; the measured DP time absorbs that skew), TP ranks waiting inside a collective
freeing their core, and the load of other programs. The links are measured inputs, not fits to
the step times the model is checked against.

Also here: :func:`load_link` (a link from numbers, a preset, or the alpha-beta JSON) and
:func:`spearman`, to compare a predicted ranking of configurations with a measured one.
Exported with the rest of the planner by :mod:`minidist_course.planner`.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import os

from .search import Config, Link, Links, ModelSpec, Prediction, plan, predict
from .published import LINKS

__all__ = ["this_machine", "predict_step_seconds", "calibrate_overhead", "load_link", "spearman",
           "busy_ranks", "optimizer_fraction"]

CPU = dict(precision="fp32", act_bytes=4, overlap=0.0)


def _share(n_ranks: int, cores: int | None) -> float:
    cores = cores or len(os.sched_getaffinity(0))
    return min(1.0, cores / n_ranks)


def busy_ranks(n_ranks: int, pp: int, microbatches: int, v: int = 1) -> float:
    """Ranks computing at once, on average, in a 1F1B step: n_ranks · m/(m + (p-1)/v) (each stage
    is busy m of its m + (p-1)/v slots; the rest is the bubble, spent waiting in a receive)."""
    return n_ranks * microbatches / (microbatches + (pp - 1) / v)


def optimizer_fraction(layers: int, pp: int, v: int = 1) -> float:
    """The busiest stage's share of the single-rank optimizer step: (its layers + 1)/(L + 1),
    the per-tensor dispatch cost of a tiny model (the +1: embedding / head / final norm)."""
    lp = min(layers, math.ceil(layers / (pp * v)) * v)
    return (lp + 1) / (layers + 1)


_PREDICT_KW = set(inspect.signature(predict).parameters)


def _contended(q: Prediction, model, global_batch, n_ranks, flop_rate, link, cores, layer_overhead,
               group_links, bubble_frees_cores, optimizer_s, opts) -> Prediction:
    """Re-predict one configuration with the contention terms (module docstring)."""
    c = q.config
    cores = cores or len(os.sched_getaffinity(0))
    busy = busy_ranks(n_ranks, c.pp, c.microbatches, c.v) if bubble_frees_cores else n_ranks
    share = min(1.0, cores / busy)
    kw = {k: v for k, v in (opts | dict(devices_per_node=n_ranks,
                                        layer_overhead=layer_overhead / share)).items()
          if k in _PREDICT_KW}
    links = group_links or {}
    parts = {}
    for term, n in (("tp", c.tp), ("pp", 2), ("dp", c.dp)):
        k = load_link(links.get(n, link))
        parts[term] = predict(model, c, global_batch, flop_rate * share, float("inf"),
                              Links(k, k), **kw).time
    t = dict(parts["tp"])
    t["tp"], t["pp"] = parts["tp"]["tp"], parts["pp"]["pp"]
    t["dp"], t["overlapped"] = parts["dp"]["dp"], parts["dp"]["overlapped"]
    exposed_dp = parts["dp"]["exposed"] - parts["dp"]["tp"] - parts["dp"]["pp"]
    t["optimizer"] = optimizer_s * optimizer_fraction(model.layers, c.pp, c.v) / min(1.0, cores / n_ranks)
    t["exposed"] = t["tp"] + t["pp"] + exposed_dp
    step = t["compute"] + t["bubble"] + t["exposed"] + t["optimizer"]
    return dataclasses.replace(q, time=t, step_s=step, tokens_per_s=global_batch * model.seq_len / step)


def this_machine(model: ModelSpec, global_batch: int, n_ranks: int, flop_rate: float, link: Link,
                 cores: int | None = None, memory: float | None = None, layer_overhead: float = 0.0,
                 group_links: dict | None = None, bubble_frees_cores: bool = False,
                 optimizer_s: float = 0.0, **kw) -> list[Prediction]:
    """:func:`~minidist_course.planner.plan` for ``n_ranks`` processes on this machine (module docstring).
    ``cores``: default ``len(os.sched_getaffinity(0))``; ``memory``: bytes per rank, default the
    machine's RAM / ranks; ``layer_overhead``: seconds, single-rank (:func:`calibrate_overhead`).
    Contention terms (module docstring; default off): ``group_links`` {group size n: Link (or what
    :func:`load_link` reads) of W/n concurrent all-reduces}, ``bubble_frees_cores``,
    ``optimizer_s`` (s, single rank; adds ``time["optimizer"]``).
    ``kw``: plan's options (zero_stages, recompute, interleave, overlap, ...). Sorted fastest first."""
    share = _share(n_ranks, cores)
    if memory is None:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / n_ranks
    if optimizer_s < 0:
        raise ValueError(f"this_machine: optimizer_s must be >= 0 seconds, got {optimizer_s}")
    opts = CPU | dict(devices_per_node=n_ranks, layer_overhead=layer_overhead / share) | kw
    preds = plan(model, global_batch, n_ranks, memory, flop_rate * share, Links(link, link), **opts)
    if not (group_links or bubble_frees_cores or optimizer_s):
        return preds
    preds = [_contended(q, model, global_batch, n_ranks, flop_rate, link, cores, layer_overhead,
                        group_links, bubble_frees_cores, optimizer_s, opts) for q in preds]
    return sorted(preds, key=lambda q: (not q.fits, q.step_s))


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
                       microbatches: int = 1, recompute: str = "none",
                       optimizer_s: float = 0.0) -> float:
    """The ``layer_overhead`` (s) that makes the single-rank prediction (dp = tp = pp = 1,
    ``microbatches``) equal ``measured_step_s``: the step is linear in it, so one measured step
    fixes it; the other configurations are then predicted, not fitted. 0 when the FLOPs alone
    already take longer (the rate is then too low for this model: say so rather than go negative).
    ``optimizer_s``: the same step's optimizer seconds, modelled apart (``this_machine``'s
    ``optimizer_s``), so taken out of ``measured_step_s`` first."""
    if measured_step_s <= 0:
        raise ValueError(f"calibrate_overhead: measured_step_s must be > 0, got {measured_step_s}")
    if not 0 <= optimizer_s < measured_step_s:
        raise ValueError(f"calibrate_overhead: optimizer_s must be in [0, measured_step_s = "
                         f"{measured_step_s}), got {optimizer_s}")
    measured_step_s -= optimizer_s
    cfg = Config(1, 1, 1, microbatches, 0, recompute)
    q0, q1 = (predict(model, cfg, global_batch, flop_rate, float("inf"), layer_overhead=x, **CPU)
              for x in (0.0, 1.0))
    return max(0.0, (measured_step_s - q0.step_s) / (q1.step_s - q0.step_s))


def load_link(source, world_size: int | None = None) -> Link:
    """A Link from a Link, (alpha, beta), {"alpha": .., "beta": ..}, a preset name of
    :data:`~minidist_course.planner.published.LINKS`, or the JSON file of ``minidist bench alpha-beta``
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
