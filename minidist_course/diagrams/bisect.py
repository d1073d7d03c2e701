"""The bisector's picture (chapter 12): every compared tensor × step, coloured by its error over
the budget (:class:`minidist_course.references.bisect.Report`), so the first divergence and what follows from
it are seen at a glance."""

from __future__ import annotations

import math

__all__ = ["draw_divergence"]


def draw_divergence(report, title: str = ""):
    """Rows: the tensors in report order (forward, backward, then the gradients of each module:
    its parameters' worst), each step a column;
    colour: log10(error / budget) clipped to ±4 (white at the budget, red above, blue below; an
    exact match is deep blue). The first divergence is boxed. Returns the figure."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.patches import Rectangle

    steps = sorted({k[0] for k in report.errors})
    worst: dict = {}   # gradients: one row per module (a block, the head, the embeddings)
    for (s, phase, name), err in report.errors.items():
        key = (s, phase, _module(name) if phase == "gradients" else name)
        worst[key] = max(worst.get(key, 0.0), err)
    rows = list(dict.fromkeys((phase, name) for _, phase, name in worst))
    grid = [[min(4.0, max(-4.0, math.log10(max(worst.get((s, p, n), 0.0), 1e-30)
                                           / report.budget))) for s in steps] for p, n in rows]
    fig, ax = plt.subplots(figsize=(3.4 + 1.0 * len(steps), 1.0 + 0.17 * len(rows)), dpi=80)
    image = ax.imshow(grid, aspect="auto", cmap="RdBu_r",
                      norm=TwoSlopeNorm(vcenter=0.0, vmin=-4.0, vmax=4.0))
    ax.set_xticks(range(len(steps)), [f"step {s}" for s in steps])
    ax.set_yticks(range(len(rows)), [f"{p[:4]}  {n}" for p, n in rows], fontsize=6)
    first = report.first
    if first is not None:
        name = _module(first.name) if first.phase == "gradients" else first.name
        y, x = rows.index((first.phase, name)), steps.index(first.step)
        ax.add_patch(Rectangle((x - 0.5, y - 0.5), 1, 1, fill=False, lw=2, ec="black"))
    fig.colorbar(image, ax=ax, label="log10(error / budget), ±4 at most")
    ax.set_title(title or "first divergence boxed", fontsize=9)
    fig.tight_layout()
    return fig


def _module(name: str) -> str:
    """``blocks.3.attn.qkv.weight`` -> ``blocks.3``; ``ln_f.bias`` -> ``ln_f``."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "blocks" else parts[0]
