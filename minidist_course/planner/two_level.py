"""Two link classes in the planner: every collective priced on the links it crosses, and the
bytes it sends over each class counted exactly.

A cluster of ``nodes × per_node`` ranks (global rank ``r`` on node ``r // per_node``, the rule
of :mod:`minidist.comm.topology`) has two classes of link, each an alpha-beta
:class:`~minidist_course.planner.search.Link`: ``intra`` (two ranks of one node) and ``inter``
(two nodes). A training step is described by the collectives it runs, :class:`Call` rows (op,
elements, the groups that run it at once, algorithm, how often per step); from them:

* :func:`sent` — bytes each rank sends over each class, by mirroring the schedules of
  :mod:`minidist.comm.ring` (the chunk rank ``r`` sends at step ``s``: ``(r - s - 1) mod W`` in
  the reduce-scatter, ``(r - s) mod W`` in the all-gather; ``tensor_split`` sizes), of the
  hierarchical all-reduce (:mod:`minidist.comm.hierarchical`: intra-node reduce-scatter, an
  all-reduce of each piece across the nodes, intra-node all-gather) and of the naive all-to-all
  (one message to each peer). Exact: the counters of :mod:`minidist.comm.p2p` must equal it;
* :func:`seconds` — the alpha-beta time (:func:`~minidist_course.planner.calc.comm_time`) on the
  link each phase waits for. A flat ring with a node boundary on it runs at the pace of its inter
  link at every step (every step waits for the slowest hop); the hierarchical all-reduce is
  ``RS(n, L, intra) + AR(n/L, M, inter) + AG(n, L, intra)``; an all-to-all queues its messages on
  this rank's link of each class, the two classes side by side.

On the emulated cluster of ``minidist bench two-level`` a message pays the shaper's alpha-beta
and then loopback's own (:func:`plus`; :class:`Cluster`'s ``loopback``, per group size). A
collective of torch's (``algorithm="torch"``) pays loopback alone and sends no p2p bytes. Workloads:
:func:`fsdp_calls` (FSDP and HSDP), :func:`ddp_calls`, :func:`powersgd_calls`,
:func:`diloco_calls`, :func:`tp_calls`, :func:`ep_calls`. :func:`rank_correlation` is Spearman's
rho computed here (no scipy needed).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import calc
from .search import Link

__all__ = ["Cluster", "Call", "plus", "shaped_links", "fit_loopback", "sent", "seconds",
           "step_seconds", "step_sent", "fsdp_calls", "ddp_calls", "powersgd_calls",
           "diloco_calls", "tp_calls", "ep_calls", "rank_correlation"]


def plus(*links: Link) -> Link:
    """The link a message sees when it pays each of ``links`` in turn: alphas and betas add."""
    return Link(sum(k.alpha for k in links), sum(k.beta for k in links))


def shaped_links(ratio: float, alpha: float = 1e-4, bandwidth: float = 2.5e7) -> tuple[Link, Link]:
    """``(intra, inter)``: the inter link (``alpha`` s, ``bandwidth`` bytes/s) and an intra link
    ``ratio`` times faster in both terms (alpha / ratio, bandwidth × ratio): at ratio 1 the two
    classes are alike, a one-level cluster."""
    if not ratio > 0 or not bandwidth > 0 or alpha < 0:
        raise ValueError(f"shaped_links: need ratio > 0, bandwidth > 0, alpha >= 0; got {ratio}, "
                         f"{bandwidth}, {alpha}")
    return Link(alpha / ratio, 1 / (bandwidth * ratio)), Link(alpha, 1 / bandwidth)


def fit_loopback(points) -> Link:
    """Least-squares alpha and beta per ring step from ``(nbytes, world, seconds)`` of flat ring
    all-reduces: ``seconds = 2(W-1)·alpha + 2(W-1)/W·nbytes·beta``. Negative values (noise on a
    loaded machine) are clipped to 0, the other term refitted alone."""
    rows = [(2 * (w - 1), calc.comm_bytes_per_rank("all_reduce", n, w), t) for n, w, t in points]
    if len(rows) < 2:
        raise ValueError(f"fit_loopback: need at least two points, got {len(rows)}")
    saa = sum(a * a for a, _, _ in rows)
    sab = sum(a * b for a, b, _ in rows)
    sbb = sum(b * b for _, b, _ in rows)
    sat = sum(a * t for a, _, t in rows)
    sbt = sum(b * t for _, b, t in rows)
    det = saa * sbb - sab * sab
    alpha = (sat * sbb - sbt * sab) / det if det else 0.0
    beta = (saa * sbt - sab * sat) / det if det else 0.0
    if beta < 0:
        return Link(max(0.0, sat / saa), 0.0)
    if alpha < 0:
        return Link(0.0, max(0.0, sbt / sbb))
    return Link(alpha, beta)


@dataclass(frozen=True)
class Cluster:
    """``nodes × per_node`` ranks, global rank r on node ``r // per_node``; ``intra`` / ``inter``:
    the Link a message between two ranks of one node / of two nodes pays; ``loopback``: what
    every message pays besides (a Link, or ``{group size: Link}`` measured with every group of
    that size busy at once, as :mod:`~minidist_course.planner.machine`'s ``group_links``; a size
    not in it takes the nearest; default nothing)."""

    nodes: int
    per_node: int
    intra: Link
    inter: Link
    loopback: object = None

    def node(self, rank: int) -> int:
        return rank // self.per_node

    def kind(self, a: int, b: int) -> str:
        return "intra" if self.node(a) == self.node(b) else "inter"

    def loop(self, n: int) -> Link:
        """Loopback's link for a group of ``n`` ranks."""
        lb = self.loopback
        if lb is None:
            return Link(0.0, 0.0)
        if isinstance(lb, Link):
            return lb
        return lb[min(lb, key=lambda k: (abs(k - n), k))]

    def link(self, kind: str, n: int = 0) -> Link:
        """The link of class ``kind`` in a group of ``n`` ranks: shaped plus loopback."""
        return plus(self.intra if kind == "intra" else self.inter, self.loop(n))


