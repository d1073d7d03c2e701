"""Hand-built collectives with torch.distributed's names and in-place semantics.

Each function checks its input (``debug=True`` / ``MINIDIST_DEBUG=1``: also that every rank passed
the same arguments), then runs an algorithm of ``minidist.comm`` built from isend/irecv
(:data:`ALGORITHMS`; ``"auto"``: the tuner's choice; ``"hierarchical"``: needs a two-level
topology). Ops ``sum``, ``avg``, ``max``, ``min``; ranks and roots are ranks inside ``group``;
non-contiguous tensors go through a copy. Each returns its output tensor.

Design notes: docs/design/ground.md"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .comm import (agreed, hierarchical, naive, p2p, recursive_doubling, ring, topology, tree, tuner,
                   tuner_topology)
from .comm.ops import (check_exchange_sizes, check_group, check_same_across_ranks, check_sizes_agree,
                       combine_, contiguous, debug_enabled, finish_avg_, normalize_op)

__all__ = ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "all_to_all",
           "ALGORITHMS", "TOPOLOGY_ALGORITHMS", "AUTO", "resolve_algorithm"]

AUTO = "auto"  # the algorithm name that asks the tuner (ops in tuner.CANDIDATES)

ALGORITHMS: dict[str, dict] = {
    "all_reduce": {"ring": ring.all_reduce, "naive": naive.all_reduce,
                   "recursive_doubling": recursive_doubling.all_reduce},
    "reduce_scatter": {"ring": ring.reduce_scatter_chunks, "naive": naive.reduce_scatter_chunks},
    "all_gather": {"ring": ring.all_gather_chunks, "naive": naive.all_gather_chunks},
    "broadcast": {"tree": tree.broadcast, "naive": naive.broadcast, "ring": ring.broadcast},
    "reduce": {"tree": tree.reduce, "naive": naive.reduce},
}
# the algorithms that need an installed two-level topology (minidist.comm.topology)
TOPOLOGY_ALGORITHMS: dict[str, dict] = {
    "all_reduce": {"hierarchical": hierarchical.all_reduce},
    "reduce_scatter": {"hierarchical": hierarchical.reduce_scatter_chunks},
    "all_gather": {"hierarchical": hierarchical.all_gather_chunks},
}


def _algorithm(opname: str, algorithm: str):
    """The function of ``algorithm`` for ``opname``, looked up per call (tests replace entries)."""
    fn = ALGORITHMS[opname].get(algorithm)
    return fn if fn is not None else TOPOLOGY_ALGORITHMS[opname][algorithm]


def _check_movable(opname: str, **tensors) -> None:
    """Refuse a sparse or meta tensor before any message (after one, a hang)."""
    for arg, value in tensors.items():
        items = value if isinstance(value, (list, tuple)) else [value]
        for i, t in enumerate(items):
            if not isinstance(t, torch.Tensor):
                continue
            where = (f"{opname} (rank {dist.get_rank()}): {arg}"
                     + (f"[{i}]" if isinstance(value, (list, tuple)) else ""))
            if t.layout != torch.strided:
                raise ValueError(f"{where} is a sparse tensor ({t.layout}); collectives move dense "
                                 "(strided) tensors: pass t.to_dense(), or move its indices and "
                                 "values as two dense tensors")
            if t.device.type == "meta":
                raise ValueError(f"{where} is on the meta device (a shape without data); "
                                 "materialise it first (e.g. module.to_empty(device='cpu') and "
                                 "initialise, or torch.empty_like(t, device='cpu'))")


def _setup(opname: str, algorithm: str, tensor, group, arg: str = "tensor", **others):
    if not dist.is_initialized():
        raise RuntimeError(f"{opname}: the process group is not initialised; run inside "
                           "minidist.run(...) or call minidist.init() first")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{opname}: expected a torch.Tensor, got {type(tensor).__name__}")
    check_group(opname, group)
    _check_movable(opname, **{arg: tensor}, **others)
    table = ALGORITHMS.get(opname)
    if table is not None:
        table = {**table, **TOPOLOGY_ALGORITHMS.get(opname, {})}
    if opname == "all_reduce" and algorithm == "tree":
        raise ValueError("all_reduce: algorithm 'tree' is now called 'recursive_doubling' (log2 W "
                         "rounds of pairwise exchange; 'tree' names only the binomial-tree "
                         "broadcast and reduce)")
    if table is not None and algorithm not in table and not (
            algorithm == AUTO and opname in tuner.CANDIDATES):
        names = sorted(table) + ([AUTO] if opname in tuner.CANDIDATES else [])
        raise ValueError(f"{opname} (rank {dist.get_rank(group)}): algorithm must be one of "
                         f"{names}, got {algorithm!r}")
    if algorithm in TOPOLOGY_ALGORITHMS.get(opname, ()):
        hierarchical.check(opname, group)   # before any message, on every rank alike
    return p2p.rank_and_size(group)


def resolve_algorithm(opname: str, algorithm: str, nbytes: int, itemsize: int, world: int,
                      group=None, debug: bool | None = None) -> str:
    """``algorithm``, or for ``"auto"`` the tuner's choice, the same on every rank of ``group``."""
    if algorithm != AUTO:
        return algorithm
    if topology.state.maybe and world > 1 and topology.current() is not None:   # two levels
        return tuner_topology.choose(opname, world, nbytes, itemsize, group, debug_enabled(debug))
    return tuner.choose(opname, world, nbytes, itemsize, group, debug_enabled(debug))


