"""ZeRO stages 1 and 2: optimizer states (and gradients) sharded over the data-parallel ranks.

:class:`ShardedOptimizer` (torch's ``ZeroRedundancyOptimizer`` signature) packs each param group's
trainable parameters, in backward's order, into flat padded buffers (:class:`~.flat.FlatBuffer`);
rank r's inner optimizer steps only its 1/W slice of each, then every buffer is all-gathered
(Rajbhandari et al. 2020, §5.1, P_os). Stage 1 takes averaged (or, ``grads="local"``,
reduce-scatters local) gradients; stage 2 reduce-scatters them during backward
(:mod:`.zero_backward`, §5.2). State dicts: :mod:`.zero_state`. Construction syncs nothing.
Design notes: docs/design/sharding.md
"""

from __future__ import annotations

import torch

from ..backward import weak_hook
from ..communicator import CommThread, Communicator
from ..data_parallel.buckets import check_bucket_cap
from ..data_parallel.usage import gradient_users
from .flat import FlatBuffer, plan_buckets
from .zero_backward import _Stage2Backward
from .zero_state import _ConsolidatedState

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


class ShardedOptimizer(_Stage2Backward, _ConsolidatedState):
    """ZeRO-1/2 optimizer wrapper (torch's ``ZeroRedundancyOptimizer`` signature).

    ``optimizer_class`` (e.g. ``torch.optim.AdamW``) is built on this rank's flat slices with
    ``**defaults``; ``group``: the data-parallel group (default the world); ``collectives``/
    ``algorithm`` as :class:`~minidist.communicator.Communicator`; ``stage`` 1 or 2; ``grads``
    (stage 1) ``"averaged"`` or ``"local"``; ``bucket_cap_mb``: MiB per flat buffer (default one
    per param group for stage 1, 25 for stage 2). ``ValueError``/``TypeError`` for bad arguments."""

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
        hook = weak_hook(self._on_grad)   # the parameters must not keep the optimizer alive
        self._handles += [p.register_post_accumulate_grad_hook(hook) for p in params]

    def _take_in_thawed(self) -> list[_Bucket]:
        """Buckets (fresh state, stage-2 hooks) for parameters that were frozen and train now."""
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
        """Step this rank's slices, then all-gather every flat buffer. With ``grad_scaler`` (a
        ``GradScaler`` passes itself) an inf/NaN on any rank makes every rank skip. Returns None;
        ``ValueError`` for a closure."""
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

