"""The expert-parallel section of ``minidist demo``: the MoE layer and EP x DP against one process.

Rows (each ``{"section": "EP", "check", "world_size", "max_error", "ok", "detail"}``):

* the EP layer (E = 4, k = 2, tokens dropped at capacity factor 1.0; W = 2; and E = 8, k = 2,
  dropless; W = 4) against the dense one-process MoE: outputs, input / router / expert gradients;
* the all-to-all bytes of every rank against the formula (count exchange + dispatch + combine);
* 3 AdamW steps of the MoE GPT on a dp 2 x ep 2 grid against one process on the global batch,
  with the replicas bitwise equal.
"""

from __future__ import annotations

from minidist import launch
from .expert_parallel_checks import (TOL, layer_errors, layer_on_ranks, train_errors, train_on_grid,
    train_reference)

__all__ = ["demo_rows"]

LAYERS = [(2, 4, 2, 1.0), (4, 8, 2, None)]     # (W, E, k, capacity factor)


def demo_rows() -> list[dict]:
    rows = []
    for world, E, k, cf in LAYERS:
        res = launch.run(layer_on_ranks, world, E, k, cf, timeout=120)
        err = layer_errors(res, E, k, cf)
        worst = max(err[key] for key in ("out", "xgrad", "router", "experts", "aux"))
        rows.append(dict(check=f"MoE layer E={E} k={k} cf={cf} = dense one process",
                         world_size=world, max_error=worst,
                         ok=worst <= TOL and err["kept"][0] == err["kept"][1] and err["all_experts"],
                         detail=f"out, grads, aux; {err['kept'][0]} rows kept of "
                                f"{world * 10 * k}"))
        rows.append(dict(check="all-to-all bytes per rank = formula", world_size=world,
                         max_error=0.0 if err["bytes_ok"] else 1.0, ok=err["bytes_ok"],
                         detail="8(E-L) + (rows out + rows back) x width x 4, from the counters"))
    res = launch.run(train_on_grid, 4, 2, 2, 4, 2, 1.0, timeout=120)
    err = train_errors(res, train_reference(4, 4, 2, 1.0))
    rows.append(dict(check="MoE GPT dp2 x ep2, 3 AdamW steps = one process", world_size=4,
                     max_error=max(err["params"], err["loss"]),
                     ok=max(err["params"], err["loss"]) <= TOL and err["replicas_equal"],
                     detail="parameters, losses; replicas bitwise equal"))
    for r in rows:
        r["section"] = "EP"
    return rows
