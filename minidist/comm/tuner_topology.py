"""``algorithm="auto"`` on a two-level topology: the cost per link class, and ``hierarchical``
as one more candidate.

While a :class:`~minidist.comm.topology.Topology` is installed, a message pays its link's
emulated ``alpha + n · beta`` on top of loopback's own cost (:mod:`minidist.comm.topology`). The
tuner's prediction of an algorithm is then the table's (loopback: :mod:`minidist.comm.tuner`) plus,
per class of link, ``c_alpha · alpha_class + c_beta · n · beta_class`` with the coefficients of
:func:`link_coefficients`, for a group spread over M nodes with L of its ranks on each:

=========================================  ================================  ==========================
op / algorithm                             intra (c_alpha, c_beta)           inter (c_alpha, c_beta)
=========================================  ================================  ==========================
all_reduce / hierarchical                  2(L-1), 2(L-1)/L                  2(M-1), 2(M-1)/M / L
reduce_scatter, all_gather / hierarchical  L-1, (L-1)/L                      M-1, (M-1)/M / L
any flat algorithm (ring, ...), M > 1      0, 0                              the algorithm's own (W)
any flat algorithm, M = 1                  the algorithm's own (W)           0, 0
=========================================  ================================  ==========================

A flat ring of W ranks over several nodes has node boundaries on it, and every one of its steps
waits for the slowest link: all its steps are counted on the inter link. For recursive doubling
and the naive algorithms that is an upper bound (some of their messages stay inside a node).
The hierarchical algorithm's loopback cost is the table's ring at L (inside a node) and at M
(across, on an n/L piece). ``hierarchical`` is a candidate only where it can run
(:func:`minidist.comm.hierarchical.available`), so ranks choose it all or none.
"""

from __future__ import annotations

import sys
import weakref

from . import hierarchical, topology, tuner
from .tuner import coefficients

__all__ = ["OPS", "link_coefficients", "predict", "choose"]

OPS = ("all_reduce", "reduce_scatter", "all_gather")


def link_coefficients(op: str, algorithm: str, nodes: int, per_node: int, nbytes: float = 0,
                      itemsize: int = 4, world: int | None = None) -> dict[str, tuple[float, float]]:
    """``{"intra": (c_alpha, c_beta), "inter": (c_alpha, c_beta)}`` for ``op`` by ``algorithm``
    on a group of ``nodes`` (M) × ``per_node`` (L) ranks (the table in the module docstring;
    ``world``: the group's size where it is not M·L, for a flat algorithm)."""
    M, L = nodes, per_node
    if algorithm == "hierarchical":
        if op not in OPS:
            raise ValueError(f"tuner: no hierarchical model for {op}; models exist for {OPS}")
        if op == "all_reduce":
            ia, ib = coefficients("reduce_scatter", "ring", L)
            xa, xb = coefficients("all_reduce", "ring", M)
            return {"intra": (2 * ia, 2 * ib), "inter": (xa, xb / L)}
        xa, xb = coefficients(op, "ring", M)
        return {"intra": coefficients(op, "ring", L), "inter": (xa, xb / L)}
    own = coefficients(op, algorithm, world or M * L, nbytes, itemsize)
    return {"intra": (0.0, 0.0), "inter": own} if M > 1 else {"intra": own, "inter": (0.0, 0.0)}


def _span(group) -> tuple[int, int]:
    """(M nodes, most ranks on one node) of ``group`` under the installed topology."""
    import torch.distributed as dist

    topo = topology.current()
    assert topo is not None
    members = dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
    counts: dict[int, int] = {}
    for g in members:
        counts[topo.node(g)] = counts.get(topo.node(g), 0) + 1
    return len(counts), max(counts.values())


def predict(table, op: str, algorithm: str, world: int, nodes: int, per_node: int,
            nbytes: float, itemsize: int = 4) -> float:
    """Seconds: the table's loopback prediction plus the emulated links' cost."""
    topo = topology.current()
    assert topo is not None
    M, L = nodes, per_node
    if algorithm == "hierarchical":
        base = table.predict("all_reduce" if op == "all_reduce" else op, "ring", M, nbytes / L,
                             itemsize)
        if op == "all_reduce":
            base += sum(table.predict(o, "ring", L, nbytes, itemsize)
                        for o in ("reduce_scatter", "all_gather"))
        else:
            base += table.predict(op, "ring", L, nbytes, itemsize)
    else:
        base = table.predict(op, algorithm, world, nbytes, itemsize)
    for kind, (ca, cb) in link_coefficients(op, algorithm, M, L, nbytes, itemsize, world).items():
        ln = topo.cost(kind)
        base += ca * ln.alpha + cb * nbytes * ln.beta
    return base


def choose(op: str, world: int, nbytes: int, itemsize: int = 4, group=None,
           debug: bool = False) -> str:
    """:func:`minidist.comm.tuner.choose` under the installed topology: the candidate with the
    lowest :func:`predict` (the table every rank of ``group`` agreed on), remembered per group,
    topology and size; with ``debug``, printed with every candidate's prediction."""
    import torch.distributed as dist

    topo = topology.current()
    assert topo is not None, "tuner_topology.choose: no topology is installed"
    pg = group if group is not None else dist.GroupMember.WORLD
    key = (id(pg), topo, op, world, nbytes, itemsize)   # in the tuner's memo: reset_cache() forgets
    _chosen = tuner._chosen
    hit = _chosen.get(key)
    if hit is not None and hit[0]() is pg and not debug:
        return hit[1]
    table = tuner.agreed_table(group) if world > 1 else tuner.table()
    M, L = _span(group)
    algs = list(tuner.CANDIDATES[op])
    if op in OPS and hierarchical.available(group):
        algs.append("hierarchical")
    times = {a: predict(table, op, a, world, M, L, nbytes, itemsize) for a in algs}
    algorithm = min(algs, key=lambda a: times[a])
    if len(_chosen) > 4096:
        _chosen.clear()
    _chosen[key] = (weakref.ref(pg), algorithm)   # weak, as the tuner's: a dropped group can go
    if debug:
        shown = ", ".join(f"{a} {s * 1e6:.0f} us" for a, s in times.items())
        print(f"minidist auto: {op} of {nbytes} B on {world} ranks of topology {topo.spec()} "
              f"-> {algorithm} (predicted {shown}; links emulated: minidist.comm.topology)",
              file=sys.stderr, flush=True)
    return algorithm
