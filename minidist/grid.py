"""The process grid: which ranks do data, pipeline, tensor, context and expert parallelism together.

The world's ranks are laid out as ``torch.arange(world).view(dp, pp, tp)`` (picotron's
``process_group_manager``; Megatron-LM's ``parallel_state`` uses the same order): tensor-parallel
ranks are neighbours (they talk most, and on a GPU node they share NVLink), then pipeline stages,
then data-parallel replicas. Rank ``r`` sits at ``(dp_rank, pp_rank, tp_rank)`` and belongs to

* a **DP group**: the ranks with its ``(pp_rank, tp_rank)`` — replicas of the same shard of the
  model, which average gradients;
* a **PP group**: the ranks with its ``(dp_rank, tp_rank)`` — the stages of one pipeline;
* a **TP group**: the ranks with its ``(dp_rank, pp_rank)`` — the shards of one layer.

Example, world 8 = dp 2 x pp 2 x tp 2: rank 5 is at (1, 0, 1); DP group [1, 5], PP group [5, 7],
TP group [4, 5].

With ``pp > 1`` there is a fourth kind, the **embedding group**: the first and the last stage of
each pipeline (``[pp_ranks[0], pp_ranks[-1]]``), which sum the gradients of an embedding tied to
the output head (Megatron-LM's ``_allreduce_word_embedding_grads``). Rank 5 above: [5, 7].

**Context parallelism** (``cp``, default 1: the layout above unchanged): the sequence of each
sample is split over ``cp`` ranks (:mod:`minidist.context_parallel`). The layout becomes
``arange(world).view(dp, pp, cp, tp)`` — tp fastest, then cp, then pp, then dp: in Megatron-core's
notation ``order="tp-cp-pp-dp"``; its default ``"tp-cp-ep-dp-pp"`` agrees on the inner part (tp
neighbours, then cp: ring attention's K/V traffic is the next heaviest) and, without ep, differs
only in putting dp inside pp, where minidist has always put pp inside dp. A **CP group** holds the
ranks with the same ``(dp, pp, tp)``; the **DP×CP group** (Megatron's data-parallel group "with
context parallel") the ranks with the same ``(pp, tp)``: parameters are replicated over it, so
gradients are reduced over it. Example, world 8 = dp 2 x cp 2 x tp 2: rank 5 is at dp 1, cp 0,
tp 1; CP group [5, 7], DP group [1, 5], DP×CP group [1, 3, 5, 7], TP group [4, 5].

**Expert parallelism** (``ep``, default 1) is not a fifth factor of the world: it is *folded* over
the DP×CP ranks (``ep`` must divide ``dp·cp``), as Megatron-core does. Every DP×CP rank holds the
same dense parameters and its own tokens; the experts of an MoE layer are the only parameters
that are not replicated over DP×CP, so they are the ones sharded: each DP×CP group (in its order,
cp fastest) is cut into consecutive **EP groups** of ``ep`` ranks that split the experts between
them and exchange tokens by all-to-all, and the ranks with the same place in their EP group form
an **expert-DP group** (``dp·cp/ep`` ranks holding the same experts), which sums the expert
gradients. Folding costs no extra ranks: an MoE model's EP ranks still do data parallelism for
the dense layers. Example, world 8 = dp 4 x tp 2, ep 2: rank 5 is at dp 2, tp 1; DP group
[1, 3, 5, 7], EP group [5, 7], expert-DP group [1, 5]. With ``ep == 1`` the EP group is this rank
alone (``ep_group`` is ``LOCAL``, :data:`minidist.comm.p2p.LOCAL`: no group, no collective;
``None`` would be the world) and the expert-DP group is the DP×CP group.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .comm import hierarchical, topology
from .comm.p2p import LOCAL, destroy_group

__all__ = ["ProcessGrid", "grid_layout"]

_DIMS = ("dp", "pp", "tp")
_GROUP_ATTRS = ("dp_group", "pp_group", "tp_group", "cp_group", "dp_cp_group", "ep_group",
                "expert_dp_group", "embedding_group")


def grid_layout(world_size: int, dp: int, pp: int = 1, tp: int = 1,
                cp: int = 1, ep: int = 1) -> dict[str, list[list[int]]]:
    """The groups of each dimension as lists of global ranks, no processes needed.

    Returns ``{"dp": [...], "pp": [...], "tp": [...], "cp": [...], "dp_cp": [...], "ep": [...],
    "expert_dp": [...]}``, each a list of rank lists that partitions ``range(world_size)``
    (``"dp_cp"``: the ranks that hold the same dense parameters, DP replicas and CP ranks
    together; with ``cp == 1`` it is ``"dp"``; ``"ep"``/``"expert_dp"``: module docstring).

    Raises:
        ValueError: ``dp·pp·cp·tp != world_size``, a size < 1, or ``ep`` not dividing ``dp·cp``.
    """
    for name, n in zip(_DIMS + ("cp", "ep"), (dp, pp, tp, cp, ep)):
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"ProcessGrid: {name} must be an int >= 1, got {n!r}")
    if (dp * cp) % ep:
        raise ValueError(f"ProcessGrid: ep={ep} must divide dp x cp = {dp} x {cp} = {dp * cp} "
                         "(expert parallelism is folded over the data- and context-parallel "
                         "ranks)")
    if dp * pp * cp * tp != world_size:
        if cp == 1:
            raise ValueError(f"ProcessGrid: dp x pp x tp = {dp} x {pp} x {tp} = {dp * pp * tp}, "
                             f"but the world size is {world_size}")
        raise ValueError(f"ProcessGrid: dp x pp x cp x tp = {dp} x {pp} x {cp} x {tp} = "
                         f"{dp * pp * cp * tp}, but the world size is {world_size}")
    g = torch.arange(world_size).view(dp, pp, cp, tp)
    dp_cp = [g[:, p, :, t].reshape(-1).tolist() for p in range(pp) for t in range(tp)]
    return {
        "dp": [g[:, p, c, t].tolist() for p in range(pp) for c in range(cp) for t in range(tp)],
        "pp": [g[d, :, c, t].tolist() for d in range(dp) for c in range(cp) for t in range(tp)],
        "tp": [g[d, p, c, :].tolist() for d in range(dp) for p in range(pp) for c in range(cp)],
        "cp": [g[d, p, :, t].tolist() for d in range(dp) for p in range(pp) for t in range(tp)],
        "dp_cp": dp_cp,
        "ep": [ranks[i:i + ep] for ranks in dp_cp for i in range(0, len(ranks), ep)],
        "expert_dp": [ranks[j::ep] for ranks in dp_cp for j in range(ep)],
    }


def _new_group(ranks: list[int]):
    """``dist.new_group(ranks)``; under a two-level topology of the world
    (:mod:`minidist.comm.topology`), with the sub-groups ``algorithm="hierarchical"`` needs when
    the ranks sit evenly on the nodes they span (:func:`minidist.comm.hierarchical.new_group`), so
    that ``auto`` may pick it on the grid's groups. Every rank calls it for every group, in the
    same order, and decides alike (the topology is the same everywhere)."""
    topo = topology.current()
    if topo is not None and topo.size == dist.get_world_size():
        if len({sum(1 for r in ranks if topo.node(r) == n) for n in {topo.node(r) for r in ranks}}) == 1:
            return hierarchical.new_group(ranks)
    return dist.new_group(ranks)


class ProcessGrid:
    """This rank's place in a ``dp x pp x tp`` (``x cp``) grid and a process group per dimension.

    Every rank must construct it (``dist.new_group`` is collective), with the same sizes.
    Attributes: ``dp_rank``, ``pp_rank``, ``tp_rank`` (coordinates = ranks inside each group),
    ``dp_size``, ``pp_size``, ``tp_size``, ``dp_group``, ``pp_group``, ``tp_group``,
    ``dp_ranks``/``pp_ranks``/``tp_ranks`` (global ranks of this rank's groups), ``grid``;
    ``embedding_ranks`` / ``embedding_group``: the first and last stage of this rank's pipeline
    (``embedding_group`` is None on the stages between, and when ``pp == 1``).

    Context parallelism (``cp > 1``): ``cp_rank``, ``cp_size``, ``cp_group``, ``cp_ranks``, and
    ``dp_cp_group`` / ``dp_cp_ranks`` (DP replicas and CP ranks: reduce gradients over it). With
    ``cp == 1`` no group is created: ``cp_group`` is None (never pass it to a collective: None
    means the world), ``dp_cp_group`` is ``dp_group``.

    Expert parallelism (``ep``, folded over DP×CP; module docstring): ``ep_rank``, ``ep_size``,
    ``ep_group``, ``ep_ranks``, ``expert_dp_rank``, ``expert_dp_size``, ``expert_dp_group``,
    ``expert_dp_ranks``. With ``ep == 1``: ``ep_group`` ``LOCAL`` (the rank alone), the expert-DP group
    is the DP×CP group. Every attribute exists at every size: nothing to ``getattr`` with a default.

    Under a two-level topology (:mod:`minidist.comm.topology`) each group whose ranks sit evenly
    on the nodes it spans is made with the sub-groups of ``algorithm="hierarchical"``.

    Each group this rank belongs to holds gloo threads and sockets (12 threads per rank for a
    ``dp 2 x pp 2`` grid, measured) until it is destroyed: a process that builds many grids (a
    sweep, a test matrix) calls :meth:`close`, or uses the grid as a context manager. A closed
    grid keeps its coordinates; its ``*_group`` attributes are gone (an ``AttributeError`` that
    says so).
    """

    # set per dimension in __init__ (setattr over "dp", "pp", "tp"; with cp > 1 also "cp", "dp_cp")
    dp_group: Any
    pp_group: Any
    tp_group: Any
    dp_ranks: list[int]
    pp_ranks: list[int]
    tp_ranks: list[int]
    cp_group: Any
    dp_cp_group: Any
    cp_ranks: list[int]
    dp_cp_ranks: list[int]
    ep_group: Any
    ep_ranks: list[int]
    expert_dp_group: Any
    expert_dp_ranks: list[int]

    def __init__(self, dp: int, pp: int = 1, tp: int = 1, cp: int = 1, ep: int = 1):
        if not dist.is_initialized():
            raise RuntimeError("ProcessGrid: the process group is not initialised; run inside "
                               "minidist.run(...) or after minidist.init()")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        try:
            layout = grid_layout(self.world_size, dp, pp, tp, cp, ep)
        except ValueError as e:  # every rank raises the same, before any communication
            raise ValueError(f"{e} (rank {self.rank})") from None
        self.dp_size, self.pp_size, self.tp_size, self.cp_size = dp, pp, tp, cp
        full = torch.arange(self.world_size).view(dp, pp, cp, tp)
        d, p, c, t = (int(i) for i in (full == self.rank).nonzero()[0])
        self.grid = full if cp > 1 else full.view(dp, pp, tp)
        self.dp_rank, self.pp_rank, self.tp_rank, self.cp_rank = d, p, t, c
        self.cp_group, self.cp_ranks = None, [self.rank]
        dims = _DIMS + (("cp", "dp_cp") if cp > 1 else ()) + (("ep", "expert_dp") if ep > 1 else ())
        self._own: list = []   # the groups this rank is a member of: close() destroys them
        for dim in dims:  # every rank creates every group, in the same order
            for ranks in layout[dim]:
                group = _new_group(ranks)
                if self.rank in ranks:
                    self._own.append(group)
                    setattr(self, f"{dim}_group", group)
                    setattr(self, f"{dim}_ranks", ranks)
        if cp == 1:
            self.dp_cp_group, self.dp_cp_ranks = self.dp_group, self.dp_ranks
        if ep == 1:
            self.ep_group, self.ep_ranks = LOCAL, [self.rank]
            self.expert_dp_group, self.expert_dp_ranks = self.dp_cp_group, self.dp_cp_ranks
        self.ep_size, self.expert_dp_size = ep, dp * cp // ep
        self.ep_rank = self.ep_ranks.index(self.rank)
        self.expert_dp_rank = self.expert_dp_ranks.index(self.rank)
        self.embedding_ranks = sorted({self.pp_ranks[0], self.pp_ranks[-1]})
        self.embedding_group = None
        if pp > 1:
            for ranks in layout["pp"]:
                group = _new_group([ranks[0], ranks[-1]])
                if self.rank in (ranks[0], ranks[-1]):
                    self.embedding_group = group
                    self._own.append(group)

    def close(self) -> None:
        """Destroy this rank's process groups of the grid (local: no rank waits for another) and
        free their threads. Idempotent. Every collective on them must have finished: close after
        the training function's last step, and after closing what runs on the groups (a
        BucketedDDP's or a ShardedOptimizer's ``close()``, ``close_units`` of a fully_shard model)."""
        own, self._own = self._own, []
        for group in own:
            hierarchical.destroy_subgroups(group)
            destroy_group(group)
        for name in _GROUP_ATTRS:   # drop the references too: the groups' threads go with them
            self.__dict__.pop(name, None)
        self._closed = True

    def __getattr__(self, name: str):
        if name in _GROUP_ATTRS and self.__dict__.get("_closed"):
            raise AttributeError(f"ProcessGrid (rank {self.rank}): {name} is gone, the grid was "
                                 "closed (close() destroys its process groups); build a new grid")
        raise AttributeError(f"'ProcessGrid' object has no attribute {name!r}")

    def __enter__(self) -> "ProcessGrid":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def __repr__(self) -> str:
        return (f"ProcessGrid(rank {self.rank}: dp {self.dp_rank}/{self.dp_size}, pp {self.pp_rank}/"
                f"{self.pp_size}, tp {self.tp_rank}/{self.tp_size}"
                + (f", cp {self.cp_rank}/{self.cp_size}" if self.cp_size > 1 else "")
                + (f", ep {self.ep_rank}/{self.ep_size}" if self.ep_size > 1 else "")
                + f"; dp group {self.dp_ranks}, pp group {self.pp_ranks}, tp group {self.tp_ranks}"
                + (f", cp group {self.cp_ranks}" if self.cp_size > 1 else "")
                + (f", ep group {self.ep_ranks}, expert-dp group {self.expert_dp_ranks}"
                   if self.ep_size > 1 else "") + ")")
