"""``minidist bench two-level`` — the two-level cluster measured: which algorithm, which sharding,
which compression and which placement the slow link between nodes favours, and whether the
planner, given the two link classes, predicts it.

Everything runs on W = 4 ranks as 2 nodes × 2 ranks under the software topology
(:mod:`minidist.comm.topology`): the inter-node link is ``alpha`` (100 µs) and ``bandwidth``
(25 MB/s, about the 200 Mbit/s of the kernel-shaped veths of ``tools/two-node-links.sh``); the
intra-node link is that link made ``ratio`` times faster in both terms (alpha / ratio,
bandwidth × ratio), ratio ∈ {1, 4, 16} = beta_inter / beta_intra. Why both shaped, rather than
intra unshaped and inter = loopback / ratio: loopback is not one number on a shared 2-core
machine (its cost per step moves with the load), so a ratio against it would not be the ratio
stated; shaping both classes makes the ratio exact, ratio 1 an honest one-level cluster (the
control), and loopback a cost every message pays on top of either class, which the planner
takes from this run's own measurement. 25 MB/s is slow enough that the shaped part dominates
loopback's (about 2-3 ms per ring step here under load) at the large sizes.

Sections (one launch; each timed in a balanced order, :func:`.collectives.balanced_order`, every
measurement from a barrier, a measurement's time the slowest rank's, medians reported):

1. **collectives**: all-reduce of 64 KiB, 1 MiB, 4 MiB by the flat ring, the hierarchical
   algorithm, torch's ``dist.all_reduce``, and two rows of loopback, the flat ring with no
   topology — ``loopback`` over the 4 ranks, ``loopback/2`` on both pairs [0, 1], [2, 3] at once
   (what this machine's loopback costs; the planner's loopback links are fitted to them). torch's
   collectives do not go through minidist's p2p layer, so the shaper never sees them: torch's row
   is the machine's reference, not a measurement of the two-level link, at every ratio;
2. **sharding** (at ``step_ratio``, 16): an MLP of ``depth`` Linear(width, width)+ReLU blocks,
   each an FSDP unit, ``fully_shard`` over the 4 ranks (one shard group spanning both nodes)
   against HSDP (``hsdp_mesh(2, 2)``: shard inside a node, replicate across), all collectives the
   ring; ``compute``: the same model's step with no communication (the planner's compute input);
3. **data parallel** (same MLP and ratio): ``BucketedDDP`` (one bucket, ring) against PowerSGD
   (rank ``powersgd_rank``, compressing from the first step) and DiLoCo (H = ``diloco_h`` inner
   SGD steps per outer step; its time and bytes are a round's / H), all over the flat ring;
   ``powersgd arith``: PowerSGD's own compute per step, its hook's time minus its all-reduces';
4. **placement** (same ratio): dp 2 × tp 2 with TP inside a node (the grid's order) and across
   nodes (:mod:`.placement`'s renumbering): a Megatron MLP step (hidden ``tp_hidden``,
   ``tp_tokens`` tokens) and the DP all-reduce of its gradients; and an expert-parallel exchange
   over a 2-rank group inside a node and across: 4 all-to-alls (dispatch and combine, forward and
   backward) of ``tp_tokens · top_k / 2`` rows of ``tp_hidden`` to the peer.

Bytes per rank and link class come from the p2p counters of one measured call or step
(``bytes_sent_inter`` / ``bytes_sent_intra``). The predictions, the table and the command are
:mod:`.two_level_report`'s.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist
from torch import nn

from minidist.comm import p2p, topology
from .collectives import balanced_order

__all__ = ["Settings", "QUICK", "COLLECTIVE_VARIANTS", "measure", "topology_spec"]

KIB, MIB = 1 << 10, 1 << 20
COLLECTIVE_VARIANTS = ("ring", "hierarchical", "torch", "loopback", "loopback/2")
SECTION_ORDER = ("collectives", "sharding", "data parallel", "placement")


@dataclass(frozen=True)
class Settings:
    """What one run measures (module docstring)."""

    ratios: tuple = (1, 4, 16)
    sizes: tuple = (64 * KIB, MIB, 4 * MIB)
    alpha: float = 1e-4
    bandwidth: float = 2.5e7
    iters: int = 5
    steps: int = 5
    warmup: int = 1
    step_ratio: float = 16
    width: int = 512
    depth: int = 2
    batch: int = 16
    powersgd_rank: int = 2
    diloco_h: int = 8
    tp_hidden: int = 64
    tp_tokens: int = 2048
    top_k: int = 2
    sections: tuple = ("collectives", "sharding", "data parallel", "placement")


# every section once, small and on fast links: what the default test tier can afford
QUICK = Settings(ratios=(1, 16), sizes=(4 * KIB, 64 * KIB), alpha=1e-5, bandwidth=1e9, iters=1,
                 steps=1, warmup=0, width=64, depth=2, batch=4, diloco_h=2, tp_hidden=16,
                 tp_tokens=64)


def topology_spec(ratio: float, st: Settings) -> str:
    """The ``$MINIDIST_TOPOLOGY`` of one ratio: 2 × 2, inter (alpha, bandwidth), intra both
    ``ratio`` times better."""
    return topology.Topology(2, 2, inter=topology.Link(st.alpha, st.bandwidth),
                             intra=topology.Link(st.alpha / ratio, st.bandwidth * ratio)).spec()


def _timed(fn) -> tuple[float, p2p.Traffic, int]:
    """Barrier, then ``fn()`` (an int: how many steps it ran; anything else: 1): (seconds per
    step, traffic, steps)."""
    dist.barrier()
    with p2p.count_traffic() as t:
        t0 = time.perf_counter()
        n = fn()
        dt = time.perf_counter() - t0
    n = n if isinstance(n, int) else 1
    return dt / n, t, n


def _rows(kind: dict, times: dict, traffic: dict, rank: int) -> list[dict]:
    """Medians of the slowest rank (one all-reduce MAX of every time) and this rank's bytes."""
    keys = list(times)
    flat = torch.tensor([x for k in keys for x in times[k]], dtype=torch.float64)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX)
    rows, o = [], 0
    for k in keys:
        n = len(times[k])
        t, steps = traffic[k]
        rows.append({**kind[k], "time_s": statistics.median(flat[o:o + n].tolist()),
                     "rank": rank, "inter": t.bytes_sent_inter / steps,
                     "intra": t.bytes_sent_intra / steps, "p2p_bytes": t.bytes_sent / steps})
        o += n
    return rows


