"""A hook at the start of a wrapper's backward, in the backward that will produce its gradients.

A data-parallel wrapper must learn when "its" backward starts, to queue the callback that ends it
(wait for every bucket) on the engine's graph task that produces its gradients. Starting from the
first parameter's gradient hook is wrong under ``torch.utils.checkpoint(..., use_reentrant=True)``:
the checkpointed block's gradients come from a *nested* backward (``torch.autograd.backward``
called inside ``CheckpointFunction.backward``), so a callback queued there runs when the nested
backward ends — before the parameters outside the block have their gradients.

:func:`sink` puts an identity autograd function on the forward's outputs: its backward runs first,
on the graph task of the user's ``loss.backward()``, and calls ``on_backward`` there, where the
wrapper queues its end-of-backward callback. A graph task through the outputs may produce no
parameter gradient at all (``torch.autograd.grad`` of an input, a pipeline's input-gradient
pass): the callback then has nothing to end. Source: torch's ``_DDPSink``
(torch/nn/parallel/distributed.py), which does the same for DDP's ``static_graph``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["sink", "in_nested_backward"]


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
    """``output`` (a tensor, or lists, tuples, dicts of them) with every tensor that requires a
    gradient passed through one identity node whose backward calls ``on_backward()`` first; the
    rest unchanged. Outside grad mode, or with no such tensor, ``output`` itself."""
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
    """In an engine callback: True when the graph task ending is a nested one (a reentrant
    checkpoint's), whose enclosing backward is still running (its node is the current one)."""
    return torch._C._current_autograd_node() is not None
