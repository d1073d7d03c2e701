"""Hierarchical (two-level) collectives: the slow links between nodes carry as little as possible.

On M nodes of L ranks: all-reduce = reduce-scatter inside the node, all-reduce of one piece across
nodes, all-gather inside the node (n/L bytes cross instead of n); reduce-scatter and all-gather
are its halves (Mikami et al. 2018, §3.2). Each phase is a ring on a sub-group; a group's
sub-groups are made once (:func:`new_group` for a group smaller than the world).

Design notes: docs/design/ground.md"""

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
    """Where a group's ranks sit: ``where[r] = (m, l)``, ``rank_of[m][l]``; M nodes, L ranks each;
    ``intra``/``inter``: this rank's sub-groups (None where a phase is skipped)."""

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
    """Keep ``lay`` and its sub-groups while ``pg`` lives (held weakly)."""
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
    """Raise, the same on every rank, what makes ``"hierarchical"`` unusable on ``group``; else the topology."""
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
    """``dist.new_group(ranks)`` plus the sub-groups ``"hierarchical"`` needs; call it on every rank of
    the world with the same global ``ranks``. ValueError: no topology installed, or uneven nodes."""
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
    """Destroy (locally) and forget the sub-groups :func:`new_group` made for ``group``."""
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
    """Two-level all-reduce of a contiguous 1-D tensor, in place, bit-identical on every rank."""
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
    """In place: ``chunks[rank]`` ends with the reduction of every rank's ``chunks[rank]``."""
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
