"""The process grid: which ranks do data, pipeline, tensor, context and expert parallelism together.

Ranks are laid out as ``torch.arange(world).view(dp, pp, cp, tp)`` (picotron, Megatron-LM): TP
neighbours, then CP, PP, DP. A rank's group of dimension d holds the ranks that differ from it
only in d; the DP×CP group reduces gradients; ``ep`` is folded over DP×CP (Megatron-core).
Example, world 8 = dp 2 x pp 2 x tp 2: rank 5 is at (1, 0, 1); DP [1, 5], PP [5, 7], TP [4, 5].

Design notes: docs/design/ground.md"""

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

    Returns ``{"dp", "pp", "tp", "cp", "dp_cp", "ep", "expert_dp": [[rank, ...], ...]}``, each a
    partition of ``range(world_size)``. ValueError: ``dp·pp·cp·tp != world_size``, a size < 1, or
    ``ep`` not dividing ``dp·cp``."""
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
    """``dist.new_group(ranks)``, with the hierarchical sub-groups under a two-level topology."""
    topo = topology.current()
    if topo is not None and topo.size == dist.get_world_size():
        if len({sum(1 for r in ranks if topo.node(r) == n) for n in {topo.node(r) for r in ranks}}) == 1:
            return hierarchical.new_group(ranks)
    return dist.new_group(ranks)


class ProcessGrid:
    """This rank's place in a ``dp x pp x cp x tp`` grid (``ep`` folded) and a group per dimension.

    Every rank constructs it (collective) with the same sizes. For d in dp, pp, tp, cp, ep, expert_dp:
    ``d_rank``, ``d_size``, ``d_group``, ``d_ranks``; also ``dp_cp_*``, ``embedding_*`` and ``grid``,
    at every size (``cp == 1``: ``cp_group`` None, never a collective's group; ``ep == 1``: ``LOCAL``).
    :meth:`close` (or ``with``) frees the groups' threads.
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
        """Destroy this rank's groups of the grid (local, idempotent) after every collective on them
        has finished, and after closing what runs on them (a BucketedDDP, a ShardedOptimizer, ...)."""
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
