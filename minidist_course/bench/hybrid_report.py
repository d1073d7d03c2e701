"""The report of ``minidist bench 3d`` (:mod:`.hybrid`): per world size, how well the planner's
predicted step times match the measured ones — the fraction within 30% (ratio measured/predicted in
[0.7, 1.3]), Spearman's rank correlation (:func:`minidist_course.planner.spearman`: does it order the
configurations right, whatever the absolute error?) and whether the fastest and the slowest
configuration agree — and the table that prints it.
"""

from __future__ import annotations

__all__ = ["summarize", "format_table", "KINDS"]

KINDS = ("predicted", "calibrated", "contended")   # the predictions a row may hold


def summarize(rows: list[dict]) -> dict:
    """Per world size and prediction: fraction within 30%, Spearman, best/worst agreement."""
    from ..planner.machine import spearman
    out = {}
    for w in sorted({r["world_size"] for r in rows}):
        mine = [r for r in rows if r["world_size"] == w]
        measured = [r["measured_s"] for r in mine]
        name_of = [(r["dp"], r["tp"], r["pp"]) for r in mine]
        out[w] = {}
        for name in KINDS:
            if name not in mine[0]:
                continue
            pred = [r[name]["step_s"] for r in mine]
            rho = spearman(pred, measured) if len(mine) >= 2 else float("nan")
            best = (name_of[measured.index(min(measured))], name_of[pred.index(min(pred))])
            worst = (name_of[measured.index(max(measured))], name_of[pred.index(max(pred))])
            out[w][name] = dict(within=sum(r[name]["within"] for r in mine) / len(mine),
                                spearman=rho, best_measured=best[0], best_predicted=best[1],
                                best_agree=best[0] == best[1], worst_measured=worst[0],
                                worst_predicted=worst[1], worst_agree=worst[0] == worst[1])
    return out


def format_table(result: dict) -> str:
    """The predicted-vs-measured table and the per-world-size summary lines."""
    preds = [p for p in KINDS if result["rows"] and p in result["rows"][0]]
    head = (f"{'W':>3}{'dp':>4}{'tp':>4}{'pp':>4}{'M':>3}{'measured ms':>13}{'[min, max]':>16}"
            f"{'tok/s':>9}{'MFU':>7}" + "".join(f"{p + ' ms':>15}{'ratio':>7}{'≤30%':>6}"
                                                   for p in preds))
    lines = [head, "-" * len(head)]
    for r in result["rows"]:
        spread = f"[{r['min_s'] * 1e3:.0f}, {r['max_s'] * 1e3:.0f}]"
        line = (f"{r['world_size']:>3}{r['dp']:>4}{r['tp']:>4}{r['pp']:>4}{r['microbatches']:>3}"
                f"{r['measured_s'] * 1e3:>13.1f}{spread:>16}"
                f"{r['tokens_per_s']:>9.0f}{r['mfu']:>7.1%}")
        for p in preds:
            line += (f"{r[p]['step_s'] * 1e3:>15.1f}{r[p]['ratio']:>7.2f}"
                     f"{'yes' if r[p]['within'] else 'no':>6}")
        lines.append(line)
    lines.append("ratio = measured / predicted; MFU peak = one-thread matmul rate x min(ranks, cores)")
    for w, by in result["summary"].items():
        for p, s in by.items():
            lines.append(f"W={w} {p:<10}: {s['within']:.0%} within 30%, Spearman {s['spearman']:+.2f}; "
                         f"fastest measured {s['best_measured']} predicted {s['best_predicted']} "
                         f"({'agree' if s['best_agree'] else 'differ'}); slowest measured "
                         f"{s['worst_measured']} predicted {s['worst_predicted']} "
                         f"({'agree' if s['worst_agree'] else 'differ'})")
    lines += _breakdown(result["rows"])
    m = result["machine"]
    links = ", ".join(f"W={w}: {k['alpha'] * 1e6:.0f} us, {1e-9 / max(k['beta'], 1e-30):.2f} GB/s"
                      for w, k in result["link"].items())
    groups = "; ".join(f"W={w}: " + ", ".join(f"n={n} {k['alpha'] * 1e6:.0f} us "
                                               + (f"{1e-9 / k['beta']:.2f} GB/s" if k["beta"] > 0
                                                  else "beta 0")
                                               for n, k in g.items())
                       for w, g in result.get("group_links", {}).items())
    if groups:
        lines.append(f"contended: all W/n groups of n at once, ring alpha, 1/beta {groups}; optimizer "
                     f"{result['optimizer_s'] * 1e3:.1f} ms (1 rank); layer overhead "
                     f"{result['contended_layer_overhead'] * 1e6:.0f} us")
    lines.append(f"flop rate {result['flop_rate'] / 1e9:.2f} GFLOP/s (1 thread); ring alpha, 1/beta "
                 f"{links}; layer overhead {result['layer_overhead'] * 1e6:.0f} us; "
                 f"{result['cores']} cores, load average {m.get('loadavg_1_5_15')}")
    return "\n".join(lines)


def _breakdown(rows: list[dict]) -> list[str]:
    """Measured seconds per kind (the slowest rank's) beside the planner's terms, when recorded."""
    rows = [r for r in rows if "measured_parts" in r]
    if not rows:
        return []
    pred = next(k for k in KINDS[::-1] if k in rows[0])
    lines = [f"where the time goes, ms: measured (the slowest rank per kind, one recorded step) "
             f"[{pred}]; PP includes waiting for other stages, so it is set against PP + bubble",
             f"{'W':>3}{'dp':>4}{'tp':>4}{'pp':>4}" + "".join(f"{k:>16}" for k in
                                                           ("compute", "TP", "PP + bubble", "DP", "other"))]
    for r in rows:
        got, want = r["measured_parts"], r[pred]["parts"]
        pairs = [(got["compute"], want["compute"]), (got["tp"], want["tp"]),
                 (got["pp"], want["pp"] + want["bubble"]), (got["dp"], want["dp"]), (got["other"], None)]
        cells = [f"{a * 1e3:.0f} [{'-' if b is None else f'{b * 1e3:.0f}'}]" for a, b in pairs]
        lines.append(f"{r['world_size']:>3}{r['dp']:>4}{r['tp']:>4}{r['pp']:>4}"
                     + "".join(f"{c:>16}" for c in cells))
    return lines
