"""The context-parallel section of ``minidist demo``: ring attention and Ulysses against one process.

One launch of 4 ranks (about 5 s on 2 cores): a causal attention of 2 x 4 heads x 40 positions
(fp32; 40 is not a multiple of 2W = 8, so the zigzag chunks are uneven) computed by ring attention
under the zigzag and the contiguous split and by Ulysses, forward and backward, compared with
:func:`~minidist.context_parallel.blocks.attention_reference` on the whole sequence; the
messages every rank sent against :func:`~minidist.context_parallel.ring.ring_traffic`; the causal
work per rank of both splits (zigzag equal, contiguous not).

``demo_rows()`` returns rows ``{"section": "context parallel", "check", "world_size",
"max_error", "ok", "detail"}``.
"""

from __future__ import annotations

import torch

__all__ = ["demo_rows", "attention_check"]

W, S, SHAPE, TOL = 4, 40, (2, 4, 8), 2e-6 * 4   # fp32: 2e-6·W (see tests/library/context_parallel/test_context_parallel.py)


def _data(seq_len=S, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    b, h, d = SHAPE
    return [torch.randn(b, h, seq_len, d, generator=g, dtype=torch.float64).to(dtype)
            for _ in range(4)]


def attention_check(rank: int, world: int, method: str = "ring", split: str = "zigzag",
                    seq_len: int = S) -> dict:
    """Inside ``minidist.run``: this rank's shard of out/lse/dq/dk/dv and what it sent."""
    from minidist.comm import p2p
    from minidist.context_parallel import ring_attention, shard, ulysses_attention

    q, k, v, do = (shard(t, split, world, rank, dim=2) for t in _data(seq_len))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    fn = ring_attention if method == "ring" else ulysses_attention
    with p2p.count_traffic() as fwd:
        out, lse = fn(q, k, v, split=split, seq_len=seq_len)
    with p2p.count_traffic() as bwd:
        out.backward(do)
    return {"parts": [out.detach(), lse, q.grad, k.grad, v.grad],
            "sent": ((fwd.msgs_sent, fwd.bytes_sent), (bwd.msgs_sent, bwd.bytes_sent))}


def _error(results, split, seq_len=S) -> float:
    from minidist.context_parallel import attention_reference, unshard

    q, k, v, do = (t.double().requires_grad_() if i < 3 else t.double()
                   for i, t in enumerate(_data(seq_len)))
    out, lse = attention_reference(q, k, v)
    out.backward(do)
    ref = [out.detach(), lse.detach(), q.grad, k.grad, v.grad]
    got = [unshard([r["parts"][i] for r in results], split, dim=2) for i in range(5)]
    return max(float((g.double() - r).abs().max()) / max(1.0, float(r.abs().max()))
               for g, r in zip(got, ref))


def _all_checks(rank, world):
    return {(m, s): attention_check(rank, world, m, s)
            for m, s in (("ring", "zigzag"), ("ring", "contiguous"), ("ulysses", "zigzag"))}


def demo_rows() -> list[dict]:
    from minidist import launch
    from minidist.context_parallel import causal_work, ring_traffic

    results = launch.run(_all_checks, W, timeout=120)
    rows = []
    for (method, split) in (("ring", "zigzag"), ("ring", "contiguous"), ("ulysses", "zigzag")):
        per_rank = [r[(method, split)] for r in results]
        err = _error(per_rank, split)
        name = f"{method} attention ({split})" if method == "ring" else "Ulysses all-to-all"
        rows.append({"section": "context parallel", "check": f"{name} = full attention",
                     "world_size": W, "max_error": err, "ok": err <= TOL,
                     "detail": f"out, lse, dq, dk, dv; S={S} (not a multiple of 2W), fp32"})
    b, h, d = SHAPE
    wrong = 0
    for split in ("zigzag", "contiguous"):
        for rank, r in enumerate(results):
            f = ring_traffic(split, S, W, rank, b, h, d, 4)
            wrong += (r[("ring", split)]["sent"] != (f["forward"], f["backward"]))
    msgs = results[0][("ring", "zigzag")]["sent"]
    rows.append({"section": "context parallel", "check": "ring messages and bytes = formula",
                 "world_size": W, "max_error": float(wrong), "ok": wrong == 0,
                 "detail": f"rank 0 sent {msgs[0][0]} messages forward (W-1), {msgs[1][0]} "
                           f"backward (2W-1)"})
    zig, cont = causal_work("zigzag", 8 * W, W), causal_work("contiguous", 8 * W, W)
    ok = len(set(zig)) == 1 and cont[-1] > cont[0]
    rows.append({"section": "context parallel", "check": "causal work per rank: zigzag equal",
                 "world_size": W, "max_error": float(max(zig) - min(zig)), "ok": ok,
                 "detail": f"S={8 * W}: zigzag {zig}, contiguous {cont}"})
    return rows
