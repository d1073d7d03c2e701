"""Measure what a learner's object really keeps, wherever it keeps it: the optimizer state of every
``torch.optim.Optimizer`` reachable from it (attributes, lists, dicts, nested objects), so a
"state for one slice only" rule is checked by counting bytes, not by looking at one attribute."""

from __future__ import annotations

import inspect

import torch
from torch import nn

__all__ = ["optimizer_state", "state_elements_per_element"]

_LEAVES = (int, float, str, bytes, bool, type(None), complex)


def optimizer_state(obj, max_nodes: int = 20000) -> list[tuple[str, int]]:
    """``[(path, elements)]``: for every optimizer reachable from ``obj`` (``obj`` itself included),
    the number of elements of its non-scalar state tensors (each storage counted once overall).
    ``path`` is how it was reached, e.g. ``"self.full_optimizer"``."""
    seen, seen_storage, found = set(), set(), []
    stack = [(obj, "self")]
    while stack and len(seen) < max_nodes:
        o, path = stack.pop()
        if id(o) in seen or isinstance(o, _LEAVES) or torch.is_tensor(o):
            continue
        seen.add(id(o))
        if inspect.ismodule(o) or inspect.isclass(o) or inspect.isroutine(o) or isinstance(
                o, nn.Module):
            continue
        if isinstance(o, torch.optim.Optimizer):
            n = 0
            for s in o.state.values():
                for v in (s.values() if isinstance(s, dict) else ()):
                    if torch.is_tensor(v) and v.dim() > 0:
                        key = (v.untyped_storage().data_ptr(), v.storage_offset(), v.numel())
                        if key not in seen_storage:
                            seen_storage.add(key)
                            n += v.numel()
            found.append((path, n))
        if isinstance(o, dict):
            stack += [(v, f"{path}[{k!r}]") for k, v in o.items() if not torch.is_tensor(k)]
        elif isinstance(o, (list, tuple, set, frozenset)):
            stack += [(v, f"{path}[{i}]") for i, v in enumerate(o)]
        else:
            d = getattr(o, "__dict__", None)
            if isinstance(d, dict):
                stack += [(v, f"{path}.{k}") for k, v in d.items()
                          if k not in ("state", "param_groups", "defaults")]
    return found


def state_elements_per_element(optimizer_class, **hyper) -> int:
    """How many state elements ``optimizer_class`` keeps per parameter element after one step
    (SGD+momentum: 1, Adam/AdamW: 2), measured on a small tensor."""
    p = torch.zeros(10, requires_grad=True)
    p.grad = torch.ones(10)
    opt = optimizer_class([p], **hyper)
    opt.step()
    return sum(v.numel() for s in opt.state.values() for v in s.values()
               if torch.is_tensor(v) and v.dim() > 0) // 10
