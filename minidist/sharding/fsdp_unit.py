"""The unit of :func:`~.fsdp.fully_shard`: the machinery both layouts share, and nothing of either.
A :class:`ShardUnit` (``module._fsdp``) gathers, prefetches, frees, reduce-scatters, accumulates
and all-reduces (HSDP); where each parameter lives in the flat buffer ``full`` [W·S] is the
layout's (:class:`~.fsdp_param.ParamLayout`, :class:`~.fsdp_flat.FlatLayout`).
Design notes: docs/design/sharding.md
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..backward import weak_hook
from ..communicator import CommThread, Communicator, Handle
from .hsdp import release, thread_copy
from .mixed_precision import MixedPrecisionPolicy, cast_floating

__all__ = ["ShardUnit"]


class _Context:
    """What the units under one root share: the comm thread, the order, pending reduce-scatters."""

    def __init__(self, comm: Communicator, rep: Communicator | None = None):
        self.comm = comm                 # the root unit's: its group, implementation, algorithm
        self.rep = rep                   # HSDP: the root's replicate group (main thread), or None
        self.rep_thread: Communicator | None = None   # ... its copy for the comm thread
        self._worker: CommThread | None = None
        self._others: dict = {}          # id(group) -> (group, CommThread): units on other groups
        self.other_comms: list = []      # those units' communicators, set by fully_shard
        self.order: list = []            # units in forward order (recorded in step 1)
        self.recording = True
        self.pending: list = []          # (unit, handle, reduced shard) of this backward
        self.in_backward = False
        self.prefetched = 0              # all-gathers that were started early on the comm thread

    @property
    def worker(self) -> CommThread:
        """Created at first use (the first forward, on every rank): only the root's is ever made,
        with those of the units below on other groups (:meth:`worker_for`) at the same point."""
        if self._worker is None:
            self._worker = CommThread(self.comm, name="fsdp-comm")
            if self.rep is not None:
                self.rep_thread = thread_copy(self.rep)
            for comm in self.other_comms:   # every rank at once, in unit order: a group made
                self.worker_for(comm)       # by some ranks only would shift torch's group count
        return self._worker

    def worker_for(self, comm: Communicator) -> CommThread:
        """The comm thread for a unit on ``comm``: the root's, or, for a unit below on another
        group (experts over their expert-DP group), that group's."""
        root = self.worker   # makes every thread, in the same order on every rank
        if comm.group is self.comm.group:
            return root
        hit = self._others.get(id(comm.group))
        if hit is None:
            hit = self._others[id(comm.group)] = (comm.group, CommThread(comm, name="fsdp-comm"))
        return hit[1]

    def close(self) -> None:
        for _, worker in self._others.values():
            worker.close()
        self._others.clear()
        if self._worker is not None:
            self._worker.close()
        if self.rep_thread is not None:
            release(self.rep_thread)
            self.rep_thread = None


