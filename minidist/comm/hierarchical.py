"""Hierarchical (two-level) collectives: the slow links between nodes carry as little as possible.

A group of W ranks spread over M nodes, L of its ranks on each (the installed
:class:`~minidist.comm.topology.Topology` says which node a rank is on). Rank (m, l) is the l-th
of the group's ranks on the m-th of its nodes (both in group-rank order). Two kinds of sub-group:
the *intra* group of a node (its L ranks) and, for each l, the *inter* group of the M ranks
(m, l), one per node. Each phase is a ring of :mod:`minidist.comm.ring` on one kind:

* **all-reduce** = reduce-scatter inside the node (rank (m, l) ends with piece l of the node's sum)
  -> all-reduce of piece l across the nodes (among the M ranks holding it) -> all-gather inside
  the node. Per rank: 2(L-1)/L · n bytes over intra links and 2(M-1)/M · n/L over inter links,
  where a flat ring of W ranks sends 2(W-1)/W · n, every step waiting on the slowest (inter) link;
* **reduce-scatter** = reduce-scatter inside the node (of super-pieces: piece l' of the node's
  sum holds the M pieces destined for ranks (·, l')) -> reduce-scatter across nodes;
* **all-gather** = all-gather across nodes first (each rank's piece crosses once per node) ->
  all-gather inside the node (of super-pieces of M pieces): the mirror of reduce-scatter.

Sources: the two-level / "2D-torus" all-reduce of Mikami et al. 2018 ("Massively distributed SGD:
ImageNet/ResNet-50 training in a flash", §3.2) and Jia et al. 2018 ("Highly scalable deep
learning training system with mixed-precision", §4.3, hierarchical all-reduce); NCCL's
``NCCL_ALGO=CollnetChain/NVLS`` and tree algorithms split intra- from inter-node the same way; the
Ultra-Scale Playbook (Hugging Face, 2025), "A1: Distributed training primer" on why the inter-node
link sets the pace.

Sub-groups: ``dist.new_group`` is collective over the *world* (every rank calls it, member or
not), and each gloo group keeps threads of its own, so they are made once per (group, node
layout) and remembered. The world's are made at its first hierarchical call (every rank is in
it); a smaller group's sub-groups must be made when the group is, on every rank of the world:
:func:`new_group`. Errors (every rank of the group raises the same, before any message): no
topology installed, a group made by plain ``dist.new_group``, a group with different numbers of
its ranks on different nodes.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import ring, topology

__all__ = ["Layout", "layout", "check", "available", "new_group", "destroy_subgroups", "all_reduce",
           "reduce_scatter_chunks", "all_gather_chunks"]


@dataclass(frozen=True)
class Layout:
    """Where a group's ranks sit: ``where[r] = (m, l)`` for group rank r, ``rank_of[m][l]`` the
    group rank at (m, l); M nodes, L ranks on each. ``intra``/``inter``: this rank's sub-groups
    (None where the phase is skipped: L = 1, M = 1; the group itself where it is the sub-group)."""

    M: int
    L: int
    where: tuple
    rank_of: tuple
    intra: object = None
    inter: object = None


def _plan(members: list[int], topo: topology.Topology) -> tuple[list[list[int]], str | None]:
    """Global ranks per node (nodes ascending, group order within), and why they cannot be used."""
    by_node: dict[int, list[int]] = {}
    for g in members:
        by_node.setdefault(topo.node(g), []).append(g)
    nodes = [by_node[n] for n in sorted(by_node)]
    if len({len(x) for x in nodes}) > 1:
        counts = ", ".join(f"node {n}: {len(by_node[n])} (global ranks {by_node[n]})"
                           for n in sorted(by_node))
        return nodes, (f"the same number of the group's ranks on every node it spans, got {counts} "
                       f"under topology {topo.spec()}")
    return nodes, None


_made: dict = {}   # (id(group), nodes, ranks_per_node) -> (weakref to the group, Layout)


def _remember(pg, key, lay: Layout) -> None:
    """Keep ``lay`` (and its sub-groups) while ``pg`` lives: the group is held weakly, and when it
    goes its sub-groups are dropped too (their gloo threads with them)."""
    _made[key] = (weakref.ref(pg), lay)
    if pg is not dist.GroupMember.WORLD:
        weakref.finalize(pg, _made.pop, key, None)


def _known(pg, key) -> Layout | None:
    hit = _made.get(key)
    return hit[1] if hit is not None and hit[0]() is pg else None


def _key(group, topo):
    pg = group if group is not None else dist.GroupMember.WORLD
    return pg, (id(pg), topo.nodes, topo.ranks_per_node)


def _where(opname: str) -> str:
    return f"{opname} (rank {dist.get_rank()})"


def check(opname: str, group=None) -> topology.Topology:
    """Raise, naming the rank and ``opname``, what makes ``algorithm="hierarchical"`` unusable on
    ``group``; the topology otherwise. The same on every rank of the group."""
    topo = topology.current()
    if topo is None:
        raise ValueError(f"{_where(opname)}: algorithm='hierarchical' needs a two-level topology "
                         "and none is installed; expected minidist.comm.topology.install("
                         f"Topology(nodes, ranks_per_node, ...)) or {topology.ENV}='2x2' before "
                         "minidist.run, with nodes x ranks_per_node = the world size")
    pg, key = _key(group, topo)
    if _known(pg, key) is not None:
        return topo
    if pg is not dist.GroupMember.WORLD:
        raise ValueError(f"{_where(opname)}: group: algorithm='hierarchical' on a group other "
                         "than the world needs its sub-groups, made on every rank of the world "
                         "when the group is: expected a group from minidist.comm.hierarchical."
                         f"new_group(ranks) (made under the topology installed now, {topo.spec()})")
    if dist.get_world_size() != topo.size:
        raise ValueError(f"{_where(opname)}: algorithm='hierarchical' needs a topology of the "
                         f"world's {dist.get_world_size()} ranks, got {topo.spec()} "
                         f"({topo.nodes} x {topo.ranks_per_node} = {topo.size})")
    return topo


def available(group=None) -> bool:
    """Whether ``algorithm="hierarchical"`` would run on ``group`` now (what ``auto`` asks)."""
    try:
        check("auto", group)
    except ValueError:
        return False
    return True


def _build(members: list[int], topo) -> tuple[Layout, list[list[int]]]:
    where = f"hierarchical.new_group (rank {dist.get_rank()}): ranks={members}"
    if not members or len(set(members)) != len(members):
        raise ValueError(f"{where}: expected distinct global ranks, at least one")
    try:
        nodes, why = _plan(members, topo)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    if why:
        raise ValueError(f"{where}: expected {why}")
    pos = {g: r for r, g in enumerate(members)}
    rank_of = tuple(tuple(pos[g] for g in node) for node in nodes)
    places = [(0, 0)] * len(members)
    for m, row in enumerate(rank_of):
        for l_, r in enumerate(row):
            places[r] = (m, l_)
    lay = Layout(len(nodes), len(nodes[0]), tuple(places), rank_of)
    return lay, nodes


def _make(group, members: list[int], topo) -> Layout:
    """Every rank of the world: create the sub-groups of the group of global ranks ``members``."""
    me = dist.get_rank()
    lay, nodes = _build(members, topo)
    intra = inter = None
    if lay.L > 1:     # every rank of the world makes every group, in the same order
        for node in nodes:   # one node: the group itself is its intra group
            pg = group if lay.M == 1 else dist.new_group(node)
            intra = pg if me in node else intra
    if lay.M > 1:
        for l_ in range(lay.L):
            col = [node[l_] for node in nodes]
            pg = group if lay.L == 1 else dist.new_group(col)
            inter = pg if me in col else inter
    return Layout(lay.M, lay.L, lay.where, lay.rank_of, intra, inter)


def _layout_of(group, opname: str) -> Layout:
    topo = check(opname, group)
    pg, key = _key(group, topo)
    lay = _known(pg, key)
    if lay is None:   # the world, at its first call under this layout
        lay = _make(pg, list(range(dist.get_world_size())), topo)
        _remember(pg, key, lay)
    return lay


def layout(group=None) -> Layout:
    """The :class:`Layout` of ``group`` under the installed topology (made if need be)."""
    return _layout_of(group, "hierarchical.layout")


def new_group(ranks: list[int]):
    """``dist.new_group(ranks)`` and the sub-groups ``algorithm="hierarchical"`` needs on it,
    under the installed topology: call it on every rank of the world with the same ``ranks``
    (global ranks), as ``dist.new_group``. Returns the group (``GroupMember.NON_GROUP_MEMBER`` on
    the ranks outside it). ValueError when no topology is installed or ``ranks`` put different
    numbers of ranks on different nodes."""
    topo = topology.current()
    if topo is None:
        raise ValueError(f"hierarchical.new_group (rank {dist.get_rank()}): no topology is "
                         "installed; install one first (minidist.comm.topology.install)")
    members = sorted(int(r) for r in ranks)    # group rank order: dist.new_group sorts them
    _build(members, topo)                       # refuse an uneven group before making any
    group = dist.new_group(members)
    lay = _make(group, members, topo)
    if dist.get_rank() in members:
        _remember(group, _key(group, topo)[1], lay)
    return group


def destroy_subgroups(group) -> None:
    """Destroy the sub-groups :func:`new_group` made for ``group`` on this rank (local; their
    threads go with them) and forget them; nothing when it made none. Every collective on them
    must be done."""
    pg = group if group is not None else dist.GroupMember.WORLD
    for key in [k for k, (ref, _) in _made.items() if ref() is pg]:
        lay = _made.pop(key)[1]
        for sub in {id(x): x for x in (lay.intra, lay.inter)}.values():
            if sub is not None and sub is not pg and isinstance(sub, dist.ProcessGroup):
                try:
                    dist.destroy_process_group(sub)
                except ValueError:   # already gone with the world
                    pass


def all_reduce(flat: torch.Tensor, op: str, rank: int, world: int, group=None) -> None:
    """Two-level all-reduce of a contiguous 1-D tensor, in place (``avg`` left to the caller);
    every rank ends with bit-identical values (each phase's ring does)."""
    lay = _layout_of(group, "all_reduce")
    m, l_ = lay.where[rank]
    chunks = list(flat.tensor_split(lay.L)) if lay.L > 1 else [flat]
    if lay.L > 1:
        ring.reduce_scatter_chunks(chunks, op, l_, lay.L, lay.intra)
    if lay.M > 1:
        ring.all_reduce(chunks[l_], op, m, lay.M, lay.inter)
    if lay.L > 1:
        ring.all_gather_chunks(chunks, l_, lay.L, lay.intra)


def reduce_scatter_chunks(chunks: list[torch.Tensor], op: str, rank: int, world: int,
                          group=None) -> None:
    """In place: ``chunks[rank]`` ends with the reduction of every rank's ``chunks[rank]``
    (W contiguous 1-D tensors, sizes as every rank passes them; the others are scratch)."""
    lay = _layout_of(group, "reduce_scatter")
    m, l_ = lay.where[rank]
    if lay.L > 1:
        supers = [torch.cat([chunks[lay.rank_of[mm][ll]] for mm in range(lay.M)])
                  for ll in range(lay.L)]
        ring.reduce_scatter_chunks(supers, op, l_, lay.L, lay.intra)
        pieces = list(supers[l_].split([chunks[lay.rank_of[mm][l_]].numel()
                                        for mm in range(lay.M)]))
    else:
        pieces = [chunks[lay.rank_of[mm][0]] for mm in range(lay.M)]
    if lay.M > 1:
        ring.reduce_scatter_chunks(pieces, op, m, lay.M, lay.inter)
    if pieces[m] is not chunks[rank]:
        chunks[rank].copy_(pieces[m])


def all_gather_chunks(chunks: list[torch.Tensor], rank: int, world: int, group=None) -> None:
    """In place: ``chunks[rank]`` is this rank's data; afterwards every chunk is filled."""
    lay = _layout_of(group, "all_gather")
    m, l_ = lay.where[rank]
    if lay.M > 1:
        ring.all_gather_chunks([chunks[lay.rank_of[mm][l_]] for mm in range(lay.M)], m, lay.M,
                               lay.inter)
    if lay.L > 1:
        sizes = [[chunks[lay.rank_of[mm][ll]].numel() for mm in range(lay.M)]
                 for ll in range(lay.L)]
        mine = chunks[rank]
        supers = [torch.cat([chunks[lay.rank_of[mm][l_]] for mm in range(lay.M)]) if ll == l_
                  else mine.new_empty(sum(sizes[ll])) for ll in range(lay.L)]
        ring.all_gather_chunks(supers, l_, lay.L, lay.intra)
        for ll in range(lay.L):
            if ll != l_:
                for mm, part in enumerate(supers[ll].split(sizes[ll])):
                    chunks[lay.rank_of[mm][ll]].copy_(part)
