"""The region operators of tensor parallelism, with Megatron-LM's names (Shoeybi et al. 2019, §3).

One autograd Function, ``_Region``, told its forward move and the conjugate backward move; a split
dimension must divide by W (``ValueError`` naming the rank); with W = 1 all are the identity.
Design notes: docs/design/tensor_parallel.md
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import collectives as C
from ..comm import tuner
from ..comm.p2p import group_rank_world
from . import accounting

__all__ = [
    "copy_to_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region",
    "scatter_to_tensor_model_parallel_region", "gather_from_tensor_model_parallel_region",
    "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region", "all_reduce", "all_gather", "reduce_scatter",
    "split_along", "gather_along", "reduce_scatter_along",
]


# ------------------------------------------------------------------ the four moves (no autograd)
def _chunks(x: torch.Tensor, dim: int, group, what: str) -> tuple[int, list[torch.Tensor]]:
    rank, world = group_rank_world(group)
    if x.shape[dim] % world:
        raise ValueError(f"{what} (rank {rank}): dimension {dim} of shape {tuple(x.shape)} has "
                         f"size {x.shape[dim]}, not divisible by the tensor-parallel size {world}")
    return rank, list(x.chunk(world, dim=dim))


def split_along(x: torch.Tensor, dim: int, group=None, what: str = "split") -> torch.Tensor:
    """This rank's contiguous slice of ``x`` along ``dim`` (sizes must divide by the TP size)."""
    if group_rank_world(group)[1] == 1:
        return x
    rank, pieces = _chunks(x, dim, group, what)
    return pieces[rank].contiguous()


