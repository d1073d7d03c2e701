"""What every minidist DDP shares: wrapping (structure checked, rank 0 broadcast), the sync decision
taken at forward (:meth:`no_sync`; :class:`SyncDecisionError`), and unused parameters
(:class:`UnusedParametersError`, or zeros with ``find_unused_parameters=True``, as torch's DDP).
Design notes: docs/design/data_parallel.md
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from ..communicator import Communicator
from .replicas import broadcast_from_rank0, check_same_structure
from .usage import gradient_users

__all__ = ["DataParallelBase", "UnusedParametersError", "SyncDecisionError"]


class UnusedParametersError(RuntimeError):
    """Parameters that require a gradient received none in a synchronised backward."""


class SyncDecisionError(RuntimeError):
    """``no_sync()`` was entered or left between a forward and its backward (or a misuse like it)."""


class DataParallelBase(nn.Module):
    """Base of the DDP wrappers: ``module`` (same structure on every rank), ``collectives``, ``group``
    (default the world), ``find_unused_parameters``, ``broadcast_buffers``, ``reduce_dtype`` (of the
    average), ``algorithm`` (``"auto"``: :mod:`minidist.comm.tuner`), ``ignored_params``:
    parameters the wrapper neither broadcasts nor averages, because another group replicates
    them (experts sharded over EP; torch's DDP: ``_set_params_and_buffers_to_ignore_for_model``)."""

    def __init__(self, module: nn.Module, collectives: str = "hand-built", group=None,
                 find_unused_parameters: bool = False, broadcast_buffers: bool = True,
                 reduce_dtype: torch.dtype = torch.float32, algorithm: str = "auto",
                 ignored_params=()):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError(f"{type(self).__name__}: the process group is not initialised; run "
                               "inside minidist.run(...) or call minidist.init() first")
        self.module = module
        self.communicator = Communicator(collectives, group, where="data parallel",
                                         algorithm=algorithm)
        self.rank, self.world_size = self.communicator.rank, self.communicator.world_size
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_buffers = broadcast_buffers
        self.reduce_dtype = reduce_dtype
        check_same_structure(module, group, what=f"{type(self).__name__} construction")
        ignored = set(ignored_params)
        broadcast_from_rank0(self.communicator, module, skip=ignored)
        self.param_names = {p: n for n, p in module.named_parameters()
                            if p.requires_grad and p not in ignored}
        self.params = list(self.param_names)  # registration order
        self._sync_enabled = True         # False inside no_sync()
        self._sync_this_backward = None   # the decision taken by the last forward

    # ------------------------------------------------------------------ forward & the sync decision
    def forward(self, *args, **kwargs):
        if self.broadcast_buffers and self.world_size > 1 and any(True for _ in self.module.buffers()):
            broadcast_from_rank0(self.communicator, self.module, buffers_only=True)
        self._sync_this_backward = self._sync_enabled
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Inside the block gradients accumulate locally; the next synced backward averages the sums::

            with model.no_sync() if i < k - 1 else contextlib.nullcontext():
                (loss_fn(model(x), y) / k).backward()
        """
        previous = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def _check_decision(self, where: str) -> bool:
        """The decision taken at forward; raises if there was no forward or no_sync changed since."""
        if self._sync_this_backward is None:
            raise SyncDecisionError(f"{type(self).__name__} (rank {self.rank}): {where} without a "
                                    "forward through the wrapper (call model(x), not model.module(x))")
        if self._sync_this_backward != self._sync_enabled:
            state = "inside" if not self._sync_this_backward else "outside"
            raise SyncDecisionError(
                f"{type(self).__name__} (rank {self.rank}): the forward ran {state} no_sync() but "
                f"{where} runs {'outside' if state == 'inside' else 'inside'} it. The decision to "
                "synchronise is taken in forward; run each micro-batch's forward and backward in "
                "the same no_sync() state.")
        return self._sync_this_backward

    # ------------------------------------------------------------------ unused parameters
    def _unused_error(self, params, users: list[list[int]] | None = None) -> UnusedParametersError:
        """The error every rank raises; ``users[k]``: the ranks that gave params[k] a gradient."""
        names = [self.param_names[p] for p in params]
        if users is not None:
            names = [f"{n} (gradient on rank(s) {u} of {self.world_size})" if u else n
                     for n, u in zip(names, users)]
        return UnusedParametersError(
            f"{type(self).__name__} (rank {self.rank}): {len(names)} parameter(s) received no "
            f"gradient in this backward on some rank: {', '.join(names)}. Every rank must produce "
            "a gradient for every parameter that requires one. Use them in the loss, freeze them "
            "(requires_grad=False before wrapping), or pass find_unused_parameters=True.")

    def _users(self, locally_used: list[bool]) -> list[list[int]]:
        """Per parameter, the ranks that gave it a gradient (collective: :mod:`.usage`)."""
        device = self.params[0].device if self.params else None
        return gradient_users(locally_used, self.rank, self.world_size,
                              self.communicator.group, device)

    def _global_used(self, locally_used: list[bool]) -> list[bool]:
        """Which parameters got a gradient on some rank (the same answer on every rank)."""
        users = self._users(locally_used)
        self._refuse_short(self.params, users)
        return [bool(u) for u in users]

    def _refuse_short(self, params: list, users: list[list[int]]) -> None:
        """Raise on every rank for a parameter some rank gave no gradient (frozen-and-unused is fine)."""
        if self.find_unused_parameters:
            return
        short = [(p, u) for p, u in zip(params, users)
                 if len(u) < self.world_size and (u or p.requires_grad)]
        if short:
            raise self._unused_error([p for p, _ in short], [u for _, u in short])

    def _begin_sync(self) -> tuple[list[torch.Tensor], list[bool]] | None:
        """None inside ``no_sync()``; else per parameter (gradient to average, used anywhere). May raise."""
        if not self._check_decision("sync_gradients()"):
            return None
        used = [p.grad is not None for p in self.params]
        # every rank joins the usage all-reduce, also one that used every parameter: ranks must
        # issue the same collectives (gloo aborts otherwise), and all raise together if one lacks
        anywhere = self._global_used(used)
        grads = [p.grad if u else torch.zeros_like(p) for p, u in zip(self.params, used)]
        return grads, anywhere

    def sync_gradients(self) -> None:
        """Average the gradients over ranks (after backward, before ``optimizer.step()``)."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"collectives={self.communicator.collectives!r}, world_size={self.world_size}"
