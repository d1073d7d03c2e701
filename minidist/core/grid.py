"""The process grid: the world's ranks laid out as ``arange(world).view(dp, pp, cp, tp)``.

Tensor-parallel ranks are neighbours (they talk most: one node, NVLink), then context-parallel
ranks, then pipeline stages, then data-parallel replicas. A rank's group of a dimension is the
ranks that differ from it only along that dimension. Parameters are replicated over DP and CP
together (the DP×CP group reduces the gradients); expert parallelism is folded over the DP×CP
ranks: consecutive EP groups of ``ep`` ranks, and the expert-DP groups across them. The first
and last stage of each pipeline form the embedding group (a tied embedding's two copies).
Sources: Megatron-LM's megatron/core/parallel_state.py (initialize_model_parallel);
picotron's process_group_manager.
"""

import math

import torch
import torch.distributed as dist


def coordinates(rank, dp, pp=1, cp=1, tp=1):
    """``(dp_rank, pp_rank, cp_rank, tp_rank)``: where ``rank`` sits, tp fastest."""
    rest, t = divmod(rank, tp)
    rest, c = divmod(rest, cp)
    d, p = divmod(rest, pp)
    return d, p, c, t


def _along(g, *dims):
    """The groups of ranks that differ only along ``dims`` (the other dimensions outermost)."""
    rest = [i for i in range(g.dim()) if i not in dims]
    size = math.prod(g.shape[i] for i in dims)
    return g.permute(*rest, *dims).reshape(-1, size).tolist()


def group_ranks(dp, pp=1, cp=1, tp=1, ep=1):
    """``{dimension: [group's ranks, ...]}``, each dimension's groups partitioning the world."""
    g = torch.arange(dp * pp * cp * tp).view(dp, pp, cp, tp)
    dp_cp = _along(g, 0, 2)
    return {
        "dp": _along(g, 0), "pp": _along(g, 1), "tp": _along(g, 3),
        "cp": _along(g, 2), "dp_cp": dp_cp,
        "ep": [r[i:i + ep] for r in dp_cp for i in range(0, len(r), ep)],
        "expert_dp": [r[j::ep] for r in dp_cp for j in range(ep)],
        "embedding": [[r[0], r[-1]] for r in _along(g, 1)],
    }


def new_groups(dp, pp=1, cp=1, tp=1, ep=1):
    """This rank's ``{dimension: (ranks, process group)}``. Collective: every rank creates every
    group (``dist.new_group``), in the same order. A dimension of size 1 gets no group (with
    ``cp == 1`` the DP×CP group is the DP group; with ``ep == 1`` expert-DP is DP×CP)."""
    rank = dist.get_rank()
    needed = {"dp": True, "pp": True, "tp": True, "cp": cp > 1, "dp_cp": cp > 1,
              "ep": ep > 1, "expert_dp": ep > 1, "embedding": pp > 1}
    mine = {}
    for dim, groups in group_ranks(dp, pp, cp, tp, ep).items():
        if not needed[dim]:
            continue
        for ranks in groups:
            group = dist.new_group(ranks)
            if rank in ranks:
                mine[dim] = (ranks, group)
    mine.setdefault("dp_cp", mine["dp"])
    mine.setdefault("expert_dp", mine["dp_cp"])
    return mine
