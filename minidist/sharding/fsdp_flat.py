"""The unit machinery of :func:`~.fsdp.fully_shard`, with the flat layout (FSDP1's ``FlatParameter``).

:class:`FlatParamUnit` is a unit whose trainable parameters are packed into one flat buffer padded
to W·S elements (:class:`~.flat.FlatBuffer`), rank r keeping its [S] slice as the parameter
``flat_shard`` (``fully_shard(..., per_parameter=False)``: the first design, kept to teach why it
was replaced). Its hooks — gather before forward and before backward, prefetch, free, the
reduce-scatter when the gradient is complete, no_sync — are the machinery both layouts share: the
per-parameter :class:`~.fsdp_param.ParamShardUnit` subclasses it and replaces only the layout.
:mod:`.fsdp` has the whole picture (the four steps per training step) and :func:`~.fsdp.fully_shard`.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from ..communicator import CommThread, Communicator
from .flat import FlatBuffer
from .hsdp import release, thread_copy
from .mixed_precision import MixedPrecisionPolicy, cast_floating

__all__ = ["FlatParamUnit"]


class _Context:
    """What the units under one root share: the comm thread, the order, pending reduce-scatters."""

    def __init__(self, comm: Communicator, rep: Communicator | None = None):
        self.comm = comm                 # the root unit's: its group, implementation, algorithm
        self.rep = rep                   # HSDP: the root's replicate group (main thread), or None
        self.rep_thread: Communicator | None = None   # ... its copy for the comm thread
        self._worker: CommThread | None = None
        self.order: list = []            # units in forward order (recorded in step 1)
        self.recording = True
        self.pending: list = []          # (unit, handle, reduced shard) of this backward
        self.in_backward = False
        self.prefetched = 0              # all-gathers that were started early on the comm thread

    @property
    def worker(self) -> CommThread:
        """Created at first use (the first forward, on every rank): only the root's is ever made."""
        if self._worker is None:
            self._worker = CommThread(self.comm, name="fsdp-comm")
            if self.rep is not None:
                self.rep_thread = thread_copy(self.rep)
        return self._worker

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self.rep_thread is not None:
            release(self.rep_thread)
            self.rep_thread = None


