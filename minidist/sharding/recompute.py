"""Activation recomputation from scratch: keep the inputs, drop the rest (torch's non-reentrant design).

Saved tensors become tickets (``saved_tensors_hooks``); the first unpack in backward reruns ``fn``
with the first run's RNG states and hands the tensors over in order: no nested backward, gradient
hooks fire once. Memory n·A → n·(input) + A for one extra forward (Chen et al. 2016).
``fn`` must save the same tensors when rerun, else ``RuntimeError``.
Design notes: docs/design/sharding.md
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch import nn

__all__ = ["checkpoint", "Checkpointed"]

METERS: list = []  # active memory.ActivationMeter objects: told about the inputs kept here


class _Ticket:
    """What the graph holds in place of a saved tensor: its number in the forward's save order."""

    __slots__ = ("index", "__weakref__")

    def __init__(self, index: int):
        self.index = index


class _Frame:
    def __init__(self):
        self.tickets: list = []       # weak references, in save order
        self.recomputed: dict = {}    # graph task id -> WeakKeyDictionary {ticket: tensor}


def _rng_state(args):
    """Every generator the forward may draw from (CPU, inputs' CUDA devices, the TP tracker)."""
    from ..tensor_parallel.random import get_rng_tracker
    devices = sorted({a.device for a in args if torch.is_tensor(a) and a.device.type == "cuda"},
                     key=str)
    return (torch.get_rng_state(), {d: torch.cuda.get_rng_state(d) for d in devices},
            get_rng_tracker().state_dict())


def _set_rng_state(state) -> None:
    from ..tensor_parallel.random import get_rng_tracker
    cpu, devs, tracker = state
    torch.set_rng_state(cpu)
    for d, s in devs.items():
        torch.cuda.set_rng_state(s, d)
    get_rng_tracker().load_state_dict(tracker)


def checkpoint(fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, saving only ``args`` for backward and recomputing the rest there.

    Gradients equal those without recomputation (bit for bit on CPU), dropout included (not a
    dropout with its own ``tracker=``). ``RuntimeError`` if the rerun saves a different number of tensors."""
    rng = _rng_state(args)
    autocast = _autocast_state()
    frame = _Frame()
    for meter in METERS:
        for a in args:
            if torch.is_tensor(a):
                meter.add(a)

    def pack(t):
        ticket = _Ticket(len(frame.tickets))
        frame.tickets.append(weakref.ref(ticket))
        return ticket

    def unpack(ticket):
        task = torch._C._current_graph_task_id()   # this backward call
        got = frame.recomputed.get(task)
        if got is None:   # the first tensor this backward asks for: run fn again
            saved = _recompute(fn, args, kwargs, rng, autocast, len(frame.tickets))
            got = frame.recomputed[task] = weakref.WeakKeyDictionary(
                {k: saved[k.index] for k in (r() for r in frame.tickets) if k is not None})
            # what this backward did not ask for dies with it, not with the graph (B of a split
            # backward asks for a part; W recomputes again: pytorch#136766's memory growth)
            torch.autograd.Variable._execution_engine.queue_callback(
                lambda: frame.recomputed.pop(task, None))
        t = got.pop(ticket, None)
        if t is None:
            raise RuntimeError("checkpoint: a saved tensor was asked for twice in one backward")
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return fn(*args, **kwargs)


def _autocast_state() -> list[tuple[str, torch.dtype]]:
    """The forward's autocast regions ``[(device type, dtype)]``, re-entered for the recomputation."""
    kinds = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    return [(k, torch.get_autocast_dtype(k)) for k in kinds if torch.is_autocast_enabled(k)]


def _recompute(fn, args, kwargs, rng, autocast, expected: int) -> dict:
    saved = {}

    def pack(t):   # the recomputed graph is never walked: it keeps nothing (a saved output
        saved[len(saved)] = t.detach()   # holding its own grad_fn would keep both alive)
        return None

    def unpack(_):
        raise RuntimeError("checkpoint: the recomputation's own graph is not for backward")

    detached = [a.detach().requires_grad_(a.requires_grad) if torch.is_tensor(a) else a
                for a in args]
    now = _rng_state(args)
    _set_rng_state(rng)
    try:
        with contextlib.ExitStack() as regions:
            for device_type, dtype in autocast:
                regions.enter_context(torch.autocast(device_type, dtype=dtype))
            regions.enter_context(torch.enable_grad())
            regions.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, unpack))
            fn(*detached, **kwargs)
    finally:
        _set_rng_state(now)
    if len(saved) != expected:
        raise RuntimeError(f"checkpoint: the recomputation saved {len(saved)} tensors, the first "
                           f"run {expected}; the function must do the same operations both times")
    return saved


class Checkpointed(nn.Module):
    """``module`` whose forward runs through :func:`checkpoint` (unless ``enabled=False``).
    ``impl``: ``"minidist"``, ``"torch-reentrant"`` or ``"torch-non-reentrant"``, for comparisons."""

    def __init__(self, module: nn.Module, enabled: bool = True, impl: str = "minidist"):
        super().__init__()
        if impl not in ("minidist", "torch-reentrant", "torch-non-reentrant"):
            raise ValueError(f"Checkpointed: unknown impl {impl!r}")
        self.module, self.enabled, self.impl = module, enabled, impl

    def forward(self, *args, **kwargs):
        if not self.enabled or not torch.is_grad_enabled():
            return self.module(*args, **kwargs)
        if self.impl == "minidist":
            return checkpoint(self.module, *args, **kwargs)
        if kwargs and self.impl == "torch-reentrant":
            raise ValueError(f"Checkpointed(impl='torch-reentrant'): torch's reentrant checkpoint "
                             f"takes no keyword arguments (got {sorted(kwargs)}); pass them "
                             "positionally, or use impl='minidist' or 'torch-non-reentrant'")
        from torch.utils.checkpoint import checkpoint as torch_checkpoint
        return torch_checkpoint(self.module, *args, use_reentrant=self.impl == "torch-reentrant",
                                **kwargs)
