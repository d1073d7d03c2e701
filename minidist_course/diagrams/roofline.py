"""A roofline per parallelism (:mod:`minidist_course.planner.roofline`): compute time and
communication time against the size that grows, on log axes, one pair of lines per machine, the
crossover marked — left of it the strategy is communication-bound."""

from __future__ import annotations

import math

from ..planner.roofline import STRATEGIES, crossover, times

__all__ = ["draw_roofline"]


def draw_roofline(strategy: str, machines: dict, sizes=None, ax=None, title: str = ""):
    """``machines``: ``{label: (flop_rate FLOP/s, alpha s, beta s/byte)}`` — e.g. an H100 over
    NVLink, the same over InfiniBand, and this machine's measured rate and gloo link. ``sizes``:
    the x values (default: 16 points from 2⁴ to 2¹⁹). Returns the figure; each machine's
    crossover is marked and listed in the legend."""
    import matplotlib.pyplot as plt

    r = STRATEGIES[strategy]
    sizes = sizes or [2.0 ** k for k in range(4, 20)]
    if ax is None:
        fig, ax = plt.subplots(figsize=(6.5, 3.4), dpi=80)
    else:
        fig = ax.figure
    for i, (label, (flop_rate, alpha, beta)) in enumerate(machines.items()):
        colour = f"C{i}"
        pairs = [times(r, x, flop_rate, alpha, beta) for x in sizes]
        x = crossover(r, flop_rate, alpha, beta)
        where = f"crossover {x:,.0f}" if math.isfinite(x) else "no crossover"
        ax.plot(sizes, [c for c, _ in pairs], "-", color=colour, label=f"{label}: compute")
        ax.plot(sizes, [m for _, m in pairs], "--", color=colour,
                label=f"{label}: communication ({where})")
        if math.isfinite(x) and sizes[0] <= x <= sizes[-1]:
            ax.axvline(x, color=colour, lw=0.8, alpha=0.6)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(r.size_name)
    ax.set_ylabel("seconds")
    ax.legend(fontsize=6, ncol=2)
    ax.set_title(title or f"{strategy.upper()}: compute-bound right of the crossover", fontsize=9)
    fig.tight_layout()
    return fig