def gather_along(x: torch.Tensor, dim: int, group=None, sizes_agreed: bool = False,
                 agree_at=None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``, in rank order: ``x.shape[dim]`` grows W-fold.
    ``sizes_agreed``: skip the size agreement; ``agree_at``: the call site, whose agreement can
    travel with the data (both: :func:`minidist.collectives.all_gather`)."""
    _, world = group_rank_world(group)
    if world == 1:
        return x
    x = x.contiguous()
    pieces = [torch.empty_like(x) for _ in range(world)]
    C.all_gather(pieces, x, group=group, sizes_agreed=sizes_agreed, agree_at=agree_at)
    return torch.cat(pieces, dim=dim)


def reduce_scatter_along(x: torch.Tensor, dim: int, group=None, sizes_agreed: bool = False,
                         agree_at=None) -> torch.Tensor:
    """Sum ``x`` over ranks and keep this rank's slice of ``dim`` (divisible by W: else ValueError).
    ``sizes_agreed``, ``agree_at``: as in :func:`gather_along`
    (:func:`minidist.collectives.reduce_scatter`)."""
    if group_rank_world(group)[1] == 1:
        return x
    rank, pieces = _chunks(x, dim, group, "reduce_scatter")
    out = torch.empty_like(pieces[rank], memory_format=torch.contiguous_format)
    C.reduce_scatter(out, [p.contiguous() for p in pieces], "sum", group=group,
                     sizes_agreed=sizes_agreed, agree_at=agree_at)
    return out


def _sum(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    return C.all_reduce(x.contiguous().clone(), "sum", _all_reduce_algorithm(group), group)


def _all_reduce_algorithm(group) -> str:
    """The fewest rounds among the all-reduces that send no more than the ring (the traffic
    :func:`accounting.block_formula` counts): recursive doubling at W = 2 (one exchange of the
    whole buffer, the ring's two of half), the ring above (recursive doubling sends more)."""
    world = group_rank_world(group)[1]
    rd, ring = (tuner.coefficients("all_reduce", a, world) for a in ("recursive_doubling", "ring"))
    return "recursive_doubling" if rd[0] < ring[0] and rd[1] <= ring[1] else "ring"


# name -> (function, payload bytes of the collective as a multiple of the input's bytes)
_MOVES: dict[str, tuple[Callable[..., torch.Tensor], int | None]] = {
    "identity": (lambda x, dim, group: x.view_as(x), 0),
    "split": (lambda x, dim, group: split_along(x, dim, group, "split to region"), 0),
    "all_reduce": (_sum, 1),
    "all_gather": (gather_along, None),   # None: W times the input (the gathered output)
    "reduce_scatter": (reduce_scatter_along, 1),
}


# The moves whose collective checks that every rank passes the same sizes. A backward after one of
# them skips the check: the gradient has the forward output's shape, so its pieces have the sizes
# the forward agreed on (all-gather: the input's; reduce-scatter: the output's).
_CHECKED = ("all_gather", "reduce_scatter")


def _move(name: str, x: torch.Tensor, dim: int, group, phase: str, where: str,
          agreed: bool = False) -> torch.Tensor:
    fn, payload = _MOVES[name]
    _, world = group_rank_world(group)
    if world == 1 and name != "identity":
        return x  # a TP size of 1: every move is the identity
    if payload == 0:
        return fn(x, dim, group)
    nbytes = x.numel() * x.element_size() * (world if payload is None else payload)
    with accounting.collective(where, name, phase, nbytes):
        if agreed:
            return fn(x, dim, group, sizes_agreed=True)
        if name in _CHECKED:   # the scope names the call site alike on every rank
            return fn(x, dim, group, agree_at=(where, phase, dim))
        return fn(x, dim, group)


class _Region(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, fwd: str, bwd: str, dim: int, group):
        ctx.bwd, ctx.dim, ctx.group, ctx.agreed = bwd, dim, group, fwd in _CHECKED
        ctx.where = accounting.current_scope()  # the backward's collective is filed here too
        return _move(fwd, x, dim, group, "forward", ctx.where)

    @staticmethod
    def backward(ctx, grad):
        return (_move(ctx.bwd, grad, ctx.dim, ctx.group, "backward", ctx.where,
                      ctx.agreed and ctx.bwd in _CHECKED), None, None, None, None)


# ------------------------------------------------------------------ Megatron's names
def copy_to_tensor_model_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """f: identity forward, all-reduce (sum) of the gradient backward. Input of a column layer."""
    return _Region.apply(x, "identity", "all_reduce", -1, group)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """g: all-reduce (sum) forward, identity backward. Output of a row layer."""
    return _Region.apply(x, "all_reduce", "identity", -1, group)


def scatter_to_tensor_model_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Keep this rank's slice of the last dimension; backward all-gathers the gradient."""
    return _Region.apply(x, "split", "all_gather", -1, group)


def gather_from_tensor_model_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """All-gather along the last dimension (rank order); backward keeps this rank's slice."""
    return _Region.apply(x, "all_gather", "split", -1, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group=None, seq_dim: int = 1):
    """Keep this rank's slice of the sequence; backward all-gathers (sequence parallelism)."""
    return _Region.apply(x, "split", "all_gather", seq_dim, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, group=None, seq_dim: int = 1):
    """All-gather the sequence shards (replaces f); backward reduce-scatters the gradient."""
    return _Region.apply(x, "all_gather", "reduce_scatter", seq_dim, group)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group=None, seq_dim: int = 1):
    """Sum the partial outputs and keep my sequence shard (replaces g); backward all-gathers."""
    return _Region.apply(x, "reduce_scatter", "all_gather", seq_dim, group)


# ------------------------------------------------------------------ plain differentiable collectives
def all_reduce(x: torch.Tensor, group=None) -> torch.Tensor:
    """Sum over ranks; backward all-reduces the gradient too (not f or g)."""
    return _Region.apply(x, "all_reduce", "all_reduce", -1, group)


def all_gather(x: torch.Tensor, dim: int = -1, group=None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (rank order); backward reduce-scatters (sum)."""
    return _Region.apply(x, "all_gather", "reduce_scatter", dim, group)


def reduce_scatter(x: torch.Tensor, dim: int = -1, group=None) -> torch.Tensor:
    """Sum over ranks, keep slice ``rank`` of ``dim``; backward all-gathers along ``dim``."""
    return _Region.apply(x, "reduce_scatter", "all_gather", dim, group)
