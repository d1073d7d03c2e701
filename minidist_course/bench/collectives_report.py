"""The collectives benchmark's report: the nccl-tests-like table with its footer, the control's
noise floor, the alpha-beta quick fit and the busbw plot (the measuring is in ``collectives``)."""

from __future__ import annotations

import torch

from minidist import collectives as C
from minidist.comm import tuner
from .collectives import CONTROL, busbw_factor

__all__ = ["fit_alpha_beta", "format_table", "noise_floor", "plot_busbw"]

_SHORT = {"recursive_doubling": "rd"}   # the auto row's "auto:rd" in the table


def fit_alpha_beta(rows: list[dict]) -> tuple[float, float]:
    """Least-squares fit of ``time_s = alpha + beta · bytes``; returns (alpha in s, beta in s/byte).

    Pass the rows of one (op, algorithm, world size). 1/beta is the asymptotic algbw (bytes/s).
    This is a plain line through one median per size (the table's quick look); the collective's
    own model, repetitions scaled to the size and bootstrap spreads are in
    :mod:`minidist_course.bench.alpha_beta` (``minidist bench alpha-beta``).
    """
    if len(rows) < 2:
        raise ValueError("fit_alpha_beta needs at least two sizes")
    x = torch.tensor([float(r["bytes"]) for r in rows], dtype=torch.float64)
    y = torch.tensor([r["time_s"] for r in rows], dtype=torch.float64)
    a = torch.stack([torch.ones_like(x), x], dim=1)
    alpha, beta = torch.linalg.lstsq(a, y.unsqueeze(1)).solution.squeeze(1).tolist()
    return alpha, beta


def _human(nbytes: int) -> str:
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:g} {unit}"
    return f"{nbytes} B"


def format_table(rows: list[dict]) -> str:
    """The nccl-tests-like table, one line per row, plus an alpha-beta line per group."""
    head = f"{'op':<15}{'algorithm':<19}{'W':>3}{'size':>11}{'time ms':>10}{'algbw GB/s':>12}" \
           f"{'busbw GB/s':>12}{'vs torch':>10}{'of p2p':>8}{'#wrong':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        alg = r["algorithm"] + (":" + _SHORT.get(r["chosen"], r["chosen"]) if "chosen" in r else "")
        lines.append(f"{r['op']:<15}{alg:<19}{r['world_size']:>3}{_human(r['bytes']):>11}"
                     f"{r['time_s'] * 1e3:>10.3f}{r['algbw_GBps']:>12.3f}{r['busbw_GBps']:>12.3f}"
                     f"{r['ratio_to_torch']:>9.2f}x{r.get('of_ceiling', float('nan')):>8.2f}"
                     f"{int(r['wrong']):>8}")
    lines.append("")
    ks = sorted({r["calls_per_sample"] for r in rows if "calls_per_sample" in r})
    if ks:
        lines.append(f"time ms: per call; each measurement times k calls back to back (k = "
                     f"{ks[0]}..{ks[-1]} by size, the same for every algorithm of a size)")
    lines.append("of p2p: the ceiling's time / this time; the ceiling = one isend to the right and one "
                 "irecv from the left per rank of busbw factor x N elements, timed in the same run")
    if any("chosen" in r for r in rows):
        lines.append("auto:X: algorithm='auto' ran X, the lowest predicted time (rd = "
                     "recursive_doubling); table: " + ", ".join(sorted(set(
                         tuner.table().sources.get(r["op"], "default") for r in rows if "chosen" in r))))
    lines += noise_floor_lines(rows)
    groups = {}
    for r in rows:
        groups.setdefault((r["op"], r["algorithm"], r["world_size"]), []).append(r)
    for (op, alg, w), g in groups.items():
        if len(g) >= 2:
            alpha, beta = fit_alpha_beta(g)
            bw = f"{1 / beta / 1e9:.2f} GB/s" if beta > 0 else "n/a"
            lines.append(f"alpha-beta fit {op}/{alg} W={w}: alpha = {alpha * 1e6:.1f} us, "
                         f"1/beta = {bw}")
    return "\n".join(lines)


def noise_floor(rows: list[dict]) -> dict:
    """{(op, W): (lowest, highest)} of the control's ratio to torch over the sizes of one run:
    how far torch's own collective, timed twice, lands from 1.00 (see ``CONTROL``)."""
    spread: dict = {}
    for r in rows:
        if r["algorithm"] == CONTROL and r["ratio_to_torch"] == r["ratio_to_torch"]:
            lo, hi = spread.get((r["op"], r["world_size"]), (float("inf"), 0.0))
            spread[(r["op"], r["world_size"])] = (min(lo, r["ratio_to_torch"]),
                                                   max(hi, r["ratio_to_torch"]))
    return spread


def noise_floor_lines(rows: list[dict]) -> list[str]:
    """The footer's lines on the control (none when the run had no control rows)."""
    spread = noise_floor(rows)
    if not spread:
        return []
    parts = ", ".join(f"{op} W={w}: {lo:.2f}-{hi:.2f}x" for (op, w), (lo, hi) in spread.items())
    return [f"{CONTROL}: torch timed again as a second algorithm; its 'vs torch' over the sizes "
            f"is this run's noise ({parts}): a ratio inside it does not tell an algorithm from "
            "torch"]


def plot_busbw(rows: list[dict], op: str | None = None):
    """busbw against size (log scale), one line per (algorithm, world size); ``auto`` drawn as a
    wide grey band over the others (it should lie on the best one). Returns the Figure."""
    import matplotlib.pyplot as plt

    op = op or rows[0]["op"]
    fig, ax = plt.subplots(figsize=(7, 3.5), dpi=80)
    groups = {}
    for r in rows:
        if r["op"] == op:
            groups.setdefault((r["algorithm"], r["world_size"]), []).append(r)
    for (alg, w), g in sorted(groups.items()):
        g = sorted(g, key=lambda r: r["bytes"])
        style = dict(linewidth=6, alpha=0.3, color="black") if alg == C.AUTO else dict(marker="o")
        ax.plot([r["bytes"] for r in g], [r["busbw_GBps"] for r in g],
                linestyle="--" if alg in ("torch", CONTROL) else "-", label=f"{alg}, W={w}", **style)
    for w in sorted({w for _, w in groups}):  # the point-to-point ceiling of each W, dotted
        g = sorted({r["bytes"]: r for r in rows if r["op"] == op and r["world_size"] == w
                    and r.get("ceiling_s", float("nan")) > 0}.values(), key=lambda r: r["bytes"])
        if g:
            ax.plot([r["bytes"] for r in g], [r["bytes"] / r["ceiling_s"] / 1e9
                                              * busbw_factor(op, w) for r in g],
                    ":", color="gray", label=f"p2p ceiling, W={w}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("busbw (GB/s)")
    ax.set_title(f"{op}: bus bandwidth (nccl-tests definition)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig
