"""Drawings for chapter 06: how a weight matrix is split, where f and g sit in a transformer
block, and which regions sequence parallelism splits along the sequence axis.

Conventions are Megatron-LM's (Shoeybi et al. 2019, §3; Korthikanti et al. 2022, §4.2): the
layer computes ``Y = X A`` with ``A`` of shape ``[in, out]`` (``nn.Linear.weight`` is ``Aᵀ``,
``[out, in]``). *Column-parallel*: ``A`` split by columns, rank r holds ``A_r`` ``[in, out/W]`` and
computes its slice of ``Y``; *row-parallel*: ``A`` split by rows, ``[in/W, out]``, each rank a
partial sum of ``Y``. ``f``: identity forward, all-reduce backward; ``g``: all-reduce forward,
identity backward. With sequence parallelism ``g`` becomes a reduce-scatter along the sequence
and ``f`` an all-gather, and LayerNorm and dropout run on ``s/W`` tokens per rank.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle

__all__ = ["split_shapes", "draw_weight_split", "draw_megatron_block", "draw_sequence_parallel"]


def _sizes(n: int, w: int) -> list[int]:
    return [n // w + (1 if r < n % w else 0) for r in range(w)]  # torch.tensor_split's sizes


def split_shapes(in_features: int, out_features: int, world_size: int, style: str) -> list:
    """Per-rank shapes of ``A`` (``[in, out]``): ``style`` ``"column"`` or ``"row"``."""
    if style == "column":
        return [(in_features, s) for s in _sizes(out_features, world_size)]
    if style == "row":
        return [(s, out_features) for s in _sizes(in_features, world_size)]
    raise ValueError(f"style must be 'column' or 'row', got {style!r}")


def draw_weight_split(in_features: int = 6, out_features: int = 8, world_size: int = 2):
    """Two panels: ``A`` split by columns (column-parallel) and by rows (row-parallel), each
    rank's block coloured and labelled with its shape."""
    cmap = plt.get_cmap("tab10")
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.4), dpi=80)
    for ax, style in zip(axes, ("column", "row")):
        shapes = split_shapes(in_features, out_features, world_size, style)
        offset = 0
        for r, (rows, cols) in enumerate(shapes):
            if style == "column":
                x, y, w, h = offset, 0, cols, in_features
                offset += cols
            else:
                x, y, w, h = 0, in_features - offset - rows, out_features, rows
                offset += rows
            ax.add_patch(Rectangle((x, y), w, h, facecolor=cmap(r), alpha=0.4, edgecolor="black"))
            ax.text(x + w / 2, y + h / 2, f"rank {r}\nA_{r}: [{rows}, {cols}]", ha="center",
                    va="center", fontsize=8)
        ax.set_xlim(-0.5, out_features + 0.5)
        ax.set_ylim(-1.6, in_features + 0.5)
        ax.set_aspect("equal")
        ax.axis("off")
        what = (f"Column-parallel on {world_size} ranks: A split by columns\n"
                "Y_r = X A_r (input replicated, f before)" if style == "column" else
                f"Row-parallel on {world_size} ranks: A split by rows\n"
                "Y = Σ_r X_r A_r (input split, g after)")
        ax.set_title(what, fontsize=9)
        ax.text(out_features / 2, -1.0, f"A: [in={in_features}, out={out_features}] "
                f"(nn.Linear.weight is Aᵀ)", ha="center", fontsize=7)
    return fig


def _flow(ax, items, y, x0=0.0, gap=0.35):
    """Boxes left to right; items are (label, colour, width). Returns their centres."""
    centres, x = [], x0
    for label, colour, w in items:
        ax.add_patch(FancyBboxPatch((x, y - 0.35), w, 0.7, boxstyle="round,pad=0.04",
                                    facecolor=colour, edgecolor="black"))
        ax.text(x + w / 2, y, label, ha="center", va="center", fontsize=7)
        if centres:
            ax.add_patch(FancyArrowPatch((x - gap + 0.02, y), (x - 0.02, y), arrowstyle="-|>",
                                         mutation_scale=8))
        centres.append(x + w / 2)
        x += w + gap
    return centres, x


