"""FSDP1's flat layout for a :class:`~.fsdp_unit.ShardUnit`: ``fully_shard(..., per_parameter=False)``.

The first design, kept to teach why it was replaced. A unit's *trainable* parameters are packed
into one flat buffer padded to W·S elements (:class:`~.flat.FlatBuffer`; torch FSDP1's
``FlatParameter``, ``torch/distributed/fsdp/_flat_param.py``), rank r keeping its [S] slice as
the unit's one parameter ``flat_shard``; while the module runs, its parameter names are plain
attributes pointing at views of the gathered buffer. What that costs, and why FSDP2 moved to
:class:`~.fsdp_param.ParamLayout` (torch's per-parameter-sharding FSDP tracker, pytorch/pytorch#114299):

* the optimizer sees one 1-D tensor per unit, so a param group "weight decay on ``p.dim() >= 2``"
  cannot be written;
* a parameter frozen at wrap time stays unsharded (``unit.frozen``) and can never train: thawing
  it is a ``RuntimeError`` at the next forward, naming it;
* a parameter no rank used still gets a (zero) gradient: there is one shard, not one per parameter.

The hooks, prefetching, freeing and no_sync are the unit's (:mod:`.fsdp_unit`); this file only
says where the parameters live.
"""

from __future__ import annotations

import torch
from torch import nn

from .flat import FlatBuffer
from .ownership import _claim, _own_modules, _slots

__all__ = ["FlatLayout"]


class FlatLayout(FlatBuffer):
    """Where a flat unit's parameters live: :class:`~.flat.FlatBuffer`'s packing (``offsets``,
    ``numels``, ``shapes`` per parameter, ``padded`` = W·S, ``shard_numel`` = S), plus what a
    :class:`~.fsdp_unit.ShardUnit` asks of its layout."""

    per_parameter = False

    @classmethod
    def wrap(cls, unit, module: nn.Module) -> FlatLayout | None:
        """Pack ``module``'s trainable parameters (outside units below) from rank 0's values,
        keep this rank's slice as ``module.flat_shard`` (and ``unit.flat_shard``), drop the
        originals' storage. Raises ``ValueError`` for mixed dtypes/devices (one buffer) and a
        parameter tied to another unit's."""
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