class ShardUnit:
    """A unit (``module._fsdp``) of ``layout`` over ``comm``'s group (HSDP: and ``rep``'s).

    Attributes: ``layout`` (None: nothing to shard), ``params`` (per parameter: the shards) or
    ``flat_shard`` ([S]), ``slots``/``names``, ``frozen`` (flat: left unsharded), ``full`` (gathered
    [W·S], freed between uses), ``state`` (``"sharded"``/``"gathered"``), ``sync``,
    ``requires_all_reduce``."""

    def __init__(self, module: nn.Module, comm: Communicator, mp: MixedPrecisionPolicy,
                 reshard_after_forward: bool, prefetch: bool, layout, rep=None):
        self.module, self.comm, self.mp, self.rep = module, comm, mp, rep
        self.reshard_after_forward, self.prefetch = reshard_after_forward, prefetch
        self.rank, self.world_size = comm.rank, comm.world_size
        self.ctx: Any = None                # the root's _Context, set by fully_shard
        self.sync, self.state = True, "sharded"
        self.handle: Handle | None = None   # a prefetch in flight on the comm thread
        self.requires_all_reduce = True     # HSDP: False keeps pieces uncrossed (see _reduce)
        self.divide_factor: float | None = None   # the reduce-scatter's divisor (None: W)
        self.full: Any = None               # the gathered [W·S] buffer (None: nothing to shard)
        self.unsharded_grad: torch.Tensor | None = None
        self.slots: list = []               # set by the layout's wrap
        self.names: list = []
        self.params: list = []
        self.flat_shard: nn.Parameter | None = None
        self.frozen: list = []              # (name, parameter) the layout left unsharded
        self._got_grad: set[int] = set()    # parameters that got a gradient here (this rank)
        self._partial: tuple | None = None  # HSDP: kept sum and flags until the next all-reduce
        self._gathered_from: tuple = ()     # the shards' versions ``full`` was gathered from
        self.layout = layout.wrap(self, module)
        if self.layout is None:
            return
        self.compute_dtype = mp.param_dtype or self.layout.dtype
        self.full = torch.zeros(self.layout.padded, dtype=self.compute_dtype,
                                device=self.layout.device).requires_grad_()
        self.full.register_post_accumulate_grad_hook(weak_hook(self._on_full_grad))
        with torch.no_grad():
            self.layout.bind(self)
        self._free()

    # ------------------------------------------------------------------ gather / free
    def _alloc(self) -> None:
        nbytes = self.layout.padded * self.full.element_size()
        if self.full.untyped_storage().size() != nbytes:
            self.full.untyped_storage().resize_(nbytes)

    def _free(self) -> None:
        self.full.untyped_storage().resize_(0)
        self.state = "sharded"
        self.layout.unbind(self)

    def gather(self, comm_thread: bool = False) -> None:
        """All-gather now (main thread), or start it on the comm thread (``comm_thread=True``)."""
        if self.layout is None or self.state != "sharded" or self.handle is not None:
            return
        self._alloc()
        self._gathered_from = self._versions()
        if comm_thread and self.ctx is not None:
            self.handle = self.ctx.worker_for(self.comm).submit(f"all-gather of unit {self.unit_name()} "
                                                 f"(rank {self.rank})", self.layout.gather_into,
                                                 self)
        else:
            self.layout.gather_into(self.comm, self)
            self.state = "gathered"

    def wait_gathered(self) -> None:
        if self.handle is not None:
            self.handle.wait()
            self.handle, self.state = None, "gathered"
            self.ctx.prefetched += 1
        self.gather()

    def _versions(self) -> tuple:
        shards = self.params if self.layout.per_parameter else [self.flat_shard]
        return tuple(p._version for p in shards if p is not None)

    def _drop_if_stale(self) -> None:
        """Free a gathered copy (kept or prefetched) of shards changed since (step, load), as FSDP2."""
        if self.state == "sharded" and self.handle is None:
            return
        if self._gathered_from == self._versions():
            return
        if self.handle is not None:
            self.handle.wait()
            self.handle = None
        self._free()

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
            if not ctx.in_backward:
                self._drop_if_stale()
            self.wait_gathered()
            self.layout.bind(self)            # fresh views, recorded by autograd if grad is on
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
        if self.ctx.in_backward:              # recomputing: the backward frees it
            return output
        if self.reshard_after_forward:
            self._free()
        else:   # keep the gathered storage, but the module's names are the shards again: a
            self.layout.unbind(self)   # no-grad forward has no backward to free it
        return output

    def _pre_backward_hook(self, grad):
        self.pre_backward()

    def pre_backward(self) -> None:
        ctx = self.ctx
        if not ctx.in_backward:
            ctx.in_backward, ctx.recording = True, False
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)
        self.wait_gathered()
        if self.prefetch and self in ctx.order:   # next in backward: the previous unit in forward
            i = ctx.order.index(self)
            ctx.order[i - 1 if i > 0 else -1].gather(comm_thread=True)
        if self.state == "gathered":   # code that runs again in backward (recomputation) sees
            with torch.enable_grad():  # the gathered parameters, as the first forward did
                self.layout.bind(self)

    def _on_full_grad(self, full: torch.Tensor) -> None:
        self._on_grad()

    def _on_grad(self) -> None:
        grad = self.full.grad
        self.full.grad = None
        rdtype = self.mp.reduce_dtype or self.layout.master_dtype(self)
        grad = grad.to(rdtype)
        if self.unsharded_grad is not None:
            grad = grad + self.unsharded_grad
            self.unsharded_grad = None
        if not self.sync:                               # no_sync: keep the full sum locally
            self.unsharded_grad = grad
        else:
            out = torch.empty(self.layout.shard_numel, dtype=rdtype, device=grad.device)
            # this reduce's own record of who got a gradient: a unit can reduce twice in one
            # backward (run twice under a reentrant checkpoint: two nested backwards), and the
            # comm thread must not read a set the main thread is refilling
            got, self._got_grad = self._got_grad, set()
            agreed: set[int] = set()
            h = self.ctx.worker_for(self.comm).submit(f"reduce-scatter of unit {self.unit_name()} (rank "
                                       f"{self.rank})", self._reduce, out,
                                       self.layout.to_rank_major(grad), got, agreed)
            self.ctx.pending.append((self, h, out, agreed))
        self._free()

    def _reduce(self, comm, out: torch.Tensor, grad: torch.Tensor, got: set[int],
                agreed: set[int]) -> None:
        """Comm thread: ``out`` ← this rank's slice of the average of ``grad``; ``agreed`` ← used anywhere."""
        if not self.layout.per_parameter:               # flat: one shard, every element kept
            comm.reduce_scatter(out, grad, "avg", divisor=self.divide_factor)
            return
        used = torch.tensor([float(i in got) for i in range(len(self.params))],
                            device=out.device)
        comm.reduce_scatter(out, grad, "avg", divisor=self.divide_factor)
        comm.all_reduce(used, "max")
        if self.rep is not None:
            rep = getattr(self.ctx, "rep_thread", None)
            if rep is None:
                raise RuntimeError(f"fully_shard (rank {self.rank}): unit {self.unit_name()} "
                                   "replicates but its root has no replicate group")
            if self._partial is not None:
                out.add_(self._partial[0])
                used = torch.maximum(used, self._partial[1])
                self._partial = None
            if not self.requires_all_reduce:
                self._partial = (out.clone(), used)
                return
            rep.all_reduce(out, "avg")
            rep.all_reduce(used, "max")
        agreed.update(i for i, u in enumerate(used.tolist()) if u > 0)

    def _mark(self, i: int):
        """A hook for parameter ``i``'s view: record that it got a gradient in this backward."""
        got = self._got_grad   # the set, not the unit: a tensor's hook must not hold its owner

        def hook(grad):
            got.add(i)
        return hook

    def start_backward(self) -> None:
        """Gathered and bound under grad mode before a backward its hooks may not start: a split
        backward's weight pass, a backward of its own that may run a recomputed forward (which
        must see the gathered parameters and keep them). :meth:`finish_backward` after it."""
        self.ctx.in_backward = True
        self.wait_gathered()
        if self.layout is not None:
            with torch.enable_grad():
                self.layout.bind(self)

    def finish_backward(self) -> None:
        """Wait for this backward's reduce-scatters, keep the shards' gradients, free every unit
        under the root (autograd calls it at the end of a backward; a split backward's weight
        pass, a backward of its own, is finished by its caller)."""
        ctx = self.ctx
        ctx.in_backward = False
        pending, ctx.pending = ctx.pending, []
        with torch.no_grad():
            for unit, h, out, agreed in pending:
                h.wait()
                unit.layout.accept(unit, out, agreed)
        for unit in ctx.order:                # units whose gradient never came: free them too
            if unit.layout is not None and unit.handle is not None:
                unit.wait_gathered()
            if unit.layout is not None and unit.state != "sharded":
                unit._free()


def _tensors(obj):
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)