@dataclass(frozen=True)
class Call:
    """One collective of a step: ``op`` (``all_reduce``, ``reduce_scatter``, ``all_gather``,
    ``all_to_all``) on ``numel`` elements of ``itemsize`` bytes (the all-reduced tensor; the
    gathered / scattered whole; for all-to-all what a rank sends to each peer), run at once by
    each group of ``groups`` (global ranks in group order), ``times`` per step (1/H: once every
    H steps). ``algorithm``: ``ring``, ``hierarchical`` (all-reduce), ``naive`` (all-to-all) or
    ``torch`` (torch.distributed's own: no p2p bytes, priced on loopback alone, as a ring)."""

    op: str
    numel: int
    groups: tuple
    algorithm: str = "ring"
    itemsize: int = 4
    times: float = 1.0
    what: str = ""


def _split(n: int, w: int) -> list[int]:
    """``tensor_split(w)`` sizes of n elements."""
    return [n // w + (i < n % w) for i in range(w)]


_PHASES = {"all_reduce": ("rs", "ag"), "reduce_scatter": ("rs",), "all_gather": ("ag",)}


def _ring(op: str, sizes: list[int], members, cluster: Cluster, itemsize: int, out: dict) -> None:
    """Add the bytes of a ring ``op`` over ``members`` whose chunk i has ``sizes[i]`` elements."""
    w = len(members)
    for r, g in enumerate(members):
        kind = cluster.kind(g, members[(r + 1) % w])
        for phase in _PHASES[op]:
            for s in range(w - 1):
                i = (r - s - 1) % w if phase == "rs" else (r - s) % w
                out[g][kind] += sizes[i] * itemsize


def _by_node(members, cluster: Cluster) -> list[list[int]]:
    nodes: dict[int, list[int]] = {}
    for g in members:
        nodes.setdefault(cluster.node(g), []).append(g)
    return [nodes[n] for n in sorted(nodes)]


def sent(call: Call, cluster: Cluster) -> dict[int, dict[str, float]]:
    """``{global rank: {"inter": bytes, "intra": bytes}}`` one run of ``call`` sends (module
    docstring), every rank of every group."""
    out = {g: {"inter": 0.0, "intra": 0.0} for grp in call.groups for g in grp}
    for members in call.groups:
        w = len(members)
        if w == 1 or call.numel == 0 or call.algorithm == "torch":
            continue
        if call.op == "all_to_all":
            for a in members:
                for b in members:
                    if a != b:
                        out[a][cluster.kind(a, b)] += call.numel * call.itemsize
        elif call.algorithm == "hierarchical":
            nodes = _by_node(members, cluster)
            pieces = _split(call.numel, len(nodes[0]))
            for node in nodes:
                if len(node) > 1:
                    _ring("all_reduce", pieces, node, cluster, call.itemsize, out)   # RS + AG
            for l_, col in enumerate(zip(*nodes)):
                if len(col) > 1:
                    _ring("all_reduce", _split(pieces[l_], len(col)), list(col), cluster,
                          call.itemsize, out)
        else:
            _ring(call.op, _split(call.numel, w), members, cluster, call.itemsize, out)
    return out


def _group_seconds(call: Call, members, cluster: Cluster) -> float:
    w = len(members)
    if w == 1 or call.numel == 0:
        return 0.0
    nbytes = call.numel * call.itemsize
    if call.algorithm == "torch":
        loop = cluster.loop(w)
        return calc.comm_time(call.op, nbytes, w, loop.alpha, loop.beta)
    if call.op == "all_to_all":   # each rank's messages queue on its link of each class
        return max(sum(1 for b in members if b != a and cluster.kind(a, b) == k)
                   * (cluster.link(k, w).alpha + nbytes * cluster.link(k, w).beta)
                   for a in members for k in ("intra", "inter"))
    if call.algorithm == "hierarchical":
        nodes = _by_node(members, cluster)
        m, per = len(nodes), len(nodes[0])
        t = 0.0
        if per > 1:
            intra = cluster.link("intra", per)
            for op in ("reduce_scatter", "all_gather"):
                t += calc.comm_time(op, nbytes, per, intra.alpha, intra.beta)
        if m > 1:
            inter = cluster.link("inter", m)
            t += calc.comm_time("all_reduce", nbytes / per, m, inter.alpha, inter.beta)
        return t
    crosses = any(cluster.kind(members[r], members[(r + 1) % w]) == "inter" for r in range(w))
    link = cluster.link("inter" if crosses else "intra", w)
    return calc.comm_time(call.op, nbytes, w, link.alpha, link.beta)


def seconds(call: Call, cluster: Cluster) -> float:
    """Alpha-beta seconds of one run of ``call``: its slowest group's (module docstring)."""
    return max((_group_seconds(call, g, cluster) for g in call.groups), default=0.0)


def step_seconds(calls, cluster: Cluster, compute_s: float = 0.0) -> float:
    """``compute_s`` plus every call's seconds × its ``times``: nothing overlaps."""
    return compute_s + sum(c.times * seconds(c, cluster) for c in calls)


def step_sent(calls, cluster: Cluster) -> dict[int, dict[str, float]]:
    """Bytes per rank and link class of a step: :func:`sent` of every call × its ``times``."""
    out: dict[int, dict[str, float]] = {}
    for c in calls:
        for g, by in sent(c, cluster).items():
            mine = out.setdefault(g, {"inter": 0.0, "intra": 0.0})
            for k, v in by.items():
                mine[k] += c.times * v
    return out


# ------------------------------------------------------------------ workloads
def fsdp_calls(units, shard_groups, replicate_groups=None) -> list[Call]:
    """One training step of :func:`minidist.sharding.fully_shard` (per-parameter units,
    ``reshard_after_forward=True``, ``algorithm="ring"``; every parameter's dim 0 divisible by
    the shard size, so nothing is padded). ``units``: per unit, its parameters' numels. Per unit:
    an all-gather in forward and again in backward, a reduce-scatter of the gradient and an
    all-reduce (max) of one flag per parameter (which got a gradient) over the shard group; with
    ``replicate_groups`` (HSDP) also an all-reduce of the 1/S piece and of the flags across."""
    shard_groups = tuple(tuple(g) for g in shard_groups)
    s = len(shard_groups[0])
    calls = []
    for i, numels in enumerate(units):
        n = sum(numels)
        calls += [Call("all_gather", n, shard_groups, times=2, what=f"unit {i} gather"),
                  Call("reduce_scatter", n, shard_groups, what=f"unit {i} gradient"),
                  Call("all_reduce", len(numels), shard_groups, what=f"unit {i} flags")]
        if replicate_groups:
            rep = tuple(tuple(g) for g in replicate_groups)
            calls += [Call("all_reduce", n // s, rep, what=f"unit {i} piece across"),
                      Call("all_reduce", len(numels), rep, what=f"unit {i} flags across")]
    return calls


def ddp_calls(bucket_numels, groups, algorithm: str = "ring") -> list[Call]:
    """DDP: one all-reduce per bucket."""
    return [Call("all_reduce", n, tuple(tuple(g) for g in groups), algorithm, what=f"bucket {i}")
            for i, n in enumerate(bucket_numels)]


def powersgd_calls(shapes, rank: int, groups, min_compression_rate: float = 2.0) -> list[Call]:
    """A compressed PowerSGD step (:class:`minidist.data_parallel.PowerSGD`, one bucket): the
    uncompressed tensors together, then every P (n × r), then every Q (m × r), three all-reduces.
    ``shapes``: the parameters' shapes; a tensor is compressed when r(n+m)·rate < n·m."""
    unc = ps = qs = 0
    for shape in shapes:
        numel = 1
        for d in shape:
            numel *= d
        n = shape[0] if shape else 1
        m = numel // n
        r = min(n, m, rank)
        if r * (n + m) * min_compression_rate < n * m:
            ps, qs = ps + n * r, qs + m * r
        else:
            unc += numel
    g = tuple(tuple(x) for x in groups)
    return [Call("all_reduce", k, g, what=w) for k, w in ((unc, "uncompressed"), (ps, "P"),
                                                          (qs, "Q")) if k]


def diloco_calls(numel: int, sync_every: int, groups) -> list[Call]:
    """DiLoCo per inner step, amortised: one all-reduce of every parameter each H steps."""
    return [Call("all_reduce", numel, tuple(tuple(g) for g in groups), times=1 / sync_every,
                 what=f"outer step / {sync_every}")]


def tp_calls(tokens: int, hidden: int, shard_numel: int, tp_groups, dp_groups) -> list[Call]:
    """A Megatron MLP step (column then row parallel) on ``tokens`` × ``hidden`` activations:
    the row layer's all-reduce in forward, the column layer's input-gradient all-reduce in
    backward, over the TP group; then the data-parallel all-reduce of this rank's
    ``shard_numel`` gradient elements over the DP group."""
    tp = tuple(tuple(g) for g in tp_groups)
    return [Call("all_reduce", tokens * hidden, tp, times=2, what="TP activations"),
            Call("all_reduce", shard_numel, tuple(tuple(g) for g in dp_groups), what="DP gradients")]


def ep_calls(rows_per_peer: int, hidden: int, ep_groups, count: int = 4) -> list[Call]:
    """An MoE layer's expert-parallel exchanges: ``count`` all-to-alls (dispatch and combine,
    forward and backward) of ``rows_per_peer`` × ``hidden`` values to each peer, each after
    :func:`minidist.collectives.all_to_all`'s size check (torch's all-gather of 2W int64)."""
    groups = tuple(tuple(g) for g in ep_groups)
    w = len(groups[0])
    return [Call("all_gather", 2 * w * w, groups, "torch", itemsize=8, times=count,
                 what="size check"),
            Call("all_to_all", rows_per_peer * hidden, groups, "naive", times=count,
                 what="dispatch/combine")]


def _average_ranks(xs) -> list[float]:
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    ranks = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def rank_correlation(a, b) -> float:
    """Spearman's rho: Pearson's correlation of the average ranks (ties share the mean rank).
    NaN when either side is constant; ValueError for lengths that differ or are < 2."""
    if len(a) != len(b) or len(a) < 2:
        raise ValueError(f"rank_correlation: need equal lengths >= 2, got {len(a)} and {len(b)}")
    ra, rb = _average_ranks(list(a)), _average_ranks(list(b))
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = sum((x - ma) ** 2 for x in ra)
    vb = sum((y - mb) ** 2 for y in rb)
    return cov / (va * vb) ** 0.5 if va and vb else float("nan")
