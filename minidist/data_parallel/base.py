"""What every minidist DDP shares: wrapping, the replica checks, no_sync, and unused parameters.

The three versions (:mod:`.naive`, :mod:`.flat`, :mod:`.bucketed`) differ only in *how* the
gradients are averaged. Everything else lives here:

* **construction** checks that every rank holds the same structure and broadcasts rank 0's
  parameters and buffers (:mod:`.replicas`: ranks that start apart would train apart);
* **forward** broadcasts buffers from rank 0 (``broadcast_buffers=True``, like torch's DDP) and
  **takes the sync decision**: a backward synchronises iff its forward ran outside
  :meth:`no_sync`. Entering or leaving ``no_sync()`` between a forward and its backward is rejected
  with :class:`SyncDecisionError` (the sync must happen on the last micro-batch, or gradients are
  averaged before accumulation ends);
* **unused parameters** (a rank waiting for a gradient that never comes would hang): a parameter that got no gradient is an
  :class:`UnusedParametersError` naming it — or, with ``find_unused_parameters=True``, it counts as
  a zero gradient, so a parameter used on some ranks only gets (g + 0 + ...)/W, and one used on no
  rank keeps ``grad=None`` (as in torch's DDP; a usage mask is all-reduced to know).

Loss convention (unequal per-rank batches): each rank averages its loss over its own micro-batch and DDP
averages the gradients over ranks, which equals the gradient of the global-batch mean loss when
every rank has the same batch size. With unequal batches it weights every *rank* equally; to weight
every *sample* equally, scale each rank's loss by W·n_rank/n_global before backward.
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
    """Base of the minidist DDP wrappers. See the module docstring for the rules it enforces.

    Args:
        module: the model, identical in structure on every rank.
        collectives: ``"hand-built"`` (:mod:`minidist.collectives`) or ``"torch"``
            (``torch.distributed``).
        group: process group of the data-parallel ranks (default: the world).
        find_unused_parameters: treat a missing gradient as zero instead of raising.
        broadcast_buffers: copy rank 0's buffers (e.g. BatchNorm running stats) at every forward.
        reduce_dtype: dtype gradients are averaged in (fp32: bf16 gradients are upcast first).
        algorithm: the hand-built algorithm, ``"auto"`` (default: per bucket, the lowest predicted
            alpha-beta time, :mod:`minidist.comm.tuner`) or a fixed name such as ``"ring"``.
    """

    def __init__(self, module: nn.Module, collectives: str = "hand-built", group=None,
                 find_unused_parameters: bool = False, broadcast_buffers: bool = True,
                 reduce_dtype: torch.dtype = torch.float32, algorithm: str = "auto"):
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
        broadcast_from_rank0(self.communicator, module)
        self.param_names = {p: n for n, p in module.named_parameters() if p.requires_grad}
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
        """Skip gradient synchronisation for the forward+backward passes run inside the block.

        Gradients accumulate locally in ``p.grad``; the first backward whose forward ran outside
        the block averages the accumulated sums. Gradient accumulation over k micro-batches::

            for i, (x, y) in enumerate(micro_batches):
                ctx = model.no_sync() if i < k - 1 else contextlib.nullcontext()
                with ctx:
                    (loss_fn(model(x), y) / k).backward()
            optimizer.step()  # every rank: mean over ranks of the sum over micro-batches
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
        """Which parameters got a gradient on at least one rank; raises on every rank, without
        ``find_unused_parameters``, when one got none on some rank."""
        users = self._users(locally_used)
        self._refuse_short(self.params, users)
        return [bool(u) for u in users]

    def _refuse_short(self, params: list, users: list[list[int]]) -> None:
        """Without ``find_unused_parameters``: raise (on every rank, ``users`` being the same
        everywhere) for parameters some rank gave no gradient. One frozen since wrapping
        (``requires_grad=False`` now) with no gradient on any rank is left alone: ``grad`` stays
        None and the optimizer skips it, as for a frozen parameter in one process."""
        if self.find_unused_parameters:
            return
        short = [(p, u) for p, u in zip(params, users)
                 if len(u) < self.world_size and (u or p.requires_grad)]
        if short:
            raise self._unused_error([p for p, _ in short], [u for _, u in short])

    def _begin_sync(self) -> tuple[list[torch.Tensor], list[bool]] | None:
        """What the explicit versions (naive, flat) do first: None if this backward does not
        synchronise (its forward ran inside ``no_sync()``); else, per parameter, the gradient to
        average (zeros where this rank has none and ``find_unused_parameters``) and whether any
        rank used it. Raises :class:`UnusedParametersError` on every rank for a gradient missing
        on some rank otherwise."""
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
