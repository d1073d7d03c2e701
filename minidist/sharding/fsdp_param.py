"""Per-parameter sharding, the default layout of a :class:`~.fsdp_unit.ShardUnit` (FSDP2's
``_fsdp_param.py``): ``p`` [d0, *rest] padded to W·c rows, rank r keeps rows [r·c, (r+1)·c) in ``p``
itself, so param groups and ``requires_grad`` stay per parameter; communication goes through one
flat [W·S] buffer per unit. 0-d parameters: ``ValueError``.
Design notes: docs/design/sharding.md
"""

from __future__ import annotations

import torch

from .ownership import _claim, _own_modules, _slots

__all__ = ["ParamLayout"]


class ParamLayout:
    """Where each parameter of a per-parameter unit lives: ``shapes``, ``rows`` (c_i), ``numels``
    (c_i·rest_i), ``offsets`` (in [S]); ``shard_numel`` S; ``padded`` W·S; ``dtype``/``device``."""

    per_parameter = True

    def __init__(self, params, world_size: int):
        if not params:
            raise ValueError("ParamLayout: no parameters")
        self.dtype, self.device = params[0].dtype, params[0].device
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

    # ------------------------------------------------------------------ what the unit asks
    @classmethod
    def wrap(cls, unit, module) -> ParamLayout | None:
        """Shard ``module``'s parameters outside units below (rank 0's values broadcast); sets
        ``unit.slots``/``names``/``params``. ``ValueError``: 0-d, mixed dtypes without ``param_dtype``, tied to another unit.
        """
        unit.slots, params, unit.names = _slots(module, lambda p: True)   # frozen ones too
        name = type(module).__name__
        for p, n in zip(params, unit.names):
            if p.dim() == 0:
                raise ValueError(f"fully_shard (rank {unit.rank}): parameter {n} of {name} is a "
                                 "0-d tensor; per-parameter sharding cuts dim 0 — give it shape "
                                 "[1] or keep it outside the sharded modules")
        if unit.mp.param_dtype is None and len({p.dtype for p in params}) > 1:
            raise ValueError(f"fully_shard (rank {unit.rank}): unit {name} mixes dtypes "
                             + ", ".join(f"{n}: {p.dtype}" for p, n in zip(params, unit.names))
                             + "; one all-gather needs one dtype: convert them or set "
                               "mp_policy=MixedPrecisionPolicy(param_dtype=...)")
        _claim(params, unit.names, name)
        unit.params = params
        _sync_at_wrap(unit, module)
        layout = cls(params, unit.world_size) if params else None
        if layout is None or layout.shard_numel == 0:
            return None
        W, r = unit.world_size, unit.rank
        with torch.no_grad():
            for p, c in zip(params, layout.rows):
                rows = torch.zeros((W * c,) + tuple(p.shape[1:]), dtype=p.dtype, device=p.device)
                rows[:p.shape[0]].copy_(p)
                p.data = rows[r * c:(r + 1) * c].clone()
        return layout

    def gather_into(self, comm, unit) -> None:
        """``unit.full`` ← every rank's shards: concatenated into [S], all-gathered into [W, S]
        (rank-major), copied out parameter-major."""
        mine = torch.cat([p.detach().reshape(-1).to(unit.compute_dtype) for p in unit.params])
        ranked = torch.empty(self.padded, dtype=unit.compute_dtype, device=mine.device)
        comm.all_gather(ranked, mine)
        self.to_param_major(ranked, unit.full.data)

    def bind(self, unit) -> None:
        """The module's parameter names → views of ``unit.full`` (detached for a frozen
        parameter; under grad mode, a hook records which parameters got a gradient)."""
        views = self.views(unit.full)
        grad_on = torch.is_grad_enabled()
        for sub, name, i, _ in unit.slots:
            v = views[i]
            if not unit.params[i].requires_grad:
                v = v.detach()
            elif grad_on:
                v.register_hook(unit._mark(i))
            sub._parameters[name] = v

    def unbind(self, unit) -> None:
        """The module's parameter names → the shards again (what the optimizer steps)."""
        for sub, name, i, _ in unit.slots:
            sub._parameters[name] = unit.params[i]

    def master_dtype(self, unit) -> torch.dtype:
        dtype = unit.params[0].dtype
        for p in unit.params[1:]:
            dtype = torch.promote_types(dtype, p.dtype)
        return dtype

    def accept(self, unit, out: torch.Tensor, got: set[int]) -> None:
        """Cut the averaged [S] slice into the shards' gradients: only parameters that got a
        gradient on some rank in this reduce (``got``, agreed by the reduce) and require one."""
        for i, p in enumerate(unit.params):
            if i not in got or not p.requires_grad:
                continue
            o, k = self.offsets[i], self.numels[i]
            g = out[o:o + k].view(p.shape).to(p.dtype)
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.add_(g)


def _sync_at_wrap(unit, module) -> None:
    """Every rank starts from rank 0's parameters (trainable and frozen) and buffers (under HSDP:
    from rank 0 of the replicate group, then of the shard group — global rank 0's)."""
    with torch.no_grad():
        tensors = list(unit.params) + [b for _, sub in _own_modules(module)
                                       for b in sub._buffers.values() if b is not None]
        by_dtype: dict = {}
        for t in tensors:
            by_dtype.setdefault((t.dtype, t.device), []).append(t)
        for group in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in group]) if group else None
            if flat is None or flat.numel() == 0:
                continue
            if unit.rep is not None:
                unit.rep.broadcast(flat, 0)
            unit.comm.broadcast(flat, 0)
            o = 0
            for t in group:
                t.copy_(flat[o:o + t.numel()].view(t.shape))
                o += t.numel()
