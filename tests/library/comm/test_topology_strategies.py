"""The strategies over a two-level topology: a DDP whose bucket all-reduces run
``algorithm="hierarchical"`` on its communication thread (sub-groups of the thread's own, made
with it and destroyed with it), ``auto`` picking it when the inter-node link is slow, and the
gradients equal to the flat ring's (fp32, 1e-6 relative: the summation order differs)."""

from __future__ import annotations


import pytest
import torch
from torch import nn

import minidist
from minidist.comm import p2p, topology

from _gloo_threads import HAVE_PROC, gloo_threads


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
    before = gloo_threads() if HAVE_PROC else None
    ring, ring_rows = _ddp_grads("ring", rank)
    hier, hier_rows = _ddp_grads("hierarchical", rank)
    topology.install("2x2:inter=1e-3,2e7")       # a slow inter-node link: auto must see it
    auto, auto_rows = _ddp_grads("auto", rank)
    after = gloo_threads() if before is not None else None
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


def _hybrid(rank, world, configs):
    from minidist_course.matrix.run import _one
    out = []
    for c in configs:
        p2p.reset_traffic()
        res = _one(c)
        res["inter"] = {k: t.bytes_sent_inter for k, t in p2p.traffic().items()}
        out.append(res)
    return out


def test_the_hybrid_step_on_a_two_level_cluster_equals_one_process():
    """The composition under a slow inter-node link (dp 2 x pp 2 on 2 nodes of 2): each of the
    flat, ZeRO-1 and ZeRO-3 modes still equals one process on the global batch (the matrix's own
    check), and the grid's order (tp, cp, pp inside, dp outside) keeps every pipeline message
    inside a node while the DP reductions cross. With one DP rank per node a DP group's
    hierarchical all-reduce is its flat ring, so ``auto`` has nothing to gain there: the
    two-level algorithms pay on groups with several ranks per node (a DDP or FSDP over the
    world, above)."""
    from minidist_course.matrix.covering import covering_array, refusal, world_size
    from minidist_course.matrix.run import check
    base = next(c for c in covering_array(0) if world_size(c) == 4 and refusal(c) is None
                and c["dp"] == 2 and c["precision"] == "fp32" and c["cp"] == "1")
    configs = [{**base, "dp_mode": mode, "schedule": "1f1b", "moe": "none"}
               for mode in ("flat", "zero1", "zero3")]
    assert all(refusal(c) is None and world_size(c) == 4 for c in configs), configs
    with topology.use("2x2:inter=2e-3,1e7"):
        per_rank = minidist.run(_hybrid, 4, configs, timeout=240)
    refs: dict = {}
    for i, c in enumerate(configs):
        status, detail = check(c, [r[i] for r in per_rank], refs)
        assert status == "✓", (c, detail)
        for r in per_rank:   # the grid's order keeps the pipeline inside a node: its sends
            rows = r[i]["inter"]   # never cross; the DP reductions (one rank per node) do
            assert all(v == 0 for k, v in rows.items() if k.startswith("pp/")), rows
            assert sum(v for k, v in rows.items() if not k.startswith("pp/")) > 0, rows


def _grid_groups(rank, world):
    from minidist import collectives as C
    from minidist.grid import ProcessGrid
    before = gloo_threads()
    with ProcessGrid(1, 1, 4) as grid:         # one TP group of 4 over both nodes: 2 + 2
        x = torch.arange(10.0) * (rank + 1)
        two, flat = x.clone(), x.clone()
        C.all_reduce(two, algorithm="hierarchical", group=grid.tp_group)
        C.all_reduce(flat, algorithm="ring", group=grid.tp_group)
        during = gloo_threads()
    after = gloo_threads()          # before the world's own sub-groups are made, below
    # ROCm/rocm-systems#7851 (RCCL): a hierarchical average of integers that divides per level
    # truncates each node's partial sum: ranks [3, 0 | 0, 1] would give (3//2 + 1//2)//2 = 0
    # where the sum's average is 4/4 = 1. minidist refuses an integer average by name (on every
    # algorithm), its integer sum is exact, and a float average divides once, after the last level.
    ints = torch.full((5,), (3, 0, 0, 1)[rank], dtype=torch.int64)
    C.all_reduce(ints, op="sum", algorithm="hierarchical")
    refused = False
    try:
        C.all_reduce(ints.clone(), op="avg", algorithm="hierarchical")
    except TypeError as e:
        refused = "would truncate" in str(e)
    avg = torch.full((5,), (3.0, 0.0, 0.0, 1.0)[rank])
    C.all_reduce(avg, op="avg", algorithm="hierarchical")
    same = (torch.equal(two, flat) and int(ints[0]) == 4 and refused and float(avg[0]) == 1.0)
    return same, before, during, after


@pytest.mark.skipif(not HAVE_PROC, reason="Linux /proc: the thread count")
def test_grid_groups_spanning_nodes_evenly_run_hierarchical_and_close_cleanly():
    with topology.use("2x2"):
        out = minidist.run(_grid_groups, 4, timeout=120)
    for same, before, during, after in out:
        assert same and during > before and after == before, (same, before, during, after)
