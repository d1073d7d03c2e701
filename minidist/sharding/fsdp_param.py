"""Per-parameter sharding for :func:`~.fsdp.fully_shard`: each parameter is cut on dim 0.

The flat design (:class:`~.fsdp_flat.FlatParamUnit`, FSDP1's ``FlatParameter``) hands the optimizer
one 1-D slice per unit, so nothing per parameter survives: a param group "weight decay on
``p.dim() >= 2`` only" cannot be written, and a parameter frozen at wrap time can never train.
FSDP2 (torch ``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``) shards every parameter on
dim 0 instead, and keeps one flat buffer per unit for the communication only. So does this file:

* parameter ``p`` [d0, *rest] (d0 rows) is padded to ``W·c`` rows, ``c = ceil(d0 / W)``; rank r
  keeps rows ``[r·c, (r+1)·c)``: ``p`` itself (the same ``nn.Parameter`` object, so references
  taken before wrapping stay valid) now holds that [c, *rest] shard, under its own name, with its
  own ``requires_grad``. Padding rows are zero and stay zero (their gradient is zero).
* **all-gather**: rank r's shards are copied into one [S] buffer (``S = Σ c·rest``, in
  ``param_dtype``), all-gathered into [W, S] (rank-major), and copied out into ``full`` [W·S],
  parameter-major, where parameter i is the contiguous padded [W·c_i, *rest] block; the module
  sees views ``full[P_i : P_i + d0·rest].view(d0, *rest)`` while it runs (detached when
  ``p.requires_grad`` is False, so a frozen parameter gets no gradient, and changing
  ``requires_grad`` after wrapping takes effect at the next forward).
* **reduce-scatter**: the gradient of ``full`` is copied back to rank-major [W, S], reduce-
  scattered (average) into [S], and cut into the shards' gradients — only for parameters that got
  a gradient in this backward on some rank (as one process: a parameter no rank used keeps
  ``grad`` None; one that some rank used gets the average on every rank, agreed by a small
  all-reduce of flags after the reduce-scatter).

Frozen parameters are sharded and gathered like the others (cast to ``param_dtype`` too: FSDP2's
behaviour), so mixed precision with frozen weights works. 0-d parameters are refused
(``ValueError``): there is no dim 0 to cut.
"""

from __future__ import annotations

import torch

from .fsdp_flat import FlatParamUnit, _claim, _own_modules, _reduce_scatter, _slots

__all__ = ["ParamShardUnit", "ParamLayout"]