def _collectives(rank: int, st: Settings) -> list[dict]:
    from minidist import collectives as C
    specs = {r: topology_spec(r, st) for r in st.ratios}
    bufs = {s: torch.empty(s // 4) for s in st.sizes}
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]   # every rank makes both
    pair = pairs[rank // 2]
    want = {v: float(sum(range(1, 5))) for v in COLLECTIVE_VARIANTS}
    want["loopback/2"] = (3.0, 7.0)[rank // 2]      # 1 + 2 on the first pair, 3 + 4 on the other
    calls = {"ring": lambda x: C.all_reduce(x, algorithm="ring"),
             "hierarchical": lambda x: C.all_reduce(x, algorithm="hierarchical"),
             "torch": lambda x: dist.all_reduce(x),
             "loopback": lambda x: C.all_reduce(x, algorithm="ring"),
             "loopback/2": lambda x: C.all_reduce(x, algorithm="ring", group=pair)}
    kind, traffic, wrong = {}, {}, []
    times: dict = {(r, s, v): [] for r in st.ratios for s in st.sizes for v in COLLECTIVE_VARIANTS}
    for i in range(st.warmup + st.iters):
        for ratio in st.ratios:
            for size in st.sizes:
                for v in balanced_order(list(COLLECTIVE_VARIANTS), i):
                    if v.startswith("loopback"):
                        topology.uninstall()
                    else:
                        topology.install(specs[ratio])
                    x = bufs[size].fill_(rank + 1)
                    dt, t, n = _timed(lambda v=v, x=x: calls[v](x))
                    if x[0].item() != want[v] or x[-1].item() != want[v]:
                        wrong.append((v, ratio, size))
                    key = (ratio, size, v)
                    kind[key] = {"section": "collectives", "variant": v, "ratio": ratio,
                                 "bytes": size}
                    traffic[key] = (t, n)
                    if i >= st.warmup:
                        times[key].append(dt)
    topology.uninstall()
    for g in pairs:
        p2p.destroy_group(g)
    if wrong:
        raise AssertionError(f"bench two-level (rank {rank}): wrong all-reduce results {wrong[:4]}")
    return _rows(kind, times, traffic, rank)


def _mlp(st: Settings) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(st.width, st.width), nn.ReLU())
                           for _ in range(st.depth)])


