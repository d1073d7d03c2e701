"""Reduction operators, input checks and the cross-rank debug check shared by all algorithms.

``sum``, ``max``, ``min`` for floating and integer dtypes (``max``/``min`` also bool); ``avg`` is
``sum`` then a division by the world size, floating dtypes only (TypeError otherwise); torch's
``dist.ReduceOp`` values are accepted as well as the strings."""

from __future__ import annotations

import os
import threading

import torch
import torch.distributed as dist

__all__ = ["check_group", "normalize_op", "combine_", "finish_avg_", "contiguous", "check_same_across_ranks",
           "CollectiveMismatchError", "debug_enabled", "check_sizes_agree", "sizes_mismatch",
           "check_exchange_sizes", "scratch_buffer"]

OPS = ("sum", "avg", "max", "min")


class CollectiveMismatchError(RuntimeError):
    """Ranks called a collective with different shapes, dtypes or arguments (debug mode)."""


def check_group(where: str, group) -> None:
    """``group`` must be None (the world) or a process group this rank belongs to."""
    if group is None:
        return
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{where}: group must be None (the world) or a process group from "
                        f"torch.distributed.new_group / ProcessGrid, got {type(group).__name__} "
                        f"{group!r}")
    if dist.get_rank(group) < 0:
        raise ValueError(f"{where}: this rank (global rank {dist.get_rank()}) is not a member of "
                         f"the group {dist.get_process_group_ranks(group)}")


def normalize_op(op, dtype: torch.dtype, where: str) -> str:
    """Return ``op`` as one of ``OPS``; raise ``ValueError``/``TypeError`` for unusable combinations."""
    name = op if isinstance(op, str) else getattr(op, "name", None) or str(op).rsplit(".", 1)[-1]
    name = name.lower()
    if name not in OPS:
        raise ValueError(f"{where}: op must be one of {OPS}, got {op!r}")
    if name == "avg" and not (dtype.is_floating_point or dtype.is_complex):
        raise TypeError(f"{where}: op='avg' on {dtype} would truncate; use op='sum' and divide, "
                        "or convert to a floating dtype first")
    if dtype.is_complex and name in ("max", "min"):
        raise TypeError(f"{where}: op={name!r} is undefined for complex tensors ({dtype}; "
                        "torch.distributed refuses it too); reduce .abs() or "
                        "torch.view_as_real(t) instead")
    if dtype == torch.bool and name == "sum":
        return "max"   # torch.distributed's SUM of bools is a logical or (any), i.e. max
    return name


_scratch = threading.local()


def scratch_buffer(numel: int, like: torch.Tensor) -> torch.Tensor:
    """A reusable per-thread receive buffer of ``numel`` elements like ``like`` (garbage contents)."""
    key = (like.dtype, like.device)
    bufs = getattr(_scratch, "bufs", {})
    buf = bufs.get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=like.dtype, device=like.device)
        _scratch.bufs = {**bufs, key: buf}
    return buf[:numel]


def combine_(acc: torch.Tensor, other: torch.Tensor, op: str) -> torch.Tensor:
    """``acc = acc (op) other`` in place. ``avg`` accumulates like ``sum``."""
    if op in ("sum", "avg"):
        return acc.add_(other)
    if op == "max":
        return torch.maximum(acc, other, out=acc)
    return torch.minimum(acc, other, out=acc)


def finish_avg_(tensor: torch.Tensor, op: str, world_size: int) -> torch.Tensor:
    """Divide by the world size when ``op`` is ``avg``: every algorithm averages the same way."""
    if op == "avg":
        tensor.div_(world_size)
    return tensor


class contiguous:
    """``with contiguous(t) as work:`` a contiguous tensor to work on, copied back into ``t`` if needed."""

    __slots__ = ("tensor", "work", "copy_back")

    def __init__(self, tensor: torch.Tensor, copy_back: bool = True):
        self.tensor, self.copy_back = tensor, copy_back
        self.work: torch.Tensor | None = None

    def __enter__(self) -> torch.Tensor:
        if self.tensor.is_contiguous():
            return self.tensor
        self.work = work = self.tensor.contiguous()
        return work

    def __exit__(self, exc_type, *exc) -> None:
        if self.work is not None and self.copy_back and exc_type is None:
            self.tensor.copy_(self.work)


