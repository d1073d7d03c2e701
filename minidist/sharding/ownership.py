"""Which unit owns which parameter: the walk over a unit's modules (stopping at units below), its
parameter slots, and the registry refusing a parameter tied across two units.
"""

from __future__ import annotations

import weakref

from torch import nn

__all__: list[str] = []


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


def _slots(module: nn.Module, shard) -> tuple[list, list, list]:
    """(slots, params, names) of a unit; a tied parameter is one entry of ``params``."""
    slots: list = []
    params: list = []
    seen: dict = {}
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