def _train_step(model, opt, x):
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _step_section(section: str, variants: dict, st: Settings, rank: int) -> list[dict]:
    """Time each variant's step (a callable) ``warmup + steps`` times in a balanced order."""
    kind = {v: {"section": section, "variant": v, "ratio": st.step_ratio, "bytes": None}
            for v in variants}
    times: dict = {v: [] for v in variants}
    traffic = {}
    for i in range(st.warmup + st.steps):
        for v in balanced_order(list(variants), i):
            dt, t, n = _timed(variants[v])
            traffic[v] = (t, n)
            if i >= st.warmup:
                times[v].append(dt)
    return _rows(kind, times, traffic, rank)


def _sharding(rank: int, st: Settings) -> list[dict]:
    from minidist.sharding import fully_shard, hsdp_mesh
    x = torch.randn(st.batch, st.width, generator=torch.Generator().manual_seed(rank))
    models = {}
    for name in ("fsdp", "hsdp", "compute"):
        m = _mlp(st)
        if name != "compute":
            opts = dict(algorithm="ring") | (dict(mesh=hsdp_mesh(2, 2)) if name == "hsdp" else {})
            for block in m:
                fully_shard(block, **opts)
            fully_shard(m, **opts)
        models[name] = (m, torch.optim.SGD(m.parameters(), lr=1e-3))
    return _step_section("sharding", {k: (lambda m=m, o=o: _train_step(m, o, x))
                                      for k, (m, o) in models.items()}, st, rank)


class _TimedComm:
    """The communicator a hook sees, with the seconds spent in its all-reduces added up."""

    def __init__(self, comm):
        self.comm, self.spent = comm, 0.0

    def all_reduce(self, t, op="sum"):
        t0 = time.perf_counter()
        self.comm.all_reduce(t, op)
        self.spent += time.perf_counter() - t0
        return t

    def __getattr__(self, name):
        return getattr(self.comm, name)


