"""Gradient compression as DDP communication hooks: each leaves the same average in
``bucket.buffer`` on every rank. fp16/bf16 all-reduce; :class:`TopK` with error feedback
(Seide et al. 2014; Stich et al. 2018).
Design notes: docs/design/data_parallel.md
"""

from __future__ import annotations

import math

import torch

__all__ = ["fp16_compress_hook", "bf16_compress_hook", "TopK", "ring_allreduce_bytes"]


def _cast_hook(dtype):
    def hook(state, bucket, comm):
        low = bucket.buffer.to(dtype).div_(comm.world_size)
        comm.all_reduce(low, "sum")
        bucket.buffer.copy_(low)
    return hook


fp16_compress_hook = _cast_hook(torch.float16)
fp16_compress_hook.__name__ = "fp16_compress_hook"
fp16_compress_hook.__doc__ = "All-reduce the bucket in fp16 (half the bytes); the result is fp32."
bf16_compress_hook = _cast_hook(torch.bfloat16)
bf16_compress_hook.__name__ = "bf16_compress_hook"
bf16_compress_hook.__doc__ = "All-reduce the bucket in bf16 (half the bytes); the result is fp32."


class TopK:
    """Top-k sparsification with error feedback: ``model.register_comm_hook(TopK(0.01), TopK.hook)``.
    ``ratio``: share of each bucket sent (0 < ratio ≤ 1, k = ceil(ratio·N)); ``error_feedback``:
    keep what was not sent for the next step."""

    def __init__(self, ratio: float = 0.01, error_feedback: bool = True):
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"TopK: ratio must be in (0, 1], got {ratio}")
        self.ratio, self.error_feedback = ratio, error_feedback
        self.errors: dict[int, torch.Tensor] = {}

    checkpoint_scope = "per_rank"           # what this rank has not sent yet (minidist.state)

    def state_dict(self) -> dict:
        """This rank's error feedback per bucket (and the settings, checked on load)."""
        return {"ratio": self.ratio, "error_feedback": self.error_feedback,
                "errors": {b: e.clone() for b, e in self.errors.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; ``ValueError`` if it was saved with another ratio."""
        if (state["ratio"], state["error_feedback"]) != (self.ratio, self.error_feedback):
            raise ValueError(f"TopK.load_state_dict: saved with ratio={state['ratio']}, "
                             f"error_feedback={state['error_feedback']}; this one has "
                             f"ratio={self.ratio}, error_feedback={self.error_feedback}")
        self.errors = {int(b): e.clone() for b, e in state["errors"].items()}

    @staticmethod
    def hook(state: "TopK", bucket, comm) -> None:
        buf = bucket.buffer
        acc = buf + state.errors[bucket.index] if bucket.index in state.errors else buf.clone()
        k = max(1, math.ceil(state.ratio * acc.numel()))
        idx = acc.abs().topk(k, sorted=False).indices
        vals = acc[idx]
        if state.error_feedback:
            acc[idx] = 0.0
            state.errors[bucket.index] = acc  # what this rank did not send yet
        all_vals = comm.all_gather(vals.new_empty((comm.world_size, k)), vals)
        all_idx = comm.all_gather(idx.new_empty((comm.world_size, k)), idx)
        dense = torch.zeros_like(buf)
        dense.index_add_(0, all_idx.reshape(-1), all_vals.reshape(-1))
        buf.copy_(dense.div_(comm.world_size))

    def residual(self) -> float:
        """Sum of |error| over buckets (what is still waiting to be sent)."""
        return float(sum(e.abs().sum() for e in self.errors.values()))


def ring_allreduce_bytes(numel: int, world_size: int, itemsize: int = 4) -> float:
    """Bytes one rank sends in a ring all-reduce of ``numel`` elements: 2(W-1)/W · numel · size."""
    return 2 * (world_size - 1) / world_size * numel * itemsize
