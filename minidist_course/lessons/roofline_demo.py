"""The machines a chapter's roofline is drawn for: an H100 over NVLink 4 and over InfiniBand NDR
(data-sheet numbers at 50 % of peak, :data:`minidist_course.planner.published.LINKS`), and this
machine, measured in a few seconds (one-thread matmul rate; gloo ring all-reduce α-β on 2 ranks)."""

from __future__ import annotations

from ..bench.alpha_beta_bench import bench_alpha_beta
from ..bench.flops import bench_flops
from ..planner.calc import GPUS
from ..planner.published import LINKS

__all__ = ["machines"]


def machines(measure: bool = True, budget_s: float = 1.0) -> dict:
    """``{label: (flop_rate, alpha, beta)}`` for :func:`~minidist_course.diagrams.draw_roofline`;
    with ``measure``, this machine too (``budget_s`` seconds for each measurement)."""
    half = GPUS["H100-80GB"]["peak_flops"] * 0.5
    out = {"H100, NVLink 4": (half, *LINKS["nvlink4"]), "H100, IB NDR": (half, *LINKS["ib-ndr"])}
    if measure:
        rate = bench_flops(sizes=(256, 512), threads=1, budget_s=budget_s).flops_per_s
        (fit,) = bench_alpha_beta(2, algorithms=("ring",), budget_s=budget_s, n_bootstrap=50)
        out["this machine (1 thread, gloo)"] = (rate, fit.alpha, fit.beta)
    return out
