"""Buckets: which gradients travel together in one all-reduce. :func:`pack_by_size` cuts parameters
(reverse registration order) by a byte cap, never over it (``fill=False``) or filled to it as
torch's DDP (``fill=True``, reducer.cpp's ``compute_bucket_assignment_by_size``).
Design notes: docs/design/data_parallel.md
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

__all__ = ["Bucket", "pack_by_size", "build_buckets", "check_bucket_cap"]


@dataclass
class Bucket:
    """One group of parameters whose gradients travel in one all-reduce."""

    index: int
    params: list              # in the order their gradients are expected (reverse registration)
    names: list[str]
    offsets: list[int]        # start of each parameter's slot in ``buffer``
    numel: int
    buffer: torch.Tensor      # flat, reduce_dtype
    filled: int = 0
    seen: set = field(default_factory=set)
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    views: list = field(default_factory=list)  # views[i]: slot i shaped like params[i] (cached)

    @property
    def ready(self) -> bool:
        return self.filled == len(self.params)

    def slot(self, i: int) -> torch.Tensor:
        return self.buffer[self.offsets[i]: self.offsets[i] + self.params[i].numel()]


def check_bucket_cap(where: str, name: str, value, allow_none: bool = False):
    """A bucket size in MiB must be a finite number > 0 (None where ``allow_none``)."""
    import math
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value <= 0:
        raise ValueError(f"{where}: {name} must be a positive number of MiB"
                         f"{' or None' if allow_none else ''}, got {value!r}")
    return value


def pack_by_size(nbytes: list[int], cap_bytes: int | None,
                 first_cap_bytes: int | None = None, fill: bool = False) -> list[list[int]]:
    """Indices ``0..n-1`` cut into consecutive groups by ``cap_bytes`` (``first_cap_bytes`` for group
    0; ``None``: one group), never splitting an item. ``fill=False``: at most the cap; ``fill=True``:
    closed once at least the cap (torch's DDP rule)."""
    groups: list = []
    current: list = []
    size = 0
    for i, n in enumerate(nbytes):
        cap = first_cap_bytes if first_cap_bytes is not None and not groups else cap_bytes
        if not fill and current and cap is not None and size + n > cap:
            groups.append(current)
            current, size = [], 0
        current.append(i)
        size += n
        if fill and cap is not None and size >= cap:
            groups.append(current)
            current, size = [], 0
    if current:
        groups.append(current)
    return groups


def build_buckets(params: list, names: dict, cap_bytes: int, dtype: torch.dtype,
                  first_cap_bytes: int | None = None, fill: bool = False) -> list[Bucket]:
    """Pack ``params`` (reversed) into buckets by ``cap_bytes`` (rule ``fill``; ``first_cap_bytes``: bucket 0)."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    order = list(reversed(params))
    groups = [[order[i] for i in g] for g in
              pack_by_size([p.numel() * itemsize for p in order], cap_bytes, first_cap_bytes,
                           fill)]
    buckets = []
    for i, group in enumerate(groups):
        offsets, n = [], 0
        for p in group:
            offsets.append(n)
            n += p.numel()
        buf = torch.zeros(n, dtype=dtype, device=group[0].device)
        views = [buf[o: o + p.numel()].view(p.shape) for o, p in zip(offsets, group)]
        buckets.append(Bucket(i, group, [names[p] for p in group], offsets, n, buf, views=views))
    return buckets
