"""Which ranks gave each parameter a gradient: the agreement behind unused parameters.

A rank whose backward skipped a parameter must not decide alone what to do about it: if it
raises alone, the other ranks wait in the gradient collective it skips (a hang, or gloo's
"Connection closed by peer"); if it skips the parameter's share alone, the ranks issue different
collectives (gloo aborts on the size mismatch; NCCL hangs). :func:`gradient_users` all-reduces a
[world_size, P] usage mask, so every rank learns the same answer and acts on it together: zero
contributions for parameters some rank used (DDP's ``find_unused_parameters``, ZeRO), the same
error on every rank otherwise. torch's DDP all-reduces its ``local_used_map`` the same way
(torch/csrc/distributed/c10d/reducer.cpp) — but only with ``find_unused_parameters``; without it, a
parameter unused on one rank hangs the others (pytorch/pytorch#158719 is the same for FSDP2).

It is a control message: it goes over ``torch.distributed`` itself, so the traffic that
:func:`minidist.comm.p2p.count_traffic` counts for the gradients stays theirs alone.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["gradient_users"]


def gradient_users(locally_used: list[bool], rank: int, world_size: int, group=None,
                   device: torch.device | None = None) -> list[list[int]]:
    """Per parameter, the ranks (of ``group``, ascending) whose backward gave it a gradient.

    Collective over ``group``: every rank calls it with ``len(locally_used)`` equal (P flags, the
    same parameters in the same order). One all-reduce of W·P floats on ``device``.
    """
    mask = torch.zeros(world_size, len(locally_used), device=device)
    mask[rank] = torch.tensor([1.0 if u else 0.0 for u in locally_used], device=device)
    if world_size > 1:
        dist.all_reduce(mask, group=group)
    return [[r for r in range(world_size) if mask[r, k] > 0] for k in range(len(locally_used))]