class FlatParamUnit:
    """The state :func:`~.fsdp.fully_shard` attaches to a module as ``module._fsdp``."""

    requires_all_reduce = True   # HSDP's switch (per-parameter units); the flat layout has no HSDP

    def __init__(self, module: nn.Module, comm: Communicator, mp: MixedPrecisionPolicy,
                 reshard_after_forward: bool, prefetch: bool):
        self.module, self.comm, self.mp = module, comm, mp
        self.reshard_after_forward, self.prefetch = reshard_after_forward, prefetch
        self.rank, self.world_size = comm.rank, comm.world_size
        self.slots, params, self.names = _slots(module, lambda p: p.requires_grad)
        self.frozen = [(f"{mod_name}{name}", p)  # (name, parameter) left unsharded: frozen at wrap
                       for mod_name, sub in _own_modules(module)
                       for name, p in sub._parameters.items() if p is not None and not p.requires_grad]
        self.layout = FlatBuffer(params, self.world_size, self.rank) if params else None
        _claim(params, self.names, type(module).__name__)
        self.ctx, self.sync, self.state, self.handle = None, True, "sharded", None
        self.full, self.unsharded_grad = None, None
        if self.layout is None:
            return
        with torch.no_grad():
            flat = self.layout.pack(params)
            comm.broadcast(flat, 0)                      # every rank starts from rank 0's values
            shard = self.layout.shard(flat).clone()
        for sub, name, _, _ in self.slots:
            del sub._parameters[name]
        self.flat_shard = nn.Parameter(shard)             # [S] fp32 master, what optimizers see
        module.register_parameter("flat_shard", self.flat_shard)
        self.compute_dtype = mp.param_dtype or shard.dtype
        self.full = torch.zeros(self.layout.padded, dtype=self.compute_dtype,
                                device=shard.device).requires_grad_()
        self.full.register_post_accumulate_grad_hook(lambda t: self._on_grad())
        self._set_views()
        self._free()
        for p in params:                                  # the full copies are not kept
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    # ------------------------------------------------------------------ gather / free
    def _alloc(self) -> None:
        nbytes = self.layout.padded * self.full.element_size()
        if self.full.untyped_storage().size() != nbytes:
            self.full.untyped_storage().resize_(nbytes)

    def _free(self) -> None:
        self.full.untyped_storage().resize_(0)
        self.state = "sharded"

    def _gather_into(self, comm: Communicator) -> None:
        comm.all_gather(self.full.data, self.flat_shard.detach().to(self.compute_dtype))

    def gather(self, comm_thread: bool = False) -> None:
        """All-gather now (main thread), or start it on the comm thread (``comm_thread=True``)."""
        if self.layout is None or self.state != "sharded" or self.handle is not None:
            return
        self._alloc()
        if comm_thread and self.ctx is not None:
            self.handle = self.ctx.worker.submit(f"all-gather of unit {self.unit_name()} "
                                                 f"(rank {self.rank})", _gather, self)
        else:
            self._gather_into(self.comm)
            self.state = "gathered"

    def wait_gathered(self) -> None:
        if self.handle is not None:
            self.handle.wait()
            self.handle, self.state = None, "gathered"
            self.ctx.prefetched += 1
        self.gather()

    def _set_views(self) -> None:
        views = self.layout.views(self.full)
        for sub, name, i, _ in self.slots:
            setattr(sub, name, views[i])

    def unit_name(self) -> str:
        return type(self.module).__name__

    # ------------------------------------------------------------------ hooks
    def pre_forward(self, module, args, kwargs):
        ctx = self.ctx
        thawed = [n for n, p in self.frozen if p.requires_grad]
        if thawed:   # the flat design packs what was trainable at wrap; it cannot take in more
            raise RuntimeError(f"fully_shard(per_parameter=False) (rank {self.rank}): unit "
                               f"{self.unit_name()} left {', '.join(thawed)} unsharded because "
                               "it was frozen at wrap time, and it requires a gradient now; its "
                               "gradient would never be averaged. Use the per-parameter "
                               "fully_shard (the default), which shards frozen parameters too")
        if ctx.recording and self not in ctx.order:
            ctx.order.append(self)
        if self.layout is not None:
            self.wait_gathered()
            self._set_views()                 # fresh views, recorded by autograd if grad is on
        if self.prefetch and not ctx.recording and not ctx.in_backward:
            i = ctx.order.index(self)
            if i + 1 < len(ctx.order):
                ctx.order[i + 1].gather(comm_thread=True)
        if self.mp.param_dtype is not None:
            args, kwargs = cast_floating((args, kwargs), self.mp.param_dtype)
        return args, kwargs

    def post_forward(self, module, args, output):
        if self.layout is None:
            return output
        if torch.is_grad_enabled():
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(self._pre_backward_hook)
        if self.reshard_after_forward and not self.ctx.in_backward:  # not while recomputing
            self._free()
        return output

    def _pre_backward_hook(self, grad):
        self.pre_backward()

    def pre_backward(self) -> None:
        ctx = self.ctx
        if not ctx.in_backward:
            ctx.in_backward, ctx.recording = True, False
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        self.wait_gathered()
        if self.prefetch and self in ctx.order:   # next in backward: the previous unit in forward
            i = ctx.order.index(self)
            ctx.order[i - 1 if i > 0 else -1].gather(comm_thread=True)

    def _on_grad(self) -> None:
        grad = self.full.grad
        self.full.grad = None
        rdtype = self.mp.reduce_dtype or self.master_dtype()
        grad = grad.to(rdtype)
        if self.unsharded_grad is not None:
            grad = grad + self.unsharded_grad
            self.unsharded_grad = None
        if not self.sync:                               # no_sync: keep the full sum locally
            self.unsharded_grad = grad
        else:
            out = torch.empty(self.layout.shard_numel, dtype=rdtype, device=grad.device)
            h = self.ctx.worker.submit(f"reduce-scatter of unit {self.unit_name()} (rank "
                                       f"{self.rank})", self._reduce, out,
                                       self._reduce_input(grad))
            self.ctx.pending.append((self, h, out))
        self._free()

    def master_dtype(self) -> torch.dtype:
        """dtype of the sharded masters (what gradients are reduced in without a policy)."""
        return self.flat_shard.dtype

    def _reduce_input(self, grad: torch.Tensor) -> torch.Tensor:
        """The [W·S] buffer to reduce-scatter, from the gathered-layout gradient."""
        return grad

    def _reduce(self, comm, out: torch.Tensor, grad: torch.Tensor) -> None:
        """On the communication thread: ``out`` ← this rank's slice of the average of ``grad``."""
        _reduce_scatter(comm, out, grad)

    def _accept_grad(self, out: torch.Tensor) -> None:
        """Add this rank's averaged slice ``out`` [S] to the shard's gradient."""
        g = out.to(self.flat_shard.dtype)
        if self.flat_shard.grad is None:
            self.flat_shard.grad = g
        else:
            self.flat_shard.grad.add_(g)

    def _finish_backward(self) -> None:
        ctx = self.ctx
        ctx.in_backward = False
        pending, ctx.pending = ctx.pending, []
        with torch.no_grad():
            for unit, h, out in pending:
                h.wait()
                unit._accept_grad(out)
        for unit in ctx.order:                # units whose gradient never came: free them too
            if unit.layout is not None and unit.handle is not None:
                unit.wait_gathered()
            if unit.layout is not None and unit.state != "sharded":
                unit._free()


