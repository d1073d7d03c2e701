"""ZeRO stages 1 and 2: optimizer states (and gradients) sharded over the data-parallel ranks.

:class:`ShardedOptimizer` has the signature of torch's ``ZeroRedundancyOptimizer``. Each param
group's trainable parameters are packed (in reverse registration order: the order backward
produces their gradients) into flat padded buffers (:class:`~.flat.FlatBuffer`, at most
``bucket_cap_mb`` each); the parameters become views of them. Rank r owns the r-th 1/W slice of
every buffer, and the wrapped optimizer (any element-wise ``torch.optim`` class: SGD, Adam, AdamW)
is built on those slices only, so it keeps state for ``Ψ/N_d`` elements (Rajbhandari et al. 2020,
§5.1, P_os). After its step the buffers are **all-gathered** — not broadcast from owners: every
rank owns an equal slice, so one ring all-gather per buffer sends (W-1)/W of it per rank, the
second half of a ring all-reduce, and reduce-scatter (grads) + all-gather (params) together move
exactly what plain data parallelism's all-reduce moves (§7.2.1). Broadcasting from owners would
need W broadcasts of unequal sizes and, with the gradients all-reduced, 1.5x DP's traffic.

``stage=1`` with ``grads="averaged"`` (default, as torch's): ``p.grad`` was already averaged
(e.g. by DDP). ``grads="local"``: ``p.grad`` is this rank's gradient and :meth:`step`
reduce-scatters it (average), so each rank only ever reduces its own slice.

``stage=2`` (§5.2, P_os+g): a post-accumulate-grad hook copies each gradient into its bucket and
frees ``p.grad``; a full bucket is reduce-scattered on a communication thread while backward
continues (the overlap of :class:`minidist.data_parallel.BucketedDDP`); each rank keeps only its
[S] slice of the averaged gradient. Backward then accumulates (micro-batches add up in the slices).

Parameters with ``requires_grad=False`` are left as they are (never stepped, no state) until they
require a gradient: at the next :meth:`step` they get flat buffers of their own in their param
group (fresh optimizer state, as torch creates it at a parameter's first step; stage 2 also hooks
them for the following backwards), so staged fine-tuning ("unfreeze the backbone after N steps")
trains like one process. A parameter frozen *after* construction that shares a flat buffer with
parameters that still train is a ``RuntimeError`` naming it at the next step (torch would skip
only it; a flat slice cannot skip part of itself). Tied parameters appear once. A trainable
parameter without a gradient on this rank counts as a zero contribution when another rank gave
it one (ranks agree by a small all-reduce, :mod:`minidist.data_parallel.usage`; the one-process
answer, as DeepSpeed's default ``ignore_unused_parameters``); one without a gradient on every rank
is a ``RuntimeError`` naming it, on every rank.

Construction syncs nothing: every rank must pass the same parameters (ZeRO-1/2 assume identical
replicas, e.g. after :class:`~minidist.data_parallel.DDP`'s broadcast or a seeded init).
"""

from __future__ import annotations

import torch

from ..backward import in_nested_backward
from ..communicator import CommThread, Communicator
from ..data_parallel.buckets import check_bucket_cap
from ..data_parallel.usage import gradient_users
from .flat import FlatBuffer, plan_buckets

__all__ = ["ShardedOptimizer"]


class _Bucket:
    def __init__(self, params, names, layout: FlatBuffer, group_index: int):
        self.params, self.names, self.layout, self.group_index = params, names, layout, group_index
        with torch.no_grad():
            self.flat = layout.pack(params)          # [padded]: the parameters live here
        for p, v in zip(params, layout.views(self.flat)):
            p.data = v
        self.shard = layout.shard(self.flat)         # [S] what the inner optimizer steps
        self.grad_flat = None                        # stage 2: full bucket during backward
        self.filled, self.handle, self.reduced = 0, None, None
        self.seen: set[int] = set()                  # stage 2: which params gave a gradient


