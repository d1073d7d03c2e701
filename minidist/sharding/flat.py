"""Flat, padded, sharded buffers: the one data layout every ZeRO stage here uses.

A :class:`FlatBuffer` packs tensors one after the other into a 1-D buffer padded with zeros to
``W · S`` elements, ``S = ceil(numel / W)``; rank r owns ``[r·S, (r+1)·S)``: balanced by element
count (Rajbhandari et al. 2020, §5). Element-wise optimizers step a flat shard exactly as the
parameters it covers.
Design notes: docs/design/sharding.md
"""

from __future__ import annotations

import torch

__all__ = ["FlatBuffer", "plan_buckets", "padded_numel"]


def padded_numel(numel: int, world_size: int) -> int:
    """Smallest multiple of ``world_size`` that is ≥ ``numel`` (0 stays 0... padded to W)."""
    return max(1, -(-numel // world_size)) * world_size


def plan_buckets(params: list, cap_bytes: int | None) -> list[list]:
    """Split ``params`` (in order) into groups of at most ``cap_bytes`` (never splitting a
    parameter; one larger than the cap gets a group of its own). ``None``: one group."""
    from ..data_parallel.buckets import pack_by_size  # the one bucket planner
    return [[params[i] for i in g]
            for g in pack_by_size([p.numel() * p.element_size() for p in params], cap_bytes)]


class FlatBuffer:
    """Layout of ``tensors`` in one [padded] buffer split into W shards: ``offsets``/``numels``/``shapes``,
    ``numel``, ``padded`` (W · ``shard_numel``). ``ValueError`` for no tensors or mixed dtypes/devices."""

    def __init__(self, tensors: list, world_size: int, rank: int):
        if not tensors:
            raise ValueError("FlatBuffer: no tensors to flatten")
        dtypes = {t.dtype for t in tensors}
        devices = {t.device for t in tensors}
        if len(dtypes) > 1 or len(devices) > 1:
            raise ValueError(f"FlatBuffer: tensors of one flat buffer must share dtype and device, "
                             f"got {sorted(map(str, dtypes))} on {sorted(map(str, devices))}")
        self.dtype, self.device = dtypes.pop(), devices.pop()
        self.shapes = [tuple(t.shape) for t in tensors]
        self.numels = [t.numel() for t in tensors]
        self.offsets, n = [], 0
        for k in self.numels:
            self.offsets.append(n)
            n += k
        self.numel, self.world_size, self.rank = n, world_size, rank
        self.padded = padded_numel(n, world_size)
        self.shard_numel = self.padded // world_size

    def empty(self, dtype=None, zero: bool = True) -> torch.Tensor:
        """A new [padded] buffer (zeros by default: the padding must stay zero)."""
        make = torch.zeros if zero else torch.empty
        return make(self.padded, dtype=dtype or self.dtype, device=self.device)

    def pack(self, tensors: list, out: torch.Tensor | None = None, dtype=None) -> torch.Tensor:
        """Copy ``tensors`` (``None`` = zeros) into a [padded] buffer (new unless ``out``)."""
        out = self.empty(dtype) if out is None else out
        for t, o, k in zip(tensors, self.offsets, self.numels):
            if t is None:
                out[o:o + k].zero_()
            else:
                out[o:o + k].copy_(t.reshape(-1))
        return out

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-tensor views of ``flat`` [padded], in their original shapes."""
        return [flat[o:o + k].view(s) for o, k, s in zip(self.offsets, self.numels, self.shapes)]

    def shard(self, flat: torch.Tensor, rank: int | None = None) -> torch.Tensor:
        """Rank ``rank``'s (default: this rank's) slice [shard_numel] of ``flat``: a view."""
        r = self.rank if rank is None else rank
        return flat[r * self.shard_numel:(r + 1) * self.shard_numel]

    def pieces(self, rank: int | None = None) -> list[tuple[int, int, int, int]]:
        """(tensor index, start in tensor, start in shard, length) of what a rank's shard covers."""
        r = self.rank if rank is None else rank
        lo, hi, out = r * self.shard_numel, (r + 1) * self.shard_numel, []
        for i, (o, k) in enumerate(zip(self.offsets, self.numels)):
            a, b = max(lo, o), min(hi, o + k)
            if a < b:
                out.append((i, a - o, a - lo, b - a))
        return out