def _data(tensor):
    """What the algorithms move: ``tensor`` detached, a complex one as its real view ``[..., 2]``."""
    if isinstance(tensor, (list, tuple)):
        return [_data(t) for t in tensor]
    if not isinstance(tensor, torch.Tensor):
        return tensor
    t = tensor.detach() if tensor.requires_grad else tensor
    return torch.view_as_real(t) if t.is_complex() else t


def _check_root(opname: str, root: int, rank: int, world: int) -> None:
    if not isinstance(root, int) or not 0 <= root < world:
        raise ValueError(f"{opname} (rank {rank}): root must be a rank in 0..{world - 1}, got {root!r}")


def all_reduce(tensor: torch.Tensor, op="sum", algorithm: str = "ring", group=None,
               debug: bool | None = None) -> torch.Tensor:
    """Reduce ``tensor`` (any shape, the same on every rank) across ranks, in place.

    Traffic per rank (ring): 2(W-1)/W · numel elements."""
    rank, world = _setup("all_reduce", algorithm, tensor, group)
    op = normalize_op(op, tensor.dtype, f"all_reduce (rank {rank})")
    debug = debug_enabled(debug)
    algorithm = resolve_algorithm("all_reduce", algorithm, tensor.numel() * tensor.element_size(),
                                  tensor.element_size(), world, group, debug)
    if debug:
        check_same_across_ranks("all_reduce", group, shape=tuple(tensor.shape), dtype=tensor.dtype,
                                op=op, algorithm=algorithm)
    with contiguous(_data(tensor)) as t, p2p.collective(f"all_reduce/{algorithm}"):
        if world > 1 and t.numel() > 0:
            _algorithm("all_reduce", algorithm)(t if t.dim() == 1 else t.view(-1), op, rank,
                                                world, group)
        finish_avg_(t, op, world)
    return tensor


def _as_chunks(big: torch.Tensor | list, small: torch.Tensor, rank: int, world: int, opname: str,
               role: str) -> list[torch.Tensor]:
    """The W per-rank pieces of ``big``: a list of W tensors, or one tensor of W·small.numel()."""
    if isinstance(big, (list, tuple)):
        if len(big) != world:
            raise ValueError(f"{opname} (rank {rank}): {role} list has {len(big)} tensors, "
                             f"expected world size {world}")
        for i, b in enumerate(big):
            if not b.is_contiguous() or b.dtype != small.dtype:
                raise ValueError(f"{opname} (rank {rank}): {role}[{i}] must be contiguous and "
                                 f"{small.dtype}, got contiguous={b.is_contiguous()}, {b.dtype}")
        if big[rank].numel() != small.numel():
            raise ValueError(f"{opname} (rank {rank}): {role}[{rank}] has {big[rank].numel()} "
                             f"elements, this rank's tensor {small.numel()}")
        return list(big)
    if not isinstance(big, torch.Tensor) or not big.is_contiguous():
        raise ValueError(f"{opname} (rank {rank}): {role} must be a contiguous tensor or a list")
    if big.numel() != world * small.numel() or big.dtype != small.dtype:
        raise ValueError(f"{opname} (rank {rank}): {role} must hold world_size x {small.numel()} = "
                         f"{world * small.numel()} elements of {small.dtype}, got "
                         f"{big.numel()} of {big.dtype}")
    return list(big.view(-1).split(small.numel())) if small.numel() else [big.view(-1)] * world


