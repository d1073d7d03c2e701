"""FSDP1's flat layout for a :class:`~.fsdp_unit.ShardUnit`: ``fully_shard(..., per_parameter=False)``.

The first design, kept to teach why it was replaced: a unit's *trainable* parameters packed into
one padded flat buffer (torch FSDP1's ``FlatParameter``), rank r keeping its [S] slice as
``flat_shard``. The optimizer sees one 1-D tensor per unit, a parameter frozen at wrap can never
train (``RuntimeError`` at the next forward), an unused parameter still gets a zero gradient.
Design notes: docs/design/sharding.md
"""

from __future__ import annotations

import torch
from torch import nn

from .flat import FlatBuffer
from .ownership import _claim, _own_modules, _slots

__all__ = ["FlatLayout"]


class FlatLayout(FlatBuffer):
    """Where a flat unit's parameters live: a :class:`~.flat.FlatBuffer`'s packing."""

    per_parameter = False

    @classmethod
    def wrap(cls, unit, module: nn.Module) -> FlatLayout | None:
        """Pack ``module``'s trainable parameters (rank 0's values) and keep this rank's slice as
        ``flat_shard``. ``ValueError`` for mixed dtypes/devices or a parameter tied to another unit."""
        unit.slots, params, unit.names = _slots(module, lambda p: p.requires_grad)
        unit.frozen = [(f"{mod_name}{name}", p)   # (name, parameter) left unsharded: frozen at wrap
                       for mod_name, sub in _own_modules(module)
                       for name, p in sub._parameters.items() if p is not None and not p.requires_grad]
        layout = cls(params, unit.world_size, unit.rank) if params else None
        _claim(params, unit.names, type(module).__name__)
        if layout is None:
            return None
        with torch.no_grad():
            flat = layout.pack(params)
            unit.comm.broadcast(flat, 0)                 # every rank starts from rank 0's values
            shard = layout.shard(flat).clone()
        for sub, name, _, _ in unit.slots:
            del sub._parameters[name]
        unit.flat_shard = nn.Parameter(shard)             # [S] fp32 master, what optimizers see
        module.register_parameter("flat_shard", unit.flat_shard)
        for p in params:                                  # the full copies are not kept
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        return layout

    def gather_into(self, comm, unit) -> None:
        """``unit.full`` ← every rank's [S] slice, rank-major (which is the packed order)."""
        comm.all_gather(unit.full.data, unit.flat_shard.detach().to(unit.compute_dtype))

    def bind(self, unit) -> None:
        views = self.views(unit.full)
        for sub, name, i, _ in unit.slots:
            setattr(sub, name, views[i])

    def unbind(self, unit) -> None:
        """Nothing: the names keep their views, whose storage is freed (there are no shards to
        point them at: a slice of ``flat_shard`` is not a parameter's shape)."""

    def to_rank_major(self, grad: torch.Tensor) -> torch.Tensor:
        return grad                                       # the packed order is rank-major already

    def master_dtype(self, unit) -> torch.dtype:
        return unit.flat_shard.dtype

    def accept(self, unit, out: torch.Tensor, got: set[int]) -> None:
        """Add this rank's averaged slice ``out`` [S] to ``flat_shard``'s gradient."""
        g = out.to(unit.flat_shard.dtype)
        if unit.flat_shard.grad is None:
            unit.flat_shard.grad = g
        else:
            unit.flat_shard.grad.add_(g)
