"""Measure the activation memory a pipeline stage holds: bytes autograd saves for backward.

``torch.autograd.graph.saved_tensors_hooks`` sees every tensor autograd saves during a forward.
We add up their bytes per micro-batch (each tensor once; parameters excluded — they are not
activations) and keep a running total per stage: +bytes at the micro-batch's forward, -bytes at
its backward (when its graph is freed). The peak of that total is the stage's saved-activation
memory. The result is exact and deterministic, on CPU and GPU alike, unlike allocator statistics.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

__all__ = ["StageActivationMeter"]


class StageActivationMeter:
    """Running saved-activation bytes per stage: ``with meter.forward(stage, mb): y = module(x)``,
    then ``meter.backward(stage, mb)`` after its backward. ``meter.peak_bytes`` = {stage: peak}."""

    def __init__(self, modules: dict[int, nn.Module]):
        self.param_storages = {p.untyped_storage().data_ptr()
                               for m in modules.values() for p in m.parameters()}
        self.live = {s: 0 for s in modules}
        self.peak_bytes = {s: 0 for s in modules}
        self.inflight = {s: 0 for s in modules}
        self.peak_inflight = {s: 0 for s in modules}
        self.per_mb: dict = {}  # (stage, mb) -> bytes

    @contextlib.contextmanager
    def forward(self, stage: int, mb: int):
        seen = set()
        total = [0]

        def pack(t: torch.Tensor):
            key = (t.data_ptr(), t.numel(), t.dtype)  # a tensor saved by two ops counts once
            if t.untyped_storage().data_ptr() not in self.param_storages and key not in seen:
                seen.add(key)
                total[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        self.per_mb[(stage, mb)] = total[0]
        self.live[stage] += total[0]
        self.inflight[stage] += 1
        self.peak_bytes[stage] = max(self.peak_bytes[stage], self.live[stage])
        self.peak_inflight[stage] = max(self.peak_inflight[stage], self.inflight[stage])

    def backward(self, stage: int, mb: int) -> None:
        self.live[stage] -= self.per_mb.pop((stage, mb))
        self.inflight[stage] -= 1