def _agree(opname, chunks, rank, world, algorithm, group, debug, sizes_agreed, agree_at,
           **fields) -> bool:
    """Agree the per-rank sizes before data moves (a disagreement would leave a stale element or
    abort gloo, ops.py); True when the data moved with the agreement (:mod:`.comm.agreed`: at
    W = 2 on gloo the ring is one exchange, and a call site ``agree_at`` that agreed these sizes
    before sends them beside the data)."""
    sizes = [c.numel() for c in chunks]
    if debug_enabled(debug):
        check_same_across_ranks(opname, group, sizes=sizes, algorithm=algorithm, **fields)
        return False
    if sizes_agreed:
        return False
    if (agree_at is None or world != 2 or algorithm != "ring" or chunks[rank].device.type != "cpu"
            or dist.get_backend(group) != "gloo"):
        check_sizes_agree(opname, group, sizes, chunks[rank].device)
        return False
    peer = 1 - rank
    if opname == "all_gather":
        return agreed.exchange_agreed(opname, group, agree_at, sizes, chunks[rank], chunks[peer])
    incoming = torch.empty_like(chunks[rank])
    if not agreed.exchange_agreed(opname, group, agree_at, sizes, chunks[peer], incoming):
        return False
    combine_(chunks[rank], incoming, fields["op"])   # as the ring's one step does
    return True


def reduce_scatter(output: torch.Tensor, input, op="sum", algorithm: str = "ring", group=None,
                   debug: bool | None = None, *, sizes_agreed: bool = False,
                   agree_at=None) -> torch.Tensor:
    """Reduce ``input`` across ranks and leave piece ``rank`` of the result in ``output``.

    ``input``: a list of W tensors (piece r is ``input[r]``, numel of rank r's ``output``) or one
    tensor of W · output.numel() elements; it is used as scratch space. Traffic (ring): (W-1)/W of it.
    ``sizes_agreed``: the caller knows every rank passes the same sizes (a backward whose shapes
    the forward's collective checked): the always-on size agreement, one small all-reduce, is skipped.
    ``agree_at``: a name for this call site, the same on every rank (tensor parallelism's module
    scope): at W = 2 on gloo, once the site agreed these sizes, they travel beside the data instead
    of a round trip before it (:mod:`minidist.comm.agreed`)."""
    rank, world = _setup("reduce_scatter", algorithm, output, group, "output", input=input)
    op = normalize_op(op, output.dtype, f"reduce_scatter (rank {rank})")
    pieces = _data(input)
    if isinstance(pieces, list):                  # scratch space: contiguous copies are fine
        pieces = [c if c.is_contiguous() else c.contiguous() for c in pieces]
    with contiguous(_data(output)) as out:
        chunks = _as_chunks(pieces, out, rank, world, "reduce_scatter", "input")
        algorithm = resolve_algorithm("reduce_scatter", algorithm,
                                      sum(c.numel() for c in chunks) * out.element_size(),
                                      out.element_size(), world, group, debug)
        chunks = [c.view(-1) for c in chunks]
        with p2p.collective(f"reduce_scatter/{algorithm}"):
            if not _agree("reduce_scatter", chunks, rank, world, algorithm, group, debug,
                          sizes_agreed, agree_at, dtype=out.dtype, op=op):
                _algorithm("reduce_scatter", algorithm)(chunks, op, rank, world, group)
        out.view(-1).copy_(chunks[rank])
        finish_avg_(out, op, world)
    return output


def all_gather(output, input: torch.Tensor, algorithm: str = "ring", group=None,
               debug: bool | None = None, *, sizes_agreed: bool = False, agree_at=None):
    """Gather every rank's ``input`` into ``output`` on every rank.

    ``output``: a list of W tensors (``output[r]`` receives rank r's input; sizes may differ) or one
    tensor of W · input.numel() elements. Traffic per rank (ring): (W-1) · input.numel() sent.
    ``sizes_agreed``, ``agree_at``: as in :func:`reduce_scatter`."""
    rank, world = _setup("all_gather", algorithm, input, group, "input", output=output)
    result, output, mine = output, _data(output), _data(input)
    strided = isinstance(output, list) and any(not o.is_contiguous() for o in output)
    if strided:                                   # gather into contiguous copies, copy back
        targets, output = output, [o.contiguous() for o in output]
    chunks = _as_chunks(output, mine, rank, world, "all_gather", "output")
    algorithm = resolve_algorithm("all_gather", algorithm,
                                  sum(c.numel() for c in chunks) * mine.element_size(),
                                  mine.element_size(), world, group, debug)
    chunks = [c.view(-1) for c in chunks]
    chunks[rank].copy_(mine.reshape(-1))
    with p2p.collective(f"all_gather/{algorithm}"):
        if not _agree("all_gather", chunks, rank, world, algorithm, group, debug, sizes_agreed,
                      agree_at, dtype=mine.dtype):
            _algorithm("all_gather", algorithm)(chunks, rank, world, group)
    if strided:
        for target, work in zip(targets, output):
            target.copy_(work)
    return result


