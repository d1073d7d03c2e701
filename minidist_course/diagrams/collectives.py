"""Drawings for chapters 02 and 03: what each collective does, and a ring all-reduce step by step.

* :func:`draw_collective` — one row per rank, its buffer before and after the collective; each cell
  is coloured by the rank its data came from (grey: a reduction over ranks).
* :func:`ring_schedule` — which ranks' contributions every chunk holds on every rank after each step
  of a ring all-reduce (reduce-scatter, then all-gather), computed from the same index rule as
  ``minidist.comm.ring``: at reduce-scatter step s rank r sends chunk (r-s-1) mod W; at all-gather
  step s it sends chunk (r-s) mod W, always to rank r+1.
* :func:`draw_ring_steps` — that schedule as a picture: rows are steps, columns are ranks.

Figures are small on purpose (notebooks commit them as PNG).
"""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, Rectangle

__all__ = ["COLLECTIVES", "collective_layout", "draw_collective", "ring_schedule", "draw_ring_steps"]

COLLECTIVES = ("broadcast", "reduce", "all_reduce", "reduce_scatter", "all_gather", "all_to_all")
_SUM = "sum"


def _cell(src, label):
    return (src, label)  # src: a rank (colour), _SUM (reduced) or None (empty / don't care)


def collective_layout(op: str, world_size: int = 4, root: int = 0):
    """``(before, after)``: for each rank, a list of cells ``(source, label)``.

    ``source`` is the rank whose data the cell holds, ``"sum"`` for a reduction over all ranks, or
    ``None`` for an empty or unspecified cell. Labels: ``x2`` is rank 2's data, ``x2[1]`` its chunk
    1, ``Σ[1]`` the reduction of every rank's chunk 1.
    """
    w = world_size
    if op not in COLLECTIVES:
        raise ValueError(f"op must be one of {COLLECTIVES}, got {op!r}")
    if not 0 <= root < w:
        raise ValueError(f"root must be a rank in 0..{w - 1}, got {root}")
    ranks = range(w)
    if op == "broadcast":
        before = [[_cell(root, f"x{root}") if r == root else _cell(None, "")] for r in ranks]
        after = [[_cell(root, f"x{root}")] for r in ranks]
    elif op == "reduce":
        before = [[_cell(r, f"x{r}")] for r in ranks]
        after = [[_cell(_SUM, "Σ") if r == root else _cell(None, "")] for r in ranks]
    elif op == "all_reduce":
        before = [[_cell(r, f"x{r}")] for r in ranks]
        after = [[_cell(_SUM, "Σ")] for r in ranks]
    elif op == "reduce_scatter":
        before = [[_cell(r, f"x{r}[{j}]") for j in ranks] for r in ranks]
        after = [[_cell(_SUM, f"Σ[{r}]")] for r in ranks]
    elif op == "all_gather":
        before = [[_cell(r, f"x{r}")] for r in ranks]
        after = [[_cell(j, f"x{j}") for j in ranks] for r in ranks]
    else:  # all_to_all: rank r's j-th piece goes to rank j
        before = [[_cell(r, f"{r}→{j}") for j in ranks] for r in ranks]
        after = [[_cell(j, f"{j}→{r}") for j in ranks] for r in ranks]
    return before, after


def _colour(src, w):
    if src is None:
        return "white"
    if src == _SUM:
        return "0.75"
    return plt.get_cmap("tab10")(src % 10)


def _draw_buffers(ax, rows, w, x0, title):
    width = max(len(r) for r in rows)
    ax.text(x0 + width / 2, w + 0.15, title, ha="center", va="bottom", fontsize=9)
    for r, cells in enumerate(rows):
        y = w - 1 - r
        for j, (src, label) in enumerate(cells):
            ax.add_patch(Rectangle((x0 + j, y + 0.1), 0.95, 0.8, facecolor=_colour(src, w),
                                   edgecolor="black", alpha=0.6 if src not in (None, _SUM) else 1))
            ax.text(x0 + j + 0.47, y + 0.5, label, ha="center", va="center", fontsize=7)
    return width


