"""``minidist bench two-level``: the planner's prediction of every row of
:mod:`.two_level`'s measurement, the table, and the command.

**The prediction.** Each measured row is a list of collectives (:mod:`minidist_course.planner.
two_level`'s ``Call`` rows: the ring, hierarchical and naive schedules the library runs, and the
all-to-all's size check through torch) priced per link class with alpha-beta: the shaped link
of its class (the topology's numbers) plus this machine's loopback, which every message pays on
top. Loopback is measured in the same run, per group size as the planner's ``group_links``
(:mod:`minidist_course.planner.machine`): alpha and beta per ring step fitted (least squares)
to the ``loopback`` rows (the flat ring over the 4 ranks, no topology) for groups of 4 and to
the ``loopback/2`` rows (both pairs' rings at once) for groups of 2, at every size, in the same
balanced order as the rows they serve — never to the rows they predict. A step adds its compute,
measured in the same run: ``compute`` (the same model's step with no communication; ``tp
compute``, one TP shard's) and, for PowerSGD, ``powersgd arith`` (its hook's time minus its
all-reduces': P = MQ, Gram-Schmidt, error feedback). Nothing overlaps in the model (the shaped
waits are sleeps, so FSDP's prefetch and DDP's comm thread could hide compute behind them; here
compute is 3-20 % of a step). No prediction for ``torch`` (gloo's own algorithm, not shaped) nor
for the inputs (loopback, compute).

**The scores**: the relative error per row (predicted / measured − 1; the goal: within 30 %),
Spearman's rank correlation of predicted and measured times over every predicted row and per
section (:func:`~minidist_course.planner.two_level.rank_correlation`, computed by hand), and the
comparisons the bench is about — at each ratio and size, ring against hierarchical; FSDP against
HSDP; DDP, PowerSGD and DiLoCo; TP and EP inside against across — scored right when the
predicted faster one was measured faster. A comparison the planner calls a tie (its two
predictions within :data:`TIE` of each other) is shown but not scored.

Where it misses (measured here, 2 cores at load 4-8): the 64 KiB rows, whose few milliseconds
are mostly loopback's, and loopback on this machine is a scheduling delay per call as much as a
cost per step, which one alpha per step spreads unevenly over the ring's 6 steps and a pair's 2.
"""

from __future__ import annotations

import argparse
import json
import os

from minidist_course.planner import two_level as P
from minidist_course.planner.machine import load_link
from minidist_course.planner.search import Link
from .collectives import parse_size
from .placement import placed_layout
from .two_level import QUICK, Settings, measure, settings_dict, with_overrides

__all__ = ["FORMAT", "WITHIN", "TIE", "calls_for", "cluster", "predict", "summarize",
           "format_table", "bench_two_level", "main"]

FORMAT = "minidist-bench-two-level/1"
WITHIN = 0.30
TIE = 0.10
WORLD = ((0, 1, 2, 3),)
# the measured compute rows a step's prediction adds: (section, variant) -> variants
COMPUTE = {("sharding", "fsdp"): ("compute",), ("sharding", "hsdp"): ("compute",),
           ("data parallel", "ddp"): ("compute",), ("data parallel", "ddp hierarchical"): ("compute",),
           ("data parallel", "diloco"): ("compute",),
           ("data parallel", "powersgd"): ("compute", "powersgd arith"),
           ("placement", "tp inside"): ("tp compute",), ("placement", "tp across"): ("tp compute",)}


def _mlp_shapes(st: Settings) -> list[tuple]:
    return [(st.width, st.width), (st.width,)] * st.depth


