"""``algorithm="auto"`` on a two-level topology: the cost per link class, and ``hierarchical``
as one more candidate.

While a :class:`~minidist.comm.topology.Topology` is installed, an algorithm's predicted time is
the table's (loopback, :mod:`minidist.comm.tuner`) plus, per link class, ``c_alpha · alpha_class
+ c_beta · n · beta_class`` (:func:`link_coefficients`). A flat algorithm over several nodes is
counted wholly on the inter link (every step waits on the slowest). ``hierarchical`` is a
candidate only where it can run (:func:`minidist.comm.hierarchical.available`).

Design notes: docs/design/ground.md"""

from __future__ import annotations

import sys
import weakref

from . import hierarchical, topology, tuner
from .tuner import coefficients

__all__ = ["OPS", "link_coefficients", "predict", "choose"]

OPS = ("all_reduce", "reduce_scatter", "all_gather")


def link_coefficients(op: str, algorithm: str, nodes: int, per_node: int, nbytes: float = 0,
                      itemsize: int = 4, world: int | None = None) -> dict[str, tuple[float, float]]:
    """``{"intra": (c_alpha, c_beta), "inter": (c_alpha, c_beta)}`` for ``op`` by ``algorithm`` on
    ``nodes`` (M) × ``per_node`` (L) ranks (``world``: the group's size where it is not M·L)."""
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
    """:func:`minidist.comm.tuner.choose` under the installed topology, cached per group, topology, size."""
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