def _data_parallel(rank: int, st: Settings) -> list[dict]:
    from minidist.communicator import Communicator
    from minidist.data_parallel import BucketedDDP, DiLoCo, PowerSGD
    x = torch.randn(st.batch, st.width, generator=torch.Generator().manual_seed(rank))
    ddp = BucketedDDP(_mlp(st), bucket_cap_mb=1024, algorithm="ring")    # one bucket
    ddp_h = BucketedDDP(_mlp(st), bucket_cap_mb=1024, algorithm="hierarchical")
    psgd = BucketedDDP(_mlp(st), bucket_cap_mb=1024, algorithm="ring")
    arithmetic: list = []   # PowerSGD's own compute per step: its hook's time minus its all-reduces'

    def timed_hook(state, bucket, comm):
        tc = _TimedComm(comm)
        t0 = time.perf_counter()
        PowerSGD.hook(state, bucket, tc)
        arithmetic.append(time.perf_counter() - t0 - tc.spent)

    psgd.register_comm_hook(PowerSGD(rank=st.powersgd_rank, start_iter=0), timed_hook)
    local, plain = _mlp(st), _mlp(st)
    diloco = DiLoCo(local, sync_every=st.diloco_h)
    diloco.comm = Communicator("hand-built", None, where="DiLoCo", algorithm="ring")   # as DDP
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in
            (("ddp", ddp), ("ddp hierarchical", ddp_h), ("powersgd", psgd), ("diloco", local),
             ("compute", plain))}

    def round_():
        for _ in range(st.diloco_h):
            _train_step(local, opts["diloco"], x)
            diloco.step()
        return st.diloco_h

    try:
        rows = _step_section("data parallel", {
            "ddp": lambda: _train_step(ddp, opts["ddp"], x),
            "ddp hierarchical": lambda: _train_step(ddp_h, opts["ddp hierarchical"], x),
            "powersgd": lambda: _train_step(psgd, opts["powersgd"], x),
            "diloco": round_, "compute": lambda: _train_step(plain, opts["compute"], x)}, st, rank)
    finally:
        ddp.close()
        ddp_h.close()
        psgd.close()
    mine = torch.tensor([statistics.median(arithmetic[st.warmup:] or arithmetic)],
                        dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return rows + [{"section": "data parallel", "variant": "powersgd arith", "ratio": st.step_ratio,
                    "bytes": None, "time_s": mine.item(), "rank": rank, "inter": 0.0, "intra": 0.0,
                    "p2p_bytes": 0.0}]


def _placement(rank: int, st: Settings) -> list[dict]:
    from minidist import collectives as C
    from minidist.tensor_parallel import ParallelMLP
    from .placement import PlacedGroups
    h, tokens = st.tp_hidden, st.tp_tokens
    placed = {"inside": PlacedGroups(2, 2, tp_inside=True),
              "across": PlacedGroups(2, 2, tp_inside=False)}
    variants = {}
    for where, pg in placed.items():
        torch.manual_seed(0)
        mlp = ParallelMLP(h, 4 * h, group=pg.tp_group)
        x = torch.randn(1, tokens, h, generator=torch.Generator().manual_seed(pg.dp_rank))
        x.requires_grad_(True)   # as inside a model: the input gradient's all-reduce runs

        def tp_step(mlp=mlp, x=x, pg=pg):
            x.grad = None
            mlp(x).square().mean().backward()
            params = list(mlp.parameters())
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            C.all_reduce(flat, "avg", algorithm="ring", group=pg.dp_group)
            with torch.no_grad():
                for p, g in zip(params, flat.split([p.numel() for p in params])):
                    p -= 1e-3 * g.view_as(p)
                    p.grad = None

        rows = tokens * st.top_k // 2
        send = [torch.full((rows, h), float(rank)) for _ in range(2)]
        recv = [torch.empty(rows, h) for _ in range(2)]

        def ep_step(pg=pg, send=send, recv=recv):
            for _ in range(4):
                C.all_to_all(recv, send, group=pg.tp_group)

        variants[f"tp {where}"], variants[f"ep {where}"] = tp_step, ep_step
    torch.manual_seed(0)
    twin = nn.Sequential(nn.Linear(h, 2 * h), nn.GELU(), nn.Linear(2 * h, h))   # one TP shard
    opt = torch.optim.SGD(twin.parameters(), lr=1e-3)
    xt = torch.randn(1, tokens, h, requires_grad=True)
    variants["tp compute"] = lambda: _train_step(twin, opt, xt)
    try:
        return _step_section("placement", variants, st, rank)
    finally:
        for pg in placed.values():
            pg.close()


SECTIONS = {"collectives": _collectives, "sharding": _sharding, "data parallel": _data_parallel,
            "placement": _placement}


def _rank(rank: int, world: int, st: Settings) -> list[dict]:
    torch.set_num_threads(1)
    rows = []
    for name in st.sections:
        if name != "collectives":
            topology.install(topology_spec(st.step_ratio, st))
        rows += SECTIONS[name](rank, st)
        topology.uninstall()
    return rows


def measure(st: Settings = Settings(), timeout: float = 900) -> list[dict]:
    """Run every section on 4 ranks; one row per measured variant: ``section``, ``variant``,
    ``ratio``, ``bytes`` (collectives: the buffer), ``time_s`` (median of the slowest rank),
    ``inter`` / ``intra`` (bytes each rank sent over each class per call or step, a list by
    rank), ``settings``."""
    from minidist.launch import run
    unknown = set(st.sections) - set(SECTIONS)
    if unknown:
        raise ValueError(f"bench two-level: unknown sections {sorted(unknown)}; choose from "
                         f"{list(SECTIONS)}")
    with topology.use(None):
        per_rank = run(_rank, 4, st, timeout=timeout)
    rows = []
    for i, r in enumerate(per_rank[0]):
        mine = [ranks[i] for ranks in per_rank]
        rows.append({k: v for k, v in r.items() if k not in ("rank", "inter", "intra", "p2p_bytes")}
                    | {"inter": [m["inter"] for m in mine], "intra": [m["intra"] for m in mine]})
    return rows


def settings_dict(st: Settings) -> dict:
    return asdict(st)


def with_overrides(st: Settings, **kw) -> Settings:
    return replace(st, **{k: v for k, v in kw.items() if v is not None})