_F = ("f", "#f7c6c6", 0.5)
_G = ("g", "#c6d8f7", 0.5)


def draw_megatron_block():
    """A transformer block as Megatron-LM splits it: attention and MLP each start with ``f`` and
    end with ``g`` — 2 all-reduces forward (the g's) and 2 backward (the f's) per block."""
    fig, ax = plt.subplots(figsize=(11, 2.9), dpi=80)
    rep, par = "0.9", "#d8f0d0"
    attention = [("LayerNorm", rep, 1.1), _F,
                 ("QKV\ncolumn-parallel\n(heads split)", par, 1.5),
                 ("attention\nper head", par, 1.2), ("out-proj\nrow-parallel", par, 1.3), _G,
                 ("+ residual", rep, 1.0)]
    mlp = [("LayerNorm", rep, 1.1), _F, ("fc1\ncolumn-parallel", par, 1.4), ("GeLU", par, 0.8),
           ("fc2\nrow-parallel", par, 1.3), _G, ("+ residual", rep, 1.0)]
    _flow(ax, attention, 1.3)
    _flow(ax, mlp, 0.0)
    ax.text(-0.2, 1.3, "attention", ha="right", va="center", fontsize=8)
    ax.text(-0.2, 0.0, "MLP", ha="right", va="center", fontsize=8)
    ax.text(0, -0.85, "f: identity forward, all-reduce backward     g: all-reduce forward, "
            "identity backward     green: split across ranks; grey: replicated", fontsize=7)
    ax.set_xlim(-1.2, 10.6)
    ax.set_ylim(-1.1, 1.9)
    ax.axis("off")
    ax.set_title("Megatron-LM transformer block: one f and one g around attention and around "
                 "the MLP", fontsize=9)
    return fig


def draw_sequence_parallel(world_size: int = 2, seq_len: int = 8):
    """Along the sequence axis: in the sequence-parallel regions (LayerNorm, dropout) each rank
    holds ``seq_len/W`` tokens; all-gather enters the tensor-parallel region (every token, hidden
    split), reduce-scatter leaves it."""
    regions = [("LayerNorm + dropout\nsequence-parallel", "seq"), ("all-gather\n(backward:\nreduce-scatter)", None),
               ("attention / MLP\ntensor-parallel", "hidden"), ("reduce-scatter\n(backward:\nall-gather)", None),
               ("LayerNorm + dropout\nsequence-parallel", "seq")]
    cmap = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(10, 0.9 + 0.9 * world_size), dpi=80)
    x = 0.0
    sizes = _sizes(seq_len, world_size)
    for label, kind in regions:
        width = 1.3 if kind is None else 2.2
        ax.text(x + width / 2, world_size + 0.25, label, ha="center", va="bottom", fontsize=7)
        for r in range(world_size):
            y = world_size - 1 - r
            if kind is None:
                ax.add_patch(FancyArrowPatch((x + 0.1, y + 0.45), (x + width - 0.1, y + 0.45),
                                             arrowstyle="-|>", mutation_scale=10))
                continue
            for t in range(seq_len):
                owner = next(k for k in range(world_size) if t < sum(sizes[:k + 1]))
                mine = owner == r if kind == "seq" else True
                ax.add_patch(Rectangle((x + t * width / seq_len, y + 0.1), width / seq_len * 0.95,
                                       0.7, facecolor=cmap(r) if mine else "white",
                                       alpha=0.5 if mine else 1, edgecolor="0.3"))
            note = (f"tokens {sum(sizes[:r])}..{sum(sizes[:r + 1]) - 1}" if kind == "seq"
                    else f"all {seq_len} tokens, hidden/{world_size}")
            ax.text(x + width / 2, y + 0.02, note, ha="center", va="top", fontsize=6)
        x += width + 0.2
    for r in range(world_size):
        ax.text(-0.15, world_size - 1 - r + 0.45, f"rank {r}", ha="right", va="center", fontsize=8)
    ax.set_xlim(-0.9, x)
    ax.set_ylim(-0.4, world_size + 0.9)
    ax.axis("off")
    ax.set_title(f"Sequence parallelism on {world_size} ranks: the sequence axis (left to right "
                 f"within each block, {seq_len} tokens)", fontsize=9)
    return fig