def broadcast(tensor: torch.Tensor, src: int, algorithm: str = "tree", group=None,
              debug: bool | None = None) -> torch.Tensor:
    """Copy ``tensor`` from rank ``src`` to every rank, in place."""
    rank, world = _setup("broadcast", algorithm, tensor, group)
    _check_root("broadcast", src, rank, world)
    algorithm = resolve_algorithm("broadcast", algorithm, tensor.numel() * tensor.element_size(),
                                  tensor.element_size(), world, group, debug)
    if debug_enabled(debug):
        check_same_across_ranks("broadcast", group, shape=tuple(tensor.shape), dtype=tensor.dtype,
                                src=src, algorithm=algorithm)
    else:  # always on: cheap, and a disagreement would leave a stale element (ops.py)
        check_sizes_agree("broadcast", group, [tensor.numel()], tensor.device, root=src)
    with contiguous(_data(tensor)) as t, p2p.collective(f"broadcast/{algorithm}"):
        if world > 1 and t.numel() > 0:
            _algorithm("broadcast", algorithm)(t.view(-1), src, rank, world, group)
    return tensor


def reduce(tensor: torch.Tensor, dst: int, op="sum", algorithm: str = "tree", group=None,
           debug: bool | None = None) -> torch.Tensor:
    """Reduce ``tensor`` across ranks into rank ``dst`` (in place there; others hold scratch)."""
    rank, world = _setup("reduce", algorithm, tensor, group)
    _check_root("reduce", dst, rank, world)
    op = normalize_op(op, tensor.dtype, f"reduce (rank {rank})")
    if debug_enabled(debug):
        check_same_across_ranks("reduce", group, shape=tuple(tensor.shape), dtype=tensor.dtype,
                                op=op, dst=dst, algorithm=algorithm)
    with contiguous(_data(tensor)) as t, p2p.collective(f"reduce/{algorithm}"):
        if world > 1 and t.numel() > 0:
            _algorithm("reduce", algorithm)(t.view(-1), op, dst, rank, world, group)
        if rank == dst:
            finish_avg_(t, op, world)
    return tensor


def all_to_all(output: list, input: list, group=None, debug: bool | None = None) -> list:
    """Rank r sends ``input[j]`` to rank j, and receives rank j's ``input[r]`` into ``output[j]``."""
    rank, world = _setup("all_to_all", "naive", input[0] if input else None, group, "input[0]",
                         input=input, output=output)
    if len(output) != world or len(input) != world:
        raise ValueError(f"all_to_all (rank {rank}): need {world} input and output tensors, got "
                         f"{len(input)} and {len(output)}")
    if any(not t.is_contiguous() for t in list(output) + list(input)):
        raise ValueError(f"all_to_all (rank {rank}): all tensors must be contiguous")
    if debug_enabled(debug):
        sizes = [(tuple(i.shape), str(i.dtype)) for i in input]
        everyone: list = [None] * world
        dist.all_gather_object(everyone, sizes, group=group)
        for j in range(world):
            want = everyone[j][rank]
            if (tuple(output[j].shape), str(output[j].dtype)) != want:
                from .comm.ops import CollectiveMismatchError
                raise CollectiveMismatchError(
                    f"all_to_all: rank {rank} expects output[{j}] {tuple(output[j].shape)} "
                    f"{output[j].dtype} but rank {j} sends {want[0]} {want[1]}")
    else:  # always on: cheap, and a disagreement would leave a stale element (ops.py)
        check_exchange_sizes("all_to_all", group, [t.numel() for t in input],
                             [t.numel() for t in output], input[0].device)
    with p2p.collective("all_to_all/naive"):
        naive.all_to_all(_data(list(output)), _data(list(input)), rank, world, group)
    return output
