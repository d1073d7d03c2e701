"""Strong and weak scaling of data parallelism, predicted by the planner's alpha-beta model: when is
"near-linear speedup" true?

Per step, every one of W data-parallel devices computes on its share of the batch and then
all-reduces the gradients, which overlap the backward pass (:func:`minidist_course.planner.search.predict`
with ``Config(dp=W, tp=1, pp=1)``: compute 6·N·T/F for T tokens on the device, a ring all-reduce
of 2·N bytes of 16-bit gradients taking ``2(W-1)·α + 2(W-1)/W · 2N · β``, exposed only where it
outlasts the backward).

* **Weak scaling** — the batch *per device* is fixed, the global batch grows with W: ideal step
  time is constant; efficiency ``T(1) / T(W)``.
* **Strong scaling** — the *global* batch is fixed, each device's share shrinks as 1/W: ideal step
  time falls as 1/W; efficiency ``T(1) / (W · T(W))``.

Both are :func:`minidist_course.planner.calc.scaling_efficiency` of the predicted step times. What decides
is the **communication/computation ratio** ``r = t_comm / t_compute``: with N parameters and T
tokens per device, ``t_comm ≈ 4N·β`` and ``t_compute = 6N·T / F``, so ``r ≈ 2βF / (3T)`` — the
model's size cancels; the tokens each device computes per step, the FLOP rate and the link
decide. While the all-reduce fits inside the backward (``r`` below about 2/3 with full overlap),
scaling is near-linear; past it, every further device adds exposed communication. Strong scaling
shrinks T with W, so it always reaches that point; weak scaling keeps T and stays near-linear
until the link changes (more than ``devices_per_node`` devices cross the slower inter-node link).
"""

from __future__ import annotations

import math

from .search import Config, Links, ModelSpec, predict

__all__ = ["dp_scaling", "comm_compute_ratio"]


def comm_compute_ratio(row: dict) -> float:
    """``t_comm / t_compute`` of one :func:`dp_scaling` row (all of the all-reduce, hidden or not)."""
    return row["comm_s"] / row["compute_s"]


def dp_scaling(model: ModelSpec, world_sizes, flop_rate: float, mode: str = "weak",
               batch_per_device: int | None = None, global_batch: int | None = None,
               links: Links = Links(), devices_per_node: int = 8, precision: str = "mixed",
               overlap: float = 1.0) -> list[dict]:
    """Predicted data-parallel step time and scaling efficiency at each world size.

    Args:
        model: the GPT (:class:`~minidist_course.planner.search.ModelSpec`); sequences of
            ``model.seq_len`` tokens.
        world_sizes: the W to predict, ascending, starting at 1 (the reference).
        flop_rate: FLOP/s one device sustains (peak × MFU).
        mode: ``"weak"`` (``batch_per_device`` sequences per device) or ``"strong"``
            (``global_batch`` sequences split over W; W must divide it).
        links, devices_per_node: within a node the intra link, beyond it the inter link.
        precision, overlap: as :func:`~minidist_course.planner.search.predict`.

    Returns:
        one dict per W: ``world_size``, ``batch_per_device``, ``global_batch``, ``step_s``,
        ``compute_s``, ``comm_s`` (the whole all-reduce), ``exposed_s`` (the part not hidden
        behind backward), ``ratio`` (comm / compute), ``samples_per_s``, ``speedup`` (of
        throughput over W = 1) and ``efficiency`` (speedup / W).

    Raises:
        ValueError: an unknown mode, the batch the mode needs missing or not positive, world
            sizes not starting at 1, or (strong) a W that does not divide the global batch.
    """
    sizes = list(world_sizes)
    if mode not in ("weak", "strong"):
        raise ValueError(f"dp_scaling: mode must be 'weak' or 'strong', got {mode!r}")
    if not sizes or sizes[0] != 1 or any(not isinstance(w, int) or w < 1 for w in sizes):
        raise ValueError(f"dp_scaling: world_sizes must be ints >= 1 starting at 1 (the "
                         f"reference), got {sizes}")
    need, value = ("batch_per_device", batch_per_device) if mode == "weak" else \
        ("global_batch", global_batch)
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"dp_scaling: {mode} scaling needs {need} (a positive int), got {value!r}")
    if mode == "strong" and (bad := [w for w in sizes if global_batch % w]):
        raise ValueError(f"dp_scaling: strong scaling splits global_batch={global_batch} over W "
                         f"devices; W = {bad} do not divide it")
    rows = []
    for w in sizes:
        glob = batch_per_device * w if mode == "weak" else global_batch
        q = predict(model, Config(w, 1, 1, 1), glob, flop_rate, math.inf, links,
                    devices_per_node, precision, overlap=overlap)
        rows.append({"world_size": w, "batch_per_device": glob // w, "global_batch": glob,
                     "step_s": q.step_s, "compute_s": q.time["compute"], "comm_s": q.time["dp"],
                     "exposed_s": q.time["exposed"], "samples_per_s": glob / q.step_s})
    base = rows[0]["samples_per_s"]
    for r in rows:
        r["ratio"] = comm_compute_ratio(r)
        r["speedup"] = r["samples_per_s"] / base
        r["efficiency"] = r["speedup"] / r["world_size"]
    return rows
