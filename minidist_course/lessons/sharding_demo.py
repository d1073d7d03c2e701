"""The sharding section of ``minidist demo``: ZeRO-1/2/3 against one process, memory against ZeRO's
formula, and stage 3's 1.5x traffic.

``demo_rows()`` returns rows ``{"section": "sharding", "check", "world_size", "max_error", "ok",
"detail"}``; one launch of 4 ranks, a few seconds.
"""

from __future__ import annotations

import torch

from minidist.comm import p2p
from minidist.launch import run
from minidist.sharding import ShardedOptimizer, account, fully_shard, full_state_dict, zero_formula
from ..references.sharding import Block, local_batch, loss_fn, make_model, max_abs_diff, named_state

__all__ = ["demo_rows"]

WORLD, STEPS, TOL = 4, 5, 1e-6
_KNOWN = dict(frozen=False, vocab=12, dim=8, hidden=16)   # Ψ = 668, every unit divisible by 4


def _train(rank, world, stage, **model_kw):
    model = make_model(**model_kw)
    if stage == 3:
        model = fully_shard(model, auto_wrap=(Block,))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, grads="local",
                               lr=1e-2)
    sent = 0
    for step in range(STEPS):
        opt.zero_grad()
        x, y = local_batch(step, rank, world)
        with p2p.count_traffic() as t:
            loss_fn(model(x), y).backward()
            opt.step()
        sent = t.bytes_sent
    state = full_state_dict(model) if stage == 3 else named_state(model)
    return state, account(model, opt), sent


def _rank(rank, world):
    return {"equal": {s: _train(rank, world, s)[0] for s in (1, 2, 3)},
            "known": {s: _train(rank, world, s, **_KNOWN)[1:] for s in (1, 2, 3)}}


def _single():
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = local_batch(step, 0, 1)
        loss_fn(model(x), y).backward()
        opt.step()
    return named_state(model)


def demo_rows() -> list[dict]:
    res = run(_rank, WORLD, timeout=300)
    single, rows = _single(), []
    for s in (1, 2, 3):
        err = max(max_abs_diff(r["equal"][s], single) for r in res)
        rows.append({"section": "sharding", "check": f"ZeRO-{s} AdamW vs one process",
                     "world_size": WORLD, "max_error": err, "ok": err <= TOL,
                     "detail": f"{STEPS} steps, tied weights, frozen param, "
                               "sizes not divisible by W"})
    for s in (1, 2, 3):
        got = res[0]["known"][s][0]
        want = zero_formula(668, WORLD, s, 8, 4, 4)
        err = max(abs(got[k] - want[k]) for k in ("params", "grads", "optimizer"))
        total = got["params"] + got["grads"] + got["optimizer"]
        rows.append({"section": "sharding", "check": f"ZeRO-{s} memory = formula (bytes)",
                     "world_size": WORLD, "max_error": float(err), "ok": err == 0,
                     "detail": f"{total} B accounted, {want['total']:.0f} B by ZeRO §5 "
                               "(fp32, K=8)"})
    ratio = res[0]["known"][3][1] / res[0]["known"][1][1]
    rows.append({"section": "sharding", "check": "ZeRO-3 traffic / ZeRO-1 traffic",
                 "world_size": WORLD, "max_error": abs(ratio - 1.5), "ok": 1.5 <= ratio < 1.6,
                 "detail": f"{ratio:.3f} (expected 1.5: two all-gathers + a reduce-scatter; "
                           "plus a few bytes of used-flags per parameter)"})
    return rows
