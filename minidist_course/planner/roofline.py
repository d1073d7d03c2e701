"""One roofline per parallelism: compute time against communication time as one size grows, and
the size where they cross — below it the strategy is communication-bound, above it compute-bound
(overlapped communication then hides). In the spirit of the Scaling Book's per-strategy analyses
(Austin et al. 2025, "How to Scale Your Model", the sections on each parallelism); the formulas are
the course's own, in bf16 (2 bytes per element), for one transformer layer or one step:

==========  ===========================  ==============================  =========================
strategy    the size that grows           compute (FLOPs)                 communication
==========  ===========================  ==============================  =========================
``dp``      tokens per GPU per step       6·N·tokens (Kaplan §2.1)        ring all-reduce of 2·N B
``tp``      hidden size h                 72·t·h²/tp per layer (fwd+bwd)  4 all-reduces of 2·t·h B
                                                                          (Shoeybi et al. 2019 §3)
``pp``      hidden size h                 72·t·h²·layers per stage        2 sends of 2·t·h B
``cp``      sequence length per rank s    4·s²·h per ring step (QKᵀ, PV)  one K,V block: 4·s·h B
``ep``      expert FFN size f             4·k·h·f·t (t tokens, 2 matmuls) all-to-all there and back:
                                                                          2·2·k·h·t·(ep-1)/ep B
==========  ===========================  ==============================  =========================

Each time is ``FLOPs / flop_rate`` against α-β: ``messages · α + bytes · β`` (ring collectives as
:func:`minidist_course.planner.calc.comm_time`). Where compute and bytes both grow linearly (DP
with tokens) the crossover is a size; where bytes grow slower than FLOPs (TP, PP in h; CP in s;
EP in f) it is the classic "compute-bound when the size exceeds ≈ β·flop_rate × a constant".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .calc import comm_time

__all__ = ["STRATEGIES", "Roofline", "times", "crossover"]


@dataclass(frozen=True)
class Roofline:
    """``strategy``; ``size_name`` (the x axis); the fixed shape: ``params`` (DP), ``tokens`` t
    (TP, PP), ``hidden`` h (CP, EP), ``ways`` (dp, tp, cp or ep degree), ``layers`` per stage
    (PP), ``top_k`` (EP)."""

    strategy: str
    size_name: str
    params: float = 1.3e9
    tokens: int = 8192
    hidden: int = 4096
    ways: int = 8
    layers: int = 4
    top_k: int = 2


STRATEGIES = {
    "dp": Roofline("dp", "tokens per GPU per step", ways=64),
    "tp": Roofline("tp", "hidden size h"),
    "pp": Roofline("pp", "hidden size h"),
    "cp": Roofline("cp", "sequence length per rank"),
    "ep": Roofline("ep", "expert FFN size"),
}


def times(r: Roofline, size: float, flop_rate: float, alpha: float, beta: float) -> tuple[float, float]:
    """``(compute_s, comm_s)`` of ``r`` at ``size`` on a device of ``flop_rate`` FLOP/s and a
    link of latency ``alpha`` (s) and ``beta`` (s/byte)."""
    if r.strategy == "dp":
        return (6 * r.params * size / flop_rate,
                comm_time("all_reduce", 2 * r.params, r.ways, alpha, beta))
    if r.strategy == "tp":
        return (72 * r.tokens * size ** 2 / r.ways / flop_rate,
                4 * comm_time("all_reduce", 2 * r.tokens * size, r.ways, alpha, beta))
    if r.strategy == "pp":
        return (72 * r.tokens * size ** 2 * r.layers / flop_rate,
                2 * (alpha + 2 * r.tokens * size * beta))
    if r.strategy == "cp":
        return 4 * size ** 2 * r.hidden / flop_rate, alpha + 4 * size * r.hidden * beta
    if r.strategy == "ep":   # t tokens: two all-to-alls (dispatch, combine) of k·h values each
        moved = 2 * 2 * r.top_k * r.hidden * r.tokens * (r.ways - 1) / r.ways
        return (4 * r.top_k * r.hidden * size * r.tokens / flop_rate,
                2 * alpha * (r.ways - 1) + moved * beta)
    raise ValueError(f"roofline: strategy must be one of {sorted(STRATEGIES)}, got {r.strategy!r}")


def crossover(r: Roofline, flop_rate: float, alpha: float, beta: float,
              lo: float = 1.0, hi: float = 1e12) -> float:
    """The size where compute time equals communication time (bisection on a log scale; the
    compute side grows faster in every strategy). ``math.inf`` when communication still wins at
    ``hi``; ``lo`` when compute already wins there."""
    def gap(x):
        c, m = times(r, x, flop_rate, alpha, beta)
        return c - m
    if gap(hi) < 0:
        return math.inf
    if gap(lo) >= 0:
        return lo
    a, b = math.log(lo), math.log(hi)
    for _ in range(200):
        mid = (a + b) / 2
        a, b = (mid, b) if gap(math.exp(mid)) < 0 else (a, mid)
    return math.exp(b)