def calls_for(row: dict, st: Settings) -> list | None:
    """The collectives of one measured row (None: a row with no prediction)."""
    sec, v = row["section"], row["variant"]
    psi = st.depth * (st.width * st.width + st.width)
    units = [[st.width * st.width, st.width]] * st.depth
    h = st.tp_hidden
    if sec == "collectives":
        if v not in ("ring", "hierarchical"):
            return None
        return [P.Call("all_reduce", row["bytes"] // 4, WORLD, v)]
    if sec == "sharding":
        return {"fsdp": P.fsdp_calls(units, WORLD),
                "hsdp": P.fsdp_calls(units, [(0, 1), (2, 3)], [(0, 2), (1, 3)])}.get(v)
    if sec == "data parallel":
        return {"ddp": P.ddp_calls([psi], WORLD),
                "ddp hierarchical": P.ddp_calls([psi], WORLD, "hierarchical"),
                "powersgd": P.powersgd_calls(_mlp_shapes(st), st.powersgd_rank, WORLD),
                "diloco": P.diloco_calls(psi, st.diloco_h, WORLD)}.get(v)
    if sec == "placement" and v.split()[-1] in ("inside", "across"):
        kind, where = v.split()
        lay = placed_layout(2, 2, tp_inside=where == "inside")
        if kind == "tp":
            return P.tp_calls(st.tp_tokens, h, 4 * h * h + 3 * h, lay["tp"], lay["dp"])
        return P.ep_calls(st.tp_tokens * st.top_k // 2, h, lay["tp"])
    return None


def cluster(ratio: float, st: Settings, loopback) -> P.Cluster:
    """2 × 2 with the shaped links of ``ratio``; ``loopback`` (a Link or ``{group size: Link}``)
    on every message besides."""
    intra, inter = P.shaped_links(ratio, st.alpha, st.bandwidth)
    return P.Cluster(2, 2, intra, inter, loopback)


LOOPBACK_ROWS = {"loopback": 4, "loopback/2": 2}   # variant -> the size of its groups


def fitted_loopback(rows: list[dict]) -> dict[int, Link]:
    """``{group size: Link}`` fitted to the loopback rows (each size's medians pooled over the
    ratios): 4 from the flat ring over all ranks, 2 from the two pairs' rings at once."""
    by: dict = {}
    for r in rows:
        if r["section"] == "collectives" and r["variant"] in LOOPBACK_ROWS:
            by.setdefault(LOOPBACK_ROWS[r["variant"]], {}).setdefault(r["bytes"], []).append(r["time_s"])
    return {n: P.fit_loopback([(b, n, sorted(t)[len(t) // 2]) for b, t in sizes.items()])
            for n, sizes in by.items() if len(sizes) >= 2}


def predict(rows: list[dict], st: Settings, loopback: Link | None = None) -> tuple[list[dict], dict]:
    """Every row with ``pred_s``, ``error`` (None where no prediction), ``pred_inter`` /
    ``pred_intra`` (bytes per rank, the schedules' exact count), and the loopback links used
    (``{group size: Link}``; ``loopback`` given: that one for every size)."""
    loops = {4: loopback, 2: loopback} if loopback is not None else fitted_loopback(rows)
    measured = {(r["section"], r["variant"]): r["time_s"] for r in rows}
    out = []
    for r in rows:
        calls = calls_for(r, st)
        r = dict(r, pred_s=None, error=None, pred_inter=None, pred_intra=None)
        if calls is not None:
            c = cluster(r["ratio"], st, loops or None)
            base = sum(measured.get((r["section"], v), 0.0)
                       for v in COMPUTE.get((r["section"], r["variant"]), ()))
            r["pred_s"] = P.step_seconds(calls, c, base)
            r["error"] = r["pred_s"] / r["time_s"] - 1
            by = P.step_sent(calls, c)
            r["pred_inter"] = [by.get(g, {}).get("inter", 0.0) for g in range(4)]
            r["pred_intra"] = [by.get(g, {}).get("intra", 0.0) for g in range(4)]
        out.append(r)
    return out, loops


def _comparisons(rows: list[dict]) -> list[dict]:
    """The pairs the bench is about: measured and predicted winner of each."""
    rows = [r for r in rows if r["pred_s"] is not None]
    groups: dict = {}
    for r in rows:
        if r["section"] == "collectives":
            key = f"ratio {r['ratio']:g}, {_size(r['bytes'])}"
        elif r["section"] == "placement":
            key = r["variant"].split()[0].upper() + " placement"
        else:
            key = r["section"]
        groups.setdefault(key, []).append(r)
    out = []
    for key, rs in groups.items():
        for i in range(len(rs)):
            for j in range(i + 1, len(rs)):
                a, b = rs[i], rs[j]
                tie = abs(a["pred_s"] - b["pred_s"]) <= TIE * max(a["pred_s"], b["pred_s"])
                out.append({"group": key, "pair": f"{a['variant']} vs {b['variant']}",
                            "measured_faster": a["variant"] if a["time_s"] < b["time_s"] else b["variant"],
                            "predicted_faster": a["variant"] if a["pred_s"] < b["pred_s"] else b["variant"],
                            "tie": tie})
    for c in out:
        c["right"] = None if c["tie"] else c["measured_faster"] == c["predicted_faster"]
    return out


def summarize(rows: list[dict]) -> dict:
    """Errors within :data:`WITHIN`, Spearman overall and per section, the comparisons."""
    pred = [r for r in rows if r["pred_s"] is not None]
    out = {"rows": len(pred), "within": sum(abs(r["error"]) <= WITHIN for r in pred),
           "median_abs_error": sorted(abs(r["error"]) for r in pred)[len(pred) // 2] if pred else None,
           "spearman": (P.rank_correlation([r["pred_s"] for r in pred], [r["time_s"] for r in pred])
                        if len(pred) > 1 else None), "per_section": {}}
    for sec in dict.fromkeys(r["section"] for r in pred):
        rs = [r for r in pred if r["section"] == sec]
        out["per_section"][sec] = {
            "within": sum(abs(r["error"]) <= WITHIN for r in rs), "rows": len(rs),
            "spearman": (P.rank_correlation([r["pred_s"] for r in rs], [r["time_s"] for r in rs])
                         if len(rs) > 1 else None)}
    comps = _comparisons(rows)
    out["comparisons"] = comps
    scored = [c for c in comps if c["right"] is not None]
    out["order_right"], out["order_scored"] = sum(c["right"] for c in scored), len(scored)
    return out


def _size(n) -> str:
    if n is None:
        return "—"
    return f"{n // (1 << 20)} MiB" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n // 1024} KiB"


def _num(x, scale=1.0, fmt="{:.1f}") -> str:
    return "—" if x is None else fmt.format(x * scale)


def _load() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


def format_table(rows: list[dict], st: Settings, loops: dict, summary: dict,
                 load: float | None = None, load_before: float | None = None) -> str:
    load = _load() if load is None else load
    was = "" if load_before is None else f"{load_before:.2f} before, "
    lines = [
        f"minidist bench two-level: W = 4 as 2 nodes x 2 ranks (software topology); inter link "
        f"{st.alpha * 1e6:g} us, {st.bandwidth / 1e6:g} MB/s; intra = inter made `ratio` times "
        f"faster (alpha / ratio, bandwidth x ratio); steps at ratio {st.step_ratio:g}; "
        f"load average {was}{load:.2f} after on {os.cpu_count()} cores",
        "loopback, added to both classes (fitted on the loopback rows; per ring step): " + (", ".join(
            f"groups of {n}: alpha {k.alpha * 1e3:.2f} ms, "
            f"{_num(1 / k.beta / 1e6 if k.beta else None, fmt='{:.0f}')} MB/s"
            for n, k in sorted(loops.items())) or "none measured (0)"),
        f"{'section':<14}{'variant':<15}{'ratio':>5}{'size':>8}{'measured ms':>12}{'predicted':>10}"
        f"{'error':>7}{'inter B/rank':>13}{'intra B/rank':>13}{'inter B all':>12}"]
    lines.append("-" * len(lines[-1]))
    for r in rows:
        err = "—" if r["error"] is None else f"{r['error']:+.0%}"
        torch_row = r["variant"] == "torch"
        inter = "n/a" if torch_row else f"{max(r['inter']):.0f}"
        intra = "n/a" if torch_row else f"{max(r['intra']):.0f}"
        total = "n/a" if torch_row else f"{sum(r['inter']):.0f}"
        lines.append(f"{r['section']:<14}{r['variant']:<15}{r['ratio']:>5g}{_size(r['bytes']):>8}"
                     f"{r['time_s'] * 1e3:12.1f}{_num(r['pred_s'], 1e3):>10}{err:>7}"
                     f"{inter:>13}{intra:>13}{total:>12}")
    s = summary
    lines += [
        "torch: gloo's dist.all_reduce does not go through minidist's p2p layer, so the shaper never "
        "sees it: a reference for this machine, not for the two-level link (its bytes: n/a). "
        "B/rank: the busiest rank's bytes per call or step (DiLoCo: a round's / "
        f"H = {st.diloco_h}); 'inter B all': summed over the ranks. Inputs, not predicted: "
        "loopback (the flat ring, no topology), loopback/2 (both pairs' rings at once), compute "
        "(the step with no communication), powersgd arith (PowerSGD's hook minus its all-reduces).",
        f"planner: {s['within']} of {s['rows']} rows within {WITHIN:.0%} (median |error| "
        f"{_num(s['median_abs_error'], 100, '{:.0f}')} %), Spearman {_num(s['spearman'], fmt='{:.2f}')}"
        " over every predicted row; per section: " + "; ".join(
            f"{k} {v['within']}/{v['rows']} within, Spearman {_num(v['spearman'], fmt='{:.2f}')}"
            for k, v in s["per_section"].items()),
        f"order: {s['order_right']} of {s['order_scored']} comparisons predicted right"
        + "".join(f"; WRONG {c['group']}: {c['pair']} (measured {c['measured_faster']} faster)"
                  for c in s["comparisons"] if c["right"] is False)
        + (f"; not scored (predicted within {TIE:.0%}): "
           + ", ".join(f"{c['group']} {c['pair']}" for c in s["comparisons"] if c["tie"])
           if any(c["tie"] for c in s["comparisons"]) else "")]
    return "\n".join(lines)


def bench_two_level(st: Settings = Settings(), loopback=None, quiet: bool = False,
                    json_path: str | None = None) -> dict:
    """Measure, predict, print (unless ``quiet``) and return ``{"format", "settings",
    "load_before", "load" (the 1-minute load average before and after), "loopback", "rows",
    "summary"}`` (also written to ``json_path``)."""
    before = _load()
    rows = measure(st)
    rows, loops = predict(rows, st, load_link(loopback) if loopback is not None else None)
    summary = summarize(rows)
    load = _load()
    doc = {"format": FORMAT, "settings": settings_dict(st), "load_before": before, "load": load,
           "loopback": {n: {"alpha": k.alpha, "beta": k.beta} for n, k in loops.items()},
           "rows": rows, "summary": summary}
    if not quiet:
        print(format_table(rows, st, loops, summary, load, before))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(doc, f, indent=1)
    return doc


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="minidist bench two-level", description=(
        "Two nodes x two ranks under the software topology: flat ring vs hierarchical vs torch "
        "all-reduce at beta ratios 1, 4, 16; FSDP vs HSDP; DDP vs PowerSGD vs DiLoCo; TP and EP "
        "inside a node vs across; each row beside the planner's prediction per link class."))
    d = Settings()
    p.add_argument("--ratios", nargs="*", type=float, default=list(d.ratios))
    p.add_argument("--sizes", nargs="*", default=["64K", "1M", "4M"])
    p.add_argument("--alpha", type=float, default=d.alpha, help="inter-node latency, s (1e-4)")
    p.add_argument("--bandwidth", type=float, default=d.bandwidth,
                   help="inter-node bandwidth, bytes/s (2.5e7)")
    p.add_argument("--iters", type=int, default=d.iters, help="collectives: timed calls per row")
    p.add_argument("--steps", type=int, default=d.steps, help="timed steps per step row")
    p.add_argument("--step-ratio", type=float, default=d.step_ratio,
                   help="the ratio of the sharding, data-parallel and placement sections")
    p.add_argument("--diloco-h", type=int, default=d.diloco_h)
    p.add_argument("--sections", nargs="*", default=list(d.sections), choices=list(d.sections))
    p.add_argument("--loopback", help="ALPHA,BETA or an alpha-beta JSON instead of the fit")
    p.add_argument("--quick", action="store_true", help="every section once, tiny, fast links")
    p.add_argument("--json", metavar="PATH", help="write the rows and the summary")
    a = p.parse_args(argv)
    if min(a.iters, a.steps, a.diloco_h) < 1:
        p.error("--iters, --steps and --diloco-h must be >= 1")
    st = QUICK if a.quick else with_overrides(
        d, ratios=tuple(a.ratios), sizes=tuple(parse_size(s) for s in a.sizes), alpha=a.alpha,
        bandwidth=a.bandwidth, iters=a.iters, steps=a.steps, step_ratio=a.step_ratio,
        diloco_h=a.diloco_h, sections=tuple(a.sections))
    loop = None
    if a.loopback:
        parts = a.loopback.split(",")
        loop = tuple(map(float, parts)) if len(parts) == 2 else a.loopback
    bench_two_level(st, loop, json_path=a.json)
    return 0
