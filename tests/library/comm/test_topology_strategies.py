"""The strategies over a two-level topology: a DDP whose bucket all-reduces run
``algorithm="hierarchical"`` on its communication thread (sub-groups of the thread's own, made
with it and destroyed with it), ``auto`` picking it when the inter-node link is slow, and the
gradients equal to the flat ring's (fp32, 1e-6 relative: the summation order differs)."""

from __future__ import annotations

import os

import torch
from torch import nn

import minidist
from minidist.comm import p2p, topology


def _gloo_threads() -> int:
    n = 0
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                n += f.read().strip() == "gloo_tcp_loop"
        except FileNotFoundError:
            pass
    return n


def _ddp_grads(algorithm: str, rank: int) -> tuple[list, object]:
    from minidist.data_parallel import BucketedDDP
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64))
    ddp = BucketedDDP(model, algorithm=algorithm, bucket_cap_mb=0.1)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank))
    p2p.reset_traffic()
    ddp(x).pow(2).mean().backward()
    ddp.sync_gradients() if hasattr(ddp, "sync_gradients") else None
    grads = [p.grad.clone() for p in model.parameters()]
    rows = p2p.traffic()
    ddp.close()
    return grads, rows


def _rank(rank, world):
    before = _gloo_threads() if os.path.isdir("/proc/self/task") else None
    ring, ring_rows = _ddp_grads("ring", rank)
    hier, hier_rows = _ddp_grads("hierarchical", rank)
    topology.install("2x2:inter=1e-3,2e7")       # a slow inter-node link: auto must see it
    auto, auto_rows = _ddp_grads("auto", rank)
    after = _gloo_threads() if before is not None else None
    err = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) for a, b in zip(hier, ring))
    err_auto = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
                   for a, b in zip(auto, ring))
    inter = {name: sum(t.bytes_sent_inter for t in rows.values())
             for name, rows in (("ring", ring_rows), ("hier", hier_rows))}
    return {"err": err, "err_auto": err_auto, "inter": inter,
            "hier_ops": sorted(hier_rows), "auto_ops": sorted(auto_rows),
            "threads": (before, after)}


def test_ddp_buckets_go_hierarchical_on_a_two_level_topology():
    with topology.use("2x2"):          # layout only: both links unshaped
        out = minidist.run(_rank, 4, timeout=120)
    for r, o in enumerate(out):
        assert o["err"] <= 1e-6 and o["err_auto"] <= 1e-6, (r, o["err"], o["err_auto"])
        assert any(k.startswith("all_reduce/hierarchical") for k in o["hier_ops"]), o["hier_ops"]
        assert any(k.startswith("all_reduce/hierarchical") for k in o["auto_ops"]), o["auto_ops"]
    # over all ranks the ring's node-crossing links carry 2(W-1)/W = 3/2 of the buffer per sending
    # rank (two of the four), hierarchical's every rank 2(M-1)/M / L = 1/2: 3 n against 2 n
    ring = sum(o["inter"]["ring"] for o in out)
    hier = sum(o["inter"]["hier"] for o in out)
    assert 0 < hier < ring and abs(hier / ring - 2 / 3) < 0.02, (hier, ring)
    before, after = out[0]["threads"]
    if before is not None:
        assert after == before, out[0]["threads"]   # the threads' sub-groups are destroyed too