def draw_collective(op: str, world_size: int = 4, root: int = 0, ax=None):
    """Draw ``op`` (one of :data:`COLLECTIVES`) on ``world_size`` ranks: buffers before → after."""
    before, after = collective_layout(op, world_size, root)
    w = world_size
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 0.5 + 0.45 * w), dpi=80)
    wb = _draw_buffers(ax, before, w, 0.8, "before")
    x_after = 0.8 + wb + 1.5
    wa = _draw_buffers(ax, after, w, x_after, "after")
    for r in range(w):
        ax.text(0.6, w - 1 - r + 0.5, f"rank {r}", ha="right", va="center", fontsize=8)
    ax.add_patch(FancyArrowPatch((0.8 + wb + 0.2, w / 2), (x_after - 0.2, w / 2),
                                 arrowstyle="-|>", mutation_scale=15))
    ax.set_xlim(-0.6, x_after + wa + 0.2)
    ax.set_ylim(-0.1, w + 0.6)
    ax.set_title(op.replace("_", "-") + (f" (root {root})" if op in ("broadcast", "reduce") else ""),
                 fontsize=10)
    ax.axis("off")
    return ax.figure


def ring_schedule(world_size: int):
    """Simulate a ring all-reduce's bookkeeping on ``world_size`` ranks.

    Returns a list of steps ``(title, held, sent)``: ``held[r][c]`` is the frozenset of ranks whose
    contribution chunk ``c`` holds on rank ``r`` after the step; ``sent[r]`` is the chunk rank r sent
    to rank r+1 during the step (``None`` for the initial state). After the W-1 reduce-scatter steps
    rank r holds chunk r complete; after the W-1 all-gather steps every rank holds every chunk.
    """
    w = world_size
    if w < 1:
        raise ValueError(f"world_size must be >= 1, got {w}")
    held = [[frozenset([r]) for _ in range(w)] for r in range(w)]
    steps = [("start", [row[:] for row in held], [None] * w)]
    for s in range(w - 1):
        sent = [(r - s - 1) % w for r in range(w)]
        new = [row[:] for row in held]
        for r in range(w):
            c = sent[r]
            new[(r + 1) % w][c] = held[(r + 1) % w][c] | held[r][c]
        held = new
        steps.append((f"reduce-scatter step {s + 1}", [row[:] for row in held], sent))
    for s in range(w - 1):
        sent = [(r - s) % w for r in range(w)]
        new = [row[:] for row in held]
        for r in range(w):
            new[(r + 1) % w][sent[r]] = held[r][sent[r]]
        held = new
        steps.append((f"all-gather step {s + 1}", [row[:] for row in held], sent))
    return steps


def draw_ring_steps(world_size: int = 4, figsize=None):
    """Draw :func:`ring_schedule`: one row per step, one block of W chunks per rank.

    A chunk's shade is how many ranks' contributions it holds (white: 1 of W, dark: all W, marked
    ✓); the chunk each rank sends to its right neighbour in that step has a red outline.
    """
    steps = ring_schedule(world_size)
    w = world_size
    cmap = plt.get_cmap("Blues")
    fig, ax = plt.subplots(figsize=figsize or (7, 0.45 * len(steps) + 0.6), dpi=80)
    for i, (title, held, sent) in enumerate(steps):
        y = len(steps) - 1 - i
        ax.text(-0.3, y + 0.45, title, ha="right", va="center", fontsize=8)
        for r in range(w):
            x0 = r * (w + 1)
            for c in range(w):
                k = len(held[r][c])
                ax.add_patch(Rectangle((x0 + c, y + 0.05), 0.95, 0.8,
                                       facecolor=cmap(0.15 + 0.75 * (k - 1) / max(w - 1, 1)),
                                       edgecolor="red" if sent[r] == c else "black",
                                       linewidth=2 if sent[r] == c else 0.5))
                ax.text(x0 + c + 0.47, y + 0.45, "✓" if k == w else f"{k}", ha="center",
                        va="center", fontsize=7, color="white" if k == w else "black")
    for r in range(w):
        ax.text(r * (w + 1) + w / 2, len(steps) + 0.1, f"rank {r}\nchunks 0..{w - 1}",
                ha="center", va="bottom", fontsize=8)
    ax.set_xlim(-4.5, w * (w + 1))
    ax.set_ylim(-0.2, len(steps) + 1.0)
    ax.axis("off")
    ax.set_title(f"Ring all-reduce on {w} ranks: contributions per chunk (red: sent this step)",
                 fontsize=9)
    return fig