def debug_enabled(debug: bool | None) -> bool:
    if debug is not None:
        return debug
    return os.environ.get("MINIDIST_DEBUG", "0").lower() in ("1", "true", "yes", "on")


def check_same_across_ranks(opname: str, group, **fields) -> None:
    """Exchange ``fields`` (shape, dtype, op, root, ...) and raise on every rank if they differ."""
    world = dist.get_world_size(group)
    mine = tuple(sorted((k, str(v)) for k, v in fields.items()))
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine, group=group)
    if any(e != everyone[0] for e in everyone):
        rows = "\n".join(f"  rank {r}: " + ", ".join(f"{k}={v}" for k, v in e)
                         for r, e in enumerate(everyone))
        raise CollectiveMismatchError(
            f"{opname}: ranks disagree before any data moved (rank {dist.get_rank(group)} "
            f"reporting):\n{rows}\nEvery rank must call the same collective with the same "
            "shape, dtype and arguments, in the same order.")


def check_sizes_agree(opname: str, group, sizes, device=None, root: int | None = None) -> None:
    """Raise on every rank if the ranks passed different per-rank ``sizes`` (one all-reduce of
    2·len(sizes) int64; always on: gloo silently accepts a too-large receive buffer)."""
    world = dist.get_world_size(group)
    if world == 1:
        return
    mine = [int(s) for s in sizes]
    both = torch.tensor(mine + [-s for s in mine], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    n = len(mine)
    if torch.equal(both[:n], -both[n:]):
        return
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine, group=group)
    raise sizes_mismatch(opname, dist.get_rank(group), everyone, root)


def sizes_mismatch(opname: str, rank: int, everyone: list, root: int | None = None,
                   when: str = "before any data moved") -> CollectiveMismatchError:
    """The error of :func:`check_sizes_agree` (and of :mod:`.agreed`): ``everyone[r]`` is rank r's
    size list; ``rank`` the group rank reporting; ``when`` what had happened by then."""
    rows = "\n".join(f"  rank {r}: {e}" for r, e in enumerate(everyone))
    diffs = []
    for j in range(len(everyone[0])):
        owner = root if root is not None else j  # piece j belongs to rank j
        for r, e in enumerate(everyone):
            if e[j] != everyone[owner][j]:
                diffs.append(f"rank {r} has {e[j]} elements for piece {j} where rank {owner} has "
                             f"{everyone[owner][j]}")
    return CollectiveMismatchError(
        f"{opname}: ranks disagree on the sizes (elements per piece) {when} "
        f"(rank {rank} reporting):\n{rows}\n" + "; ".join(diffs[:8]) +
        ".\nEvery rank must pass the same sizes to " + opname + (
            f": rank {root}'s size." if root is not None else ": piece r has rank r's size on every rank."))


def check_exchange_sizes(opname: str, group, send_sizes, recv_sizes, device=None) -> None:
    """all_to_all's always-on check that rank j expects from r exactly ``send_sizes[j]`` elements."""
    world = dist.get_world_size(group)
    if world == 1:
        return
    mine = torch.tensor([int(s) for s in send_sizes] + [int(s) for s in recv_sizes],
                        dtype=torch.int64, device=device)
    rows = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(rows, mine, group=group)
    table = torch.stack(rows).view(world, 2, world).cpu()  # [r, 0, j]: r sends j; [r, 1, j]: r expects from j
    sends, expects = table[:, 0, :], table[:, 1, :]
    bad = (sends != expects.T).nonzero().tolist()
    if bad:
        lines = [f"rank {r} sends {int(sends[r, j])} elements to rank {j}, which expects "
                 f"{int(expects[j, r])}" for r, j in bad[:8]]
        raise CollectiveMismatchError(
            f"{opname}: ranks disagree on the sizes before any data moved (rank "
            f"{dist.get_rank(group)} reporting):\n  " + "\n  ".join(lines) +
            "\noutput[j] on rank r must have the size of rank j's input[r].")
