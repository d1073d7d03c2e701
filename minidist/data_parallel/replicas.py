"""Replicas: the same model on every rank. :func:`check_same_structure`, :func:`broadcast_module`,
and after N steps :func:`replicas_max_difference` / :func:`assert_replicas_identical`.
Design notes: docs/design/data_parallel.md
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .. import collectives as C
from ..communicator import Communicator

__all__ = ["ReplicaMismatchError", "check_same_structure", "broadcast_module", "unwrap",
           "replicas_max_difference", "assert_replicas_identical"]


class ReplicaMismatchError(RuntimeError):
    """Ranks hold models with different parameter names, shapes, dtypes or trainability."""


def unwrap(model: nn.Module) -> nn.Module:
    """The bare model inside a DDP wrapper (minidist's or torch's), or the model itself."""
    while hasattr(model, "module") and isinstance(model.module, nn.Module):
        model = model.module
    return model


def _signature(module: nn.Module) -> list[tuple]:
    sig = [("param", n, tuple(p.shape), str(p.dtype), p.requires_grad)
           for n, p in module.named_parameters()]
    sig += [("buffer", n, tuple(b.shape), str(b.dtype), False) for n, b in module.named_buffers()]
    return sig


def check_same_structure(module: nn.Module, group=None, what: str = "DDP") -> None:
    """Raise :class:`ReplicaMismatchError` on every rank unless all ranks hold the same structure."""
    world = dist.get_world_size(group)
    if world == 1:
        return
    mine = _signature(module)
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine, group=group)
    if all(e == everyone[0] for e in everyone):
        return
    lines = []
    for r, sig in enumerate(everyone):
        n_params = sum(1 for s in sig if s[0] == "param")
        numel = sum(int(torch.Size(s[2]).numel()) for s in sig if s[0] == "param")
        lines.append(f"  rank {r}: {n_params} parameters, {numel} elements")
    ref = everyone[0]
    for r, sig in enumerate(everyone[1:], start=1):
        for i in range(max(len(ref), len(sig))):
            a = ref[i] if i < len(ref) else None
            b = sig[i] if i < len(sig) else None
            if a != b:
                lines.append(f"  first difference, rank 0 vs rank {r}: {_fmt(a)}  vs  {_fmt(b)}")
                break
    raise ReplicaMismatchError(
        f"{what} (rank {dist.get_rank(group)}): ranks hold different models:\n" + "\n".join(lines)
        + "\nBuild the model the same way on every rank (no rank-dependent shapes or frozen "
        "layers); values may differ, they are broadcast from rank 0.")


def _fmt(entry) -> str:
    if entry is None:
        return "(nothing)"
    kind, name, shape, dtype, rg = entry
    return f"{kind} {name} {list(shape)} {dtype}" + ("" if rg or kind == "buffer" else " frozen")


@torch.no_grad()
def broadcast_module(module: nn.Module, collectives: str = "hand-built", group=None,
                     buffers_only: bool = False, algorithm: str = "auto") -> None:
    """Copy rank 0's parameters and buffers to every rank, in place: one flat ``uint8`` broadcast per
    device (as torch's ``_broadcast_coalesced``)."""
    broadcast_from_rank0(Communicator(collectives, group, algorithm=algorithm), module, buffers_only)


def broadcast_from_rank0(comm: Communicator, module: nn.Module, buffers_only: bool = False,
                         skip=frozenset()) -> None:
    """:func:`broadcast_module` on ``comm`` (what a wrapper that holds one passes down), but the
    parameters in ``skip``."""
    if comm.world_size == 1:
        return
    tensors = [] if buffers_only else [p.data for p in module.parameters() if p not in skip]
    tensors += [b for b in module.buffers()]
    by_device: dict = {}
    for t in tensors:
        if t.numel():
            by_device.setdefault(t.device, []).append(t)
    for same in by_device.values():
        as_bytes = [t.detach().reshape(-1).view(torch.uint8) for t in same]
        flat = torch.cat(as_bytes)
        comm.broadcast(flat, 0)
        for t, piece in zip(same, flat.split([b.numel() for b in as_bytes])):
            if t.is_contiguous():   # its bytes, in place (a piece may be misaligned for t's dtype)
                t.reshape(-1).view(torch.uint8).copy_(piece)
            else:
                t.copy_(piece.clone().view(t.dtype).view_as(t))


@torch.no_grad()
def replicas_max_difference(module: nn.Module, group=None) -> float:
    """Largest |p_rank - p_rank0| over all parameters and buffers and ranks (0.0: identical)."""
    module = unwrap(module)
    tensors = list(module.parameters()) + list(module.buffers())
    worst = torch.zeros(1, dtype=torch.float64, device=tensors[0].device if tensors else None)
    for t in tensors:
        ref = t.detach().clone()
        C.broadcast(ref, src=0, group=group)
        if t.numel():
            worst = torch.maximum(worst, (t.detach().double() - ref.double()).abs().max().view(1))
    C.all_reduce(worst, op="max", group=group)
    return float(worst)


def assert_replicas_identical(module: nn.Module, group=None, atol: float = 0.0) -> None:
    """Raise AssertionError (on every rank) if any rank's parameters differ from rank 0's."""
    diff = replicas_max_difference(module, group)
    if diff > atol:
        raise AssertionError(f"rank {dist.get_rank(group)}: replicas differ from rank 0 by up to "
                             f"{diff:.3g} (allowed {atol}): gradients were not synchronised")
