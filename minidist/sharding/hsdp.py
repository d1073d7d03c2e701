"""Hybrid sharding (HSDP, Zhao et al. 2023, §3.2.2; FSDP2's 2-D mesh): W = R·S ranks, sharded within
each row of S consecutive ranks (a node), replicated down the columns; each gradient piece is
reduce-scattered in the row, then all-reduced in the column (only that crosses nodes, as ZeRO++'s
hpZ, Wang et al. 2023, §3.2). :func:`hsdp_mesh`, :func:`resolve`, :func:`check_layout`.
Design notes: docs/design/sharding.md
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from ..communicator import Communicator

__all__ = ["HSDPMesh", "hsdp_mesh", "resolve", "check_layout", "thread_copy", "release",
           "replicate_ranks"]


class HSDPMesh(NamedTuple):
    """This rank's two groups of an R x S mesh: ``replicate`` (size R) and ``shard`` (size S),
    in the order of torch's ``mesh_dim_names=("replicate", "shard")``."""

    replicate: object
    shard: object


_MESHES: dict = {}   # (R, S) -> (the world it was built in, HSDPMesh)


def hsdp_mesh(replicate: int, shard: int) -> HSDPMesh:
    """This rank's groups in an R x S mesh over the world, as ``init_device_mesh("cpu", (R, S))``:
    shard groups consecutive ranks, replicate groups every S-th. Collective; cached per process.
    Raises ``ValueError`` (every rank, before any group) unless R, S >= 1 and R·S = world size."""
    if not dist.is_initialized():
        raise RuntimeError("hsdp_mesh: the process group is not initialised; run inside "
                           "minidist.run(...) or call minidist.init() first")
    me, world = dist.get_rank(), dist.get_world_size()
    if replicate < 1 or shard < 1 or replicate * shard != world:
        raise ValueError(f"hsdp_mesh (rank {me}): replicate={replicate} x shard={shard} = "
                         f"{replicate * shard} ranks, expected both >= 1 and their product = "
                         f"the world size {world}")
    here = dist.GroupMember.WORLD
    hit = _MESHES.get((replicate, shard))
    if hit is not None and hit[0] is here:
        return hit[1]
    mine: dict = {}
    for r in range(replicate):               # every rank makes every group, in the same order
        ranks = list(range(r * shard, (r + 1) * shard))
        g = dist.new_group(ranks)
        if me in ranks:
            mine["shard"] = g
    for s in range(shard):
        ranks = list(range(s, world, shard))
        g = dist.new_group(ranks)
        if me in ranks:
            mine["replicate"] = g
    mesh = HSDPMesh(mine["replicate"], mine["shard"])
    _MESHES[(replicate, shard)] = (here, mesh)
    return mesh


def resolve(mesh, group, replicate_group) -> tuple:
    """``(shard group, replicate group or None)`` from ``mesh`` or ``group``/``replicate_group``.
    ``ValueError`` for both forms at once or a mesh of more than 2 dims."""
    if mesh is None:
        return group, replicate_group
    if group is not None or replicate_group is not None:
        raise ValueError("fully_shard: pass either mesh=(replicate, shard) or group= / "
                         "replicate_group=, not both")
    if hasattr(mesh, "get_group") and hasattr(mesh, "ndim"):      # torch's DeviceMesh
        if mesh.ndim == 1:
            return mesh.get_group(0), None
        if mesh.ndim == 2:
            return mesh.get_group(1), mesh.get_group(0)
        raise ValueError(f"fully_shard: a DeviceMesh of {mesh.ndim} dims; expected 1 (shard) "
                         "or 2 (replicate, shard)")
    if isinstance(mesh, tuple) and len(mesh) == 2:
        return mesh[1], mesh[0]
    raise ValueError(f"fully_shard: mesh must be an HSDPMesh, a (replicate group, shard group) "
                     f"pair or a torch DeviceMesh, got {type(mesh).__name__}")


def replicate_ranks(comm: Communicator | None) -> list[int] | None:
    """The global ranks of a unit's replicate communicator, or None (plain FSDP)."""
    return None if comm is None else _ranks(comm.group)


def _ranks(group) -> list[int]:
    return (list(range(dist.get_world_size())) if group is None
            else dist.get_process_group_ranks(group))


_CHECKED: dict = {}   # (id(shard group), id(replicate group)) -> the pair, once checked


def check_layout(where: str, shard, replicate, collectives: str = "hand-built") -> None:
    """Refuse (``ValueError``, same verdict on every member) a replicate group that overlaps the shard
    group or whose members hold different pieces; one all-gather over the replicate group."""
    me = dist.get_rank()
    key = (id(shard), id(replicate))
    hit = _CHECKED.get(key)
    if hit is not None and hit[0] is shard and hit[1] is replicate:
        return
    s_ranks, r_ranks = _ranks(shard), _ranks(replicate)
    both = sorted(set(s_ranks) & set(r_ranks))
    comm = Communicator(collectives, replicate, where=where)
    # every member gathers before anyone decides: a rank that raised alone would leave the others
    # waiting in this all-gather
    mine = torch.tensor([float(both == [me]), dist.get_rank(shard) if shard is not None else me,
                         len(s_ranks)], dtype=torch.float64)
    every = torch.empty(comm.world_size, 3, dtype=torch.float64)
    comm.all_gather(every, mine)
    rows = [(int(ok), int(a), int(b)) for ok, a, b in every.tolist()]
    if both != [me] or not all(ok for ok, _, _ in rows):
        bad = [g for g, (ok, _, _) in zip(r_ranks, rows) if not ok]
        what = (f"overlaps the shard group {s_ranks} in ranks {both}" if both != [me] else
                f"overlaps the shard groups of its members {bad}")
        raise ValueError(f"{where} (rank {me}): replicate_group {r_ranks} {what}; expected each "
                         "replicate group to share exactly one rank with each shard group (ranks "
                         "[0, 2] with shard groups [0, 1], [2, 3] in a 2 x 2 mesh: build them "
                         "with hsdp_mesh(R, S))")
    seen = [(a, b) for _, a, b in rows]
    if any(p != seen[0] for p in seen):
        raise ValueError(f"{where} (rank {me}): the members {r_ranks} of replicate_group hold "
                         "(shard rank, shard group size) "
                         + ", ".join(f"rank {g}: {p}" for g, p in zip(r_ranks, seen))
                         + "; expected the same piece of equal shard groups on every member "
                           "(replicas of one shard; build the groups with hsdp_mesh(R, S))")
    _CHECKED[key] = (shard, replicate)


def thread_copy(comm: Communicator) -> Communicator:
    """``comm`` on a process group of its own (same members), for a communication thread. Collective."""
    own = dist.new_group(ranks=_ranks(comm.group), use_local_synchronization=True)
    if isinstance(own, dist.ProcessGroup) and dist.get_backend(own) == "gloo":
        dist.barrier(group=own)
    return Communicator(comm.collectives, own, algorithm=comm.algorithm)


def release(comm: Communicator) -> None:
    """Destroy the group of a :func:`thread_copy` (its gloo threads) once its thread is done."""
    try:
        dist.destroy_process_group(comm.group)
    except ValueError:   # "Invalid process group": gone with the world already
        pass