_CLAIMED: dict = {}   # id(parameter) -> (weak reference, unit name): which unit packed it


def _claim(params, names, unit: str) -> None:
    """Raise ``ValueError`` if a parameter was already packed by another unit (tied weights used in
    two units); else record that ``unit`` owns them."""
    for p, name in zip(params, names):
        ref, owner = _CLAIMED.get(id(p), (None, None))
        if ref is not None and ref() is p:
            raise ValueError(f"fully_shard: parameter {name} of {unit} is tied to one already "
                             f"packed by unit {owner}; a tied parameter must belong to one unit: "
                             "shard a module that contains every use of it (e.g. the root)")
    for p in params:
        _CLAIMED[id(p)] = (weakref.ref(p), unit)


def _gather(comm, unit: FlatParamUnit) -> None:
    unit._gather_into(comm)


def _reduce_scatter(comm, out, grad) -> None:
    comm.reduce_scatter(out, grad, "avg")


def _slots(module: nn.Module, shard) -> tuple[list, list, list]:
    """(slots, params, names) of a unit: one slot (submodule, attribute name, index into params,
    qualified name) per parameter attribute of ``module`` outside other units that ``shard(p)``
    keeps; a tied parameter is one entry of ``params``, named by its first slot."""
    slots, params, seen = [], [], {}
    for mod_name, sub in _own_modules(module):
        for name, p in list(sub._parameters.items()):
            if p is None or not shard(p):
                continue
            if id(p) not in seen:
                seen[id(p)] = len(params)
                params.append(p)
            slots.append((sub, name, seen[id(p)], f"{mod_name}{name}"))
    names = [next(fq for _, _, i, fq in slots if i == k) for k in range(len(params))]
    return slots, params, names


def _own_modules(module: nn.Module, prefix: str = ""):
    """(qualified name prefix, submodule) of ``module`` and its descendants outside other units
    (sharded ones, ``_fsdp``, and replicated ones, ``_replicate``: :mod:`.replicate`)."""
    yield prefix, module
    for name, child in module.named_children():
        if getattr(child, "_fsdp", None) is None and getattr(child, "_replicate", None) is None:
            yield from _own_modules(child, f"{prefix}{name}.")


def _tensors(obj):
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)
