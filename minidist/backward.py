"""A hook at the start of a wrapper's backward, in the backward that will produce its gradients.

A data-parallel wrapper queues its end-of-backward callback when its backward starts; from a
parameter's gradient hook that is wrong under reentrant checkpointing (the hook runs in a nested
backward). :func:`sink` puts an identity autograd function on the forward's outputs: its backward
runs first, on the graph task of ``loss.backward()``, and calls ``on_backward`` there. After
torch's ``_DDPSink`` (torch/nn/parallel/distributed.py). :func:`weak_hook` makes a tensor hook
that does not keep its owner alive.

Design notes: docs/design/ground.md"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["sink", "in_nested_backward", "weak_hook"]


class _Sink(torch.autograd.Function):
    @staticmethod
    def forward(ctx, on_backward, *tensors):
        ctx.set_materialize_grads(False)
        ctx.on_backward = on_backward
        return tuple(t.clone() for t in tensors)   # outputs of this node, not views of inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.on_backward()
        return (None, *grads)


def sink(output: Any, on_backward: Callable[[], None]) -> Any:
    """``output``, its grad-requiring tensors passed through a node whose backward calls ``on_backward()``."""
    if not torch.is_grad_enabled():
        return output
    leaves, spec = pytree.tree_flatten(output)
    at = [i for i, t in enumerate(leaves) if torch.is_tensor(t) and t.requires_grad]
    if not at:
        return output
    passed = _Sink.apply(on_backward, *(leaves[i] for i in at))
    for i, t in zip(at, passed):
        leaves[i] = t
    return pytree.tree_unflatten(leaves, spec)


def in_nested_backward() -> bool:
    """In an engine callback: True when the ending graph task is a nested (reentrant checkpoint) one."""
    return torch._C._current_autograd_node() is not None


def weak_hook(method: Callable) -> Callable:
    """``method`` (bound) as a tensor hook that holds its object weakly; a no-op once it is gone.

    A tensor keeps its hooks on the C++ side, out of the garbage collector's sight: an object that
    holds a tensor whose hook holds the object is a cycle never collected, and with it the
    object's communication threads and process groups (a dropped ZeRO-3 model or ZeRO-2
    optimizer kept its threads: a composition matrix launch grew from 2 s to 25 s a step)."""
    ref = weakref.WeakMethod(method)

    def hook(*args):
        bound = ref()
        return None if bound is None else bound(*args)
    return hook
