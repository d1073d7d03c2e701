"""Measure the activation memory of a pipeline stage: the bytes autograd saves for backward.

``saved_tensors_hooks`` counts each saved tensor once (parameters excluded): exact, on CPU and GPU.
Design notes: docs/design/pipeline_parallel.md
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

__all__ = ["StageActivationMeter"]


class StageActivationMeter:
    """``with meter.forward(stage, mb): y = module(x)``, then ``meter.backward(stage, mb)``;
    ``meter.peak_bytes`` = {stage: peak}."""

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