class ParamLayout:
    """Where each parameter lives. Per parameter i: ``shapes[i]`` (full), ``rows[i]`` (c_i, rows
    per rank), ``numels[i]`` (c_i·rest_i, elements per rank), ``offsets[i]`` (o_i, in the [S]
    per-rank buffer); ``shard_numel`` S; ``padded`` W·S (the gathered buffer)."""

    def __init__(self, params, world_size: int):
        self.shapes = [tuple(p.shape) for p in params]
        self.rows, self.rests, self.numels, self.offsets, n = [], [], [], [], 0
        for s in self.shapes:
            rest = 1
            for d in s[1:]:
                rest *= d
            c = -(-s[0] // world_size)
            self.rows.append(c)
            self.rests.append(rest)
            self.numels.append(c * rest)
            self.offsets.append(n)
            n += c * rest
        self.world_size, self.shard_numel = world_size, n
        self.padded = world_size * n

    def views(self, full: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter views [d0, *rest] of the parameter-major ``full`` [W·S]."""
        W = self.world_size
        return [full[W * o:W * o + s[0] * rest].view(s)
                for o, rest, s in zip(self.offsets, self.rests, self.shapes)]

    def to_param_major(self, ranked: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """[W, S] rank-major (as all-gathered) → parameter-major ``out`` [W·S]."""
        W, ranked = self.world_size, ranked.view(self.world_size, self.shard_numel)
        for o, k in zip(self.offsets, self.numels):
            out[W * o:W * (o + k)].view(W, k).copy_(ranked[:, o:o + k])
        return out

    def to_rank_major(self, full: torch.Tensor) -> torch.Tensor:
        """Parameter-major [W·S] → rank-major [W·S] (what reduce-scatter cuts into W pieces)."""
        W = self.world_size
        pieces = [full[W * o:W * (o + k)].view(W, k) for o, k in zip(self.offsets, self.numels)]
        return torch.cat(pieces, dim=1).reshape(-1)


class ParamShardUnit(FlatParamUnit):
    """The state per-parameter :func:`~.fsdp.fully_shard` attaches to a module as ``_fsdp``.

    ``params`` (the unit's parameters, each now its [c, *rest] shard), ``names`` (their names in
    the unit), ``layout`` (:class:`ParamLayout`), ``full`` (the gathered buffer, freed between
    uses). Everything else (hooks, prefetch, freeing, no_sync) is :class:`~.fsdp_flat.FlatParamUnit`'s.
    """

    def __init__(self, module, comm, mp, reshard_after_forward: bool, prefetch: bool, rep=None):
        self.module, self.comm, self.mp = module, comm, mp
        self.rep = rep                      # HSDP: the replicate group's communicator, or None
        self.reshard_after_forward, self.prefetch = reshard_after_forward, prefetch
        self.rank, self.world_size = comm.rank, comm.world_size
        self.slots, params, self.names = _slots(module, lambda p: True)   # frozen ones too
        self.frozen = []
        unit = type(module).__name__
        for p, n in zip(params, self.names):
            if p.dim() == 0:
                raise ValueError(f"fully_shard (rank {self.rank}): parameter {n} of {unit} is a "
                                 "0-d tensor; per-parameter sharding cuts dim 0 — give it shape "
                                 "[1] or keep it outside the sharded modules")
        if mp.param_dtype is None and len({p.dtype for p in params}) > 1:
            raise ValueError(f"fully_shard (rank {self.rank}): unit {unit} mixes dtypes "
                             + ", ".join(f"{n}: {p.dtype}" for p, n in zip(params, self.names))
                             + "; one all-gather needs one dtype: convert them or set "
                               "mp_policy=MixedPrecisionPolicy(param_dtype=...)")
        _claim(params, self.names, unit)
        self.params = params
        self.ctx, self.sync, self.state, self.handle = None, True, "sharded", None
        self.full, self.unsharded_grad = None, None
        self._got_grad: set[int] = set()    # parameters that got a gradient here (this rank)
        self._agreed: set[int] = set()      # ... on any rank, after the reduce (see _reduce)
        self.requires_all_reduce = True     # HSDP: False keeps pieces uncrossed (see _reduce)
        self._partial: tuple | None = None  # ... their sum and flags, until the next all-reduce
        self._sync_at_wrap(module)
        self.layout = ParamLayout(params, self.world_size) if params else None
        if self.layout is None or self.layout.shard_numel == 0:
            self.layout = None
            return
        W, r = self.world_size, self.rank
        with torch.no_grad():
            for p, c in zip(params, self.layout.rows):
                rows = torch.zeros((W * c,) + tuple(p.shape[1:]), dtype=p.dtype, device=p.device)
                rows[:p.shape[0]].copy_(p)
                p.data = rows[r * c:(r + 1) * c].clone()
        self.compute_dtype = mp.param_dtype or params[0].dtype
        self.full = torch.zeros(self.layout.padded, dtype=self.compute_dtype,
                                device=params[0].device).requires_grad_()
        self.full.register_post_accumulate_grad_hook(lambda t: self._on_grad())
        self._free()

    def _sync_at_wrap(self, module) -> None:
        """Every rank starts from rank 0's parameters (trainable and frozen) and buffers (under
        HSDP: from rank 0 of the replicate group, then of the shard group — global rank 0's)."""
        with torch.no_grad():
            tensors = list(self.params) + [b for _, sub in _own_modules(module)
                                           for b in sub._buffers.values() if b is not None]
            by_dtype: dict = {}
            for t in tensors:
                by_dtype.setdefault((t.dtype, t.device), []).append(t)
            for group in by_dtype.values():
                flat = torch.cat([t.reshape(-1) for t in group]) if group else None
                if flat is None or flat.numel() == 0:
                    continue
                if self.rep is not None:
                    self.rep.broadcast(flat, 0)
                self.comm.broadcast(flat, 0)
                o = 0
                for t in group:
                    t.copy_(flat[o:o + t.numel()].view(t.shape))
                    o += t.numel()

    # ------------------------------------------------------------------ gather / views / free
    def _gather_into(self, comm) -> None:
        mine = torch.cat([p.detach().reshape(-1).to(self.compute_dtype) for p in self.params])
        ranked = torch.empty(self.layout.padded, dtype=self.compute_dtype, device=mine.device)
        comm.all_gather(ranked, mine)
        self.layout.to_param_major(ranked, self.full.data)

    def _set_views(self) -> None:
        views = self.layout.views(self.full)
        grad_on = torch.is_grad_enabled()
        for sub, name, i, _ in self.slots:
            v = views[i]
            if not self.params[i].requires_grad:
                v = v.detach()
            elif grad_on:
                v.register_hook(self._mark(i))
            sub._parameters[name] = v

    def pre_backward(self) -> None:
        super().pre_backward()
        if self.state == "gathered":   # code that runs again in backward (recomputation) sees
            with torch.enable_grad():  # the gathered parameters, as the first forward did
                self._set_views()

    def _mark(self, i: int):
        def hook(grad):
            self._got_grad.add(i)
        return hook

    def _free(self) -> None:
        self.full.untyped_storage().resize_(0)
        self.state = "sharded"
        for sub, name, i, _ in self.slots:
            sub._parameters[name] = self.params[i]

    # ------------------------------------------------------------------ gradients
    def master_dtype(self) -> torch.dtype:
        dtype = self.params[0].dtype
        for p in self.params[1:]:
            dtype = torch.promote_types(dtype, p.dtype)
        return dtype

    def _reduce_input(self, grad: torch.Tensor) -> torch.Tensor:
        return self.layout.to_rank_major(grad)

    def _reduce(self, comm, out: torch.Tensor, grad: torch.Tensor) -> None:
        """The reduce-scatter, then which parameters got a gradient on *any* rank (an all-reduce
        of a 0/1 flag per parameter, on the same thread so the collectives stay in order): a
        parameter one rank used and another did not (an expert no token of this rank chose) must
        get the averaged gradient on both, or the replicas' shards part ways.

        HSDP: then the [S] average over the shard group is all-reduced (average) over the
        replicate group — the ranks that hold the same piece — and the flags too (``max``), on
        the comm thread's copy of that group (:class:`~.fsdp_flat._Context`). Under
        :func:`~.fsdp.set_requires_all_reduce` ``(False)`` the piece is kept instead (summed with
        any kept before) and no gradient is handed out; the next backward that all-reduces adds
        the kept sum to its own piece *before* the all-reduce, so every micro-batch crosses
        (pytorch/pytorch#125484: accumulating after the all-reduce would leave earlier
        micro-batches out)."""
        used = torch.tensor([float(i in self._got_grad) for i in range(len(self.params))],
                            device=out.device)
        _reduce_scatter(comm, out, grad)
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
                self._partial, self._agreed = (out.clone(), used), set()
                return
            rep.all_reduce(out, "avg")
            rep.all_reduce(used, "max")
        self._agreed = {i for i, u in enumerate(used.tolist()) if u > 0}

    def _accept_grad(self, out: torch.Tensor) -> None:
        got, self._got_grad = self._agreed, set()
        for i, p in enumerate(self.params):
            if i not in got or not p.requires_grad:
                continue
            o, k = self.layout.offsets[i], self.layout.numels[i]
            g = out[o:o + k].view(p.shape).to(p.dtype)
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.add_(g)