class ShardedOptimizer:
    """ZeRO-1/2 optimizer wrapper. See the module docstring.

    Args:
        params: tensors or param-group dicts (as for any ``torch.optim`` optimizer).
        optimizer_class: e.g. ``torch.optim.AdamW``; built on this rank's flat slices.
        group: data-parallel process group (default: the world), e.g. ``ProcessGrid.dp_group``.
        collectives: ``"hand-built"`` (minidist's) or ``"torch"``.
        algorithm: hand-built only: ``"auto"`` (default; :mod:`minidist.comm.tuner`) or a fixed
            name (``"ring"``, ``"naive"``) for the reduce-scatters and all-gathers.
        stage: 1 (optimizer states sharded) or 2 (gradients too, reduce-scattered in backward).
        grads: stage 1 only — ``"averaged"`` (p.grad already averaged) or ``"local"``.
        bucket_cap_mb: MiB per flat buffer (default: one buffer per param group for stage 1,
            25 MiB for stage 2).
        **defaults: the optimizer's hyperparameters (lr, momentum, weight_decay, ...).
    """

    def __init__(self, params, optimizer_class, group=None, *, collectives: str = "hand-built",
                 stage: int = 1, grads: str = "averaged", bucket_cap_mb: float | None = None,
                 algorithm: str = "auto", **defaults):
        if stage not in (1, 2):
            raise ValueError(f"ShardedOptimizer: stage must be 1 or 2, got {stage!r}")
        if grads not in ("averaged", "local"):
            raise ValueError("ShardedOptimizer: grads must be 'averaged' or 'local', "
                             f"got {grads!r}")
        self.comm = Communicator(collectives, group, where="sharding", algorithm=algorithm)
        self.rank, self.world_size, self.stage, self.grads = (self.comm.rank, self.comm.world_size,
                                                              stage, grads)
        groups = list(params)
        if not groups:
            raise ValueError("ShardedOptimizer got an empty parameter list")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        check_bucket_cap("ShardedOptimizer", "bucket_cap_mb", bucket_cap_mb, allow_none=True)
        if not callable(optimizer_class):
            raise TypeError("ShardedOptimizer: optimizer_class must be a torch.optim class such as "
                            f"torch.optim.AdamW, got {optimizer_class!r}")
        if stage == 2 and bucket_cap_mb is None:
            bucket_cap_mb = 25.0
        cap = None if bucket_cap_mb is None else int(bucket_cap_mb * 2**20)
        self.all_params, seen, inner_groups, self.buckets = [], set(), [], []
        self._group_meta, self._group_params, self._cap = [], [], cap
        for gi, g in enumerate(groups):
            ps = [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])
            for p in ps:
                if id(p) in seen:
                    raise ValueError("ShardedOptimizer: a parameter appears in two param groups")
                seen.add(id(p))
            self.all_params.extend(ps)
            self._group_params.append(ps)
            mine = [b.shard for b in self._add_buckets(gi, [p for p in ps if p.requires_grad])]
            opts = {k: v for k, v in g.items() if k != "params"}
            inner_groups.append({"params": mine, **opts})
            self._group_meta.append(len(ps))
        if not self.buckets:
            raise ValueError("ShardedOptimizer: no parameter requires a gradient")
        self.optim = optimizer_class(inner_groups, **defaults)
        self._handles, self._in_backward, self._next, self._queued = [], False, 0, False
        if stage == 2:
            self.worker = CommThread(self.comm, name="zero-comm")
            self._hook(list(self._where))

    def _add_buckets(self, gi: int, params: list) -> list[_Bucket]:
        """Flat buckets for ``params`` of group ``gi`` (reverse order: backward's), appended."""
        where = {id(p): i for i, p in enumerate(self._group_params[gi])}
        new = []
        for chunk in plan_buckets(list(reversed(params)), self._cap):
            names = [f"group {gi} param {where[id(p)]} {tuple(p.shape)}" for p in chunk]
            new.append(_Bucket(chunk, names, FlatBuffer(chunk, self.world_size, self.rank), gi))
        self.buckets.extend(new)
        self._where = {p: (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        return new

    def _hook(self, params: list) -> None:
        self._handles += [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]

    def _take_in_thawed(self) -> list[_Bucket]:
        """Parameters frozen when this optimizer was built that require a gradient now (staged
        fine-tuning): give them buckets of their own in their param group — fresh optimizer state,
        as torch's optimizers create it at a parameter's first step — and, for stage 2, hooks for
        the next backward. Every rank does the same (``requires_grad`` is set the same way on
        every rank). Returns the new buckets (their ``p.grad`` is still this rank's own)."""
        new = []
        for gi, ps in enumerate(self._group_params):
            thawed = [p for p in ps if p.requires_grad and p not in self._where]
            if thawed:
                bs = self._add_buckets(gi, thawed)
                self.optim.param_groups[gi]["params"].extend(b.shard for b in bs)
                new += bs
        if new and self.stage == 2:
            self._hook([p for b in new for p in b.params])
        return new

    def _refuse_refrozen(self) -> None:
        for b in self.buckets:
            cold = [n for p, n in zip(b.params, b.names) if not p.requires_grad]
            if cold and len(cold) < len(b.params):
                raise RuntimeError(
                    f"ShardedOptimizer (rank {self.rank}): {', '.join(cold)} required a gradient "
                    "when the optimizer was built and is frozen now, in a flat buffer with "
                    "parameters that still train; a flat slice cannot skip part of itself (torch "
                    "would skip only the frozen one). Build a new ShardedOptimizer after freezing "
                    "(state_dict()/load_state_dict() carry the state)")

    # ------------------------------------------------------------------ inspection
    @property
    def param_groups(self) -> list[dict]:
        """The inner optimizer's groups (hyperparameters; their params are this rank's slices)."""
        return self.optim.param_groups

    def shard_numels(self) -> list[int]:
        """Elements this rank owns per flat buffer (equal on every rank)."""
        return [b.layout.shard_numel for b in self.buckets]

    def gradient_divisor(self) -> float:
        """What the summed gradients are divided by: the data-parallel world size."""
        return self.world_size

    # ------------------------------------------------------------------ stage 2: backward hooks
    def _on_grad(self, p: torch.Tensor) -> None:
        if not self._in_backward:                        # the first gradient of a backward
            self._in_backward, self._next = True, 0
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_graph_task)
        b, i = self._where[p]
        if b.grad_flat is None:
            b.grad_flat, b.filled, b.seen = b.layout.empty(), 0, set()
        if i in b.seen:
            self._drop_backward()
            raise RuntimeError(
                f"ShardedOptimizer (rank {self.rank}): gradient of {b.names[i]} produced twice in "
                "one backward: it is used both inside and outside a torch.utils.checkpoint("
                "use_reentrant=True) region, or in two of them (each one's backward is a separate "
                "one), and its bucket may be reduce-scattered before the second part comes. Use "
                "checkpoint(..., use_reentrant=False)")
        o, k = b.layout.offsets[i], b.layout.numels[i]
        b.grad_flat[o:o + k].copy_(p.grad.reshape(-1))
        p.grad = None                                    # the full gradient is not kept
        b.filled += 1
        b.seen.add(i)
        self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets):            # launch in bucket order on every rank
            nb = self.buckets[self._next]
            if not any(q.requires_grad for q in nb.params):   # frozen since: no gradient comes
                self._next += 1
                continue
            if nb.grad_flat is None or nb.filled < len(nb.params):
                break
            nb.reduced = torch.empty(nb.layout.shard_numel, dtype=nb.layout.dtype,
                                     device=nb.layout.device)
            nb.handle = self.worker.submit(f"ZeRO-2 reduce-scatter of bucket {self._next} "
                                           f"(rank {self.rank})", _reduce_scatter, nb.reduced,
                                           nb.grad_flat, self.gradient_divisor())
            self._next += 1

    def _end_of_graph_task(self) -> None:
        """The engine ends a graph task that produced some of the gradients. A reentrant
        checkpoint's nested backward ends inside the user's one (:mod:`minidist.backward`): the
        rest comes later, and the next hook queues this again on the outer task — or, when every
        gradient came from nested backwards, :meth:`step` ends the backward."""
        self._queued = False
        if not in_nested_backward():
            self._finish_backward()

    def _finish_backward(self) -> None:
        """End of backward: a parameter some rank gave no gradient counts as a zero contribution
        on that rank (its slot in the bucket stays zero, the bucket is reduce-scattered like the
        others: the one-process answer); one no rank gave a gradient is refused on every rank
        (:mod:`minidist.data_parallel.usage`)."""
        self._in_backward = False
        active = [b for b in self.buckets if any(q.requires_grad for q in b.params)]
        try:
            self._refuse_refrozen()   # the cause, if a parameter was frozen since (not "missing")
        except RuntimeError:
            self._drop_backward()
            raise
        for b in active:              # slots no gradient reached are zero (layout.empty())
            if b.grad_flat is None:
                b.grad_flat, b.seen = b.layout.empty(), set()
            b.filled = len(b.params)
        self._launch_ready()
        for b in active:
            b.handle.wait()
        used = [i in b.seen for b in active for i in range(len(b.params))]
        names = [n for b in active for n in b.names]
        users = gradient_users(used, self.rank, self.world_size, self.comm.group,
                               active[0].layout.device if active else None)
        nowhere = [n for n, u in zip(names, users) if not u]
        if nowhere:
            self._drop_backward()
            raise RuntimeError(f"ShardedOptimizer (rank {self.rank}): stage 2 got no gradient for "
                               f"{', '.join(nowhere)} on any rank in this backward; freeze them "
                               "(requires_grad=False) or use them in the loss")
        with torch.no_grad():
            for b in active:
                if b.shard.grad is None:
                    b.shard.grad = b.reduced
                else:
                    b.shard.grad.add_(b.reduced)
                b.grad_flat = b.reduced = b.handle = None

    def _drop_backward(self) -> None:
        self._in_backward = False
        for b in self.buckets[:self._next]:
            if b.handle is not None:
                b.handle.wait()
        for b in self.buckets:
            b.grad_flat = b.reduced = b.handle = None

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def _stage1_grads(self, buckets=None, local: bool | None = None) -> None:
        buckets = self.buckets if buckets is None else buckets
        local = self.grads == "local" if local is None else local
        mine = [[p.grad is not None for p in b.params] for b in buckets]
        if local:   # every rank learns who used what: zeros for this rank's skipped ones
            flags = gradient_users([u for m in mine for u in m], self.rank, self.world_size,
                                   self.comm.group, buckets[0].layout.device if buckets else None)
            it = iter(flags)
            anywhere = [[bool(next(it)) for _ in m] for m in mine]
        else:       # averaged (by DDP): the same on every rank already
            anywhere = mine
        for b, used in zip(buckets, anywhere):
            if not any(used):
                b.shard.grad = None
                continue
            if not all(used):
                self._refuse_refrozen()
                bad = [n for n, u in zip(b.names, used) if not u]
                raise RuntimeError(f"ShardedOptimizer (rank {self.rank}): no gradient for "
                                   f"{', '.join(bad)} on any rank; freeze it or use it in the loss")
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in b.params]
            flat = b.layout.pack(grads)
            shard = b.layout.shard(flat)
            if local:
                self.comm.reduce_scatter(shard, flat, divisor=self.gradient_divisor())
            b.shard.grad = shard.clone()

    # torch.amp.GradScaler then calls step(grad_scaler=scaler) instead of deciding alone: each
    # rank sees only its slices, so one rank's inf must make every rank skip (else the ranks that
    # step wait in the all-gather for the one that skipped)
    _step_supports_amp_scaling = True

    def step(self, closure=None, grad_scaler=None):
        """Step this rank's slices, then all-gather every flat buffer (params on every rank).

        With ``grad_scaler`` (a ``torch.amp.GradScaler`` passes itself): the slices' gradients are
        unscaled, an inf/NaN on any rank is agreed by an all-reduce (max) of a flag, and then
        every rank skips the step (the scaler's ``update()`` lowers the scale) or every rank
        steps. Returns None."""
        if closure is not None:
            raise ValueError("ShardedOptimizer.step: closures are not supported")
        if self._in_backward:     # every gradient came from a reentrant checkpoint's backward
            self._finish_backward()
        self._refuse_refrozen()
        new = self._take_in_thawed()
        if self.stage == 1:
            self._stage1_grads(self.buckets, self.grads == "local")
        elif new:                             # thawed since the last step: no hook saw them yet
            self._stage1_grads(new, True)
        if grad_scaler is not None and not self._unscale_and_agree(grad_scaler, new):
            for b in self.buckets:
                if self.stage == 1 or b in new:
                    b.shard.grad = None
            return None
        self.optim.step()
        with torch.no_grad():
            for b in self.buckets:
                self.comm.all_gather(b.flat, b.shard)
                if self.stage == 1 or b in new:
                    b.shard.grad = None       # stage 1: the slice was a temporary

    @torch.no_grad()
    def _unscale_and_agree(self, scaler, new=()) -> bool:
        """Unscale the slices' gradients; True when every rank's are finite (collective)."""
        from torch.amp.grad_scaler import OptState
        state = scaler._per_optimizer_states[id(self)]
        grads = [b.shard.grad for b in self.buckets if b.shard.grad is not None]
        # stage 1 makes its slices in step(), after any unscale_(): they are still scaled (so are
        # stage 2's buckets thawed since the last step, made in step() too)
        inv = scaler._get_scale_async().double().reciprocal().float()
        unscaled = state["stage"] is OptState.UNSCALED and self.stage == 2
        for b in self.buckets:
            g = b.shard.grad
            if g is not None and (not unscaled or b in new):
                g.mul_(inv.to(g.device, g.dtype) if g.dtype != inv.dtype else inv.to(g.device))
        bad = any(not bool(torch.isfinite(g).all()) for g in grads)
        device = grads[0].device if grads else self.buckets[0].shard.device
        flag = torch.tensor([1.0 if bad else 0.0], device=device)
        self.comm.all_reduce(flag, "max")
        found = flag[0].to(scaler._get_scale_async().device)
        state["found_inf_per_device"] = {found.device: found}
        return float(flag[0]) == 0.0

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.all_params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()
        self.optim.zero_grad(set_to_none=set_to_none)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        if self.stage == 2:
            self.worker.close()

    # ------------------------------------------------------------------ state dicts
    checkpoint_scope = "replicated"         # state_dict() is the consolidated state (minidist.state)

    def state_dict(self) -> dict:
        """The full (consolidated) optimizer state in torch's format, on every rank.

        Collective: every rank must call it. ``state`` is keyed by the index of the parameter in
        the order given at construction (frozen ones count, and have no state).
        """
        state, index = {}, {id(p): i for i, p in enumerate(self.all_params)}
        for b in self.buckets:
            own = self.optim.state.get(b.shard, {})
            for key in sorted(own):
                val = own[key]
                if torch.is_tensor(val) and val.shape == b.shard.shape:
                    full = b.layout.empty(val.dtype, zero=False)
                    self.comm.all_gather(full, val)
                    for p, v in zip(b.params, b.layout.views(full)):
                        state.setdefault(index[id(p)], {})[key] = v.clone()
                else:
                    for p in b.params:
                        state.setdefault(index[id(p)], {})[key] = (
                            val.clone() if torch.is_tensor(val) else val)
        groups, start = [], 0
        for g, n in zip(self.optim.param_groups, self._group_meta):
            groups.append({**{k: v for k, v in g.items() if k != "params"},
                           "params": list(range(start, start + n))})
            start += n
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a full optimizer state (from :meth:`state_dict` at any world size, or from a
        plain ``torch.optim`` optimizer over the same parameters); keep this rank's slices."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.optim.param_groups):
            raise ValueError(f"load_state_dict (rank {self.rank}): {len(groups)} param groups, "
                             f"this optimizer has {len(self.optim.param_groups)}")
        for mine, saved in zip(self.optim.param_groups, groups):
            mine.update({k: v for k, v in saved.items() if k != "params"})
        full = {int(k): v for k, v in state_dict["state"].items()}
        index = {id(p): i for i, p in enumerate(self.all_params)}
        for b in self.buckets:
            per = [full.get(index[id(p)], {}) for p in b.params]
            keys = set().union(*per)
            new = {}
            for key in sorted(keys):
                vals = [s.get(key) for s in per]
                if key != "step" and all(torch.is_tensor(v) and v.shape == p.shape
                                         for v, p in zip(vals, b.params)):
                    flat = b.layout.pack(vals, dtype=vals[0].dtype)
                    new[key] = b.layout.shard(flat).clone()
                else:
                    new[key] = vals[0].clone() if torch.is_tensor(vals[0]) else vals[0]
            self.optim.state[b.shard] = new


def _reduce_scatter(comm: Communicator, out, flat, divisor) -> None:
    comm.reduce_scatter(out, flat, divisor=divisor)
