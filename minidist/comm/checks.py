"""Argument checks for the public entry points of ``minidist.comm``, kept out of the algorithms.

A ring is called with ``rank`` and ``world``: this process's place in ``group`` and the group's
size. A global rank passed for a sub-group's place would reach p2p as a peer that is this rank
itself, or outside the group (a hang, or advice meant for a whole world). :func:`placed` puts
:func:`check_place` in front of a ring: one cached look-up per call, before any message."""

from __future__ import annotations

import functools
import inspect

import torch.distributed as dist

from . import p2p


def check_place(where: str, rank, world, group) -> None:
    """Raise ``ValueError`` (on this rank) unless ``rank`` is this process's place in ``group``
    and ``world`` its size; ``where`` (e.g. ``"ring.all_reduce"``) starts the message."""
    me, size = p2p.group_rank_world(group)
    if rank == me and world == size:
        return
    where = f"{where} (rank {dist.get_rank() if dist.is_initialized() else 0})"
    if me < 0:
        raise ValueError(f"{where}: this process is not a member of the group it passed; only the "
                         "group's members may call a ring on it")
    if rank != me:
        places = (f"the ranks of a group are numbered 0 … {size - 1} in the order of their global "
                  "ranks" if size > 1 else "a group of one rank has only place 0")
        hint = (f" (rank={rank} is this process's global rank; {places})"
                if group is not None and dist.is_initialized() and rank == dist.get_rank() else "")
        raise ValueError(f"{where}: rank={rank!r} but this process is rank {me} of its group "
                         f"(size {size}): pass the place in the group{hint}")
    raise ValueError(f"{where}: world={world!r} but its group has {size} rank"
                     f"{'s' if size != 1 else ''}: pass the group's size")


def placed(fn, where: str):
    """``fn`` with :func:`check_place` in front; ``help()`` and ``inspect.getsource`` show ``fn``."""
    sig = inspect.signature(fn)
    i = list(sig.parameters).index("rank")

    @functools.wraps(fn)
    def checked(*args, **kwargs):
        if len(args) > i + 1 and not kwargs:
            rank, world = args[i], args[i + 1]
            group = args[i + 2] if len(args) > i + 2 else None
        else:
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            rank, world, group = (bound.arguments[k] for k in ("rank", "world", "group"))
        check_place(where, rank, world, group)
        return fn(*args, **kwargs)
    return checked
