"""Mixed precision for DDP: bf16 autocast, or fp16 with loss scaling where the GPU lacks bf16;
parameters and averaged gradients stay fp32 (Micikevicius et al. 2018, §3).
Design notes: docs/design/data_parallel.md
"""

from __future__ import annotations

import torch

from .. import env

__all__ = ["MixedPrecision", "default_dtype"]


def default_dtype(device: torch.device | str) -> torch.dtype:
    """bf16, except on a CUDA device without native bf16 (emulated bf16 is slow), where fp16
    (with loss scaling)."""
    device = torch.device(device)
    if device.type == "cuda":
        try:
            native = torch.cuda.is_bf16_supported(including_emulation=False)
        except TypeError:   # a torch without the argument counts no emulation
            native = torch.cuda.is_bf16_supported()
        if not native:
            return torch.float16
    return torch.bfloat16


class MixedPrecision:
    """Autocast + (for fp16) loss scaling. ``device``: default this rank's; ``dtype``: ``"auto"``
    (:func:`default_dtype`), bf16, fp16 (loss scaling), or ``None``/fp32 to disable."""

    def __init__(self, device: torch.device | str | None = None, dtype: torch.dtype | None = "auto",
                 init_scale: float = 2.0**16):
        self.device = torch.device(device) if device is not None else env.device()
        if dtype == "auto":
            dtype = default_dtype(self.device)
        if dtype not in (None, torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"MixedPrecision: dtype must be bfloat16, float16 or None, got {dtype}")
        self.dtype = None if dtype == torch.float32 else dtype
        self.scaler = (torch.amp.GradScaler(self.device.type, init_scale=init_scale)
                       if self.dtype == torch.float16 else None)

    def autocast(self):
        """Context manager for the forward pass (and the loss)."""
        return torch.autocast(self.device.type, dtype=self.dtype or torch.float32,
                              enabled=self.dtype is not None)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(self, optimizer) -> bool:
        """Unscale, step (unless a gradient is inf/NaN: then skip and lower the scale).
        Returns whether the step was taken."""
        if self.scaler is None:
            optimizer.step()
            return True
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        return self.scaler.get_scale() >= before

    checkpoint_scope = "replicated"         # the same decisions on every rank (see above)

    def state_dict(self) -> dict:
        """The dtype and, with fp16, the loss scaler's scale and growth counter."""
        return {"dtype": str(self.dtype), "scaler": (self.scaler.state_dict()
                                                     if self.scaler is not None else None)}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; ``ValueError`` when saved with another dtype."""
        if state["dtype"] != str(self.dtype):
            raise ValueError(f"MixedPrecision.load_state_dict: saved with dtype {state['dtype']}, "
                             f"this one computes in {self.dtype}")
        if self.scaler is not None and state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])

    @property
    def scale(self) -> float:
        return self.scaler.get_scale() if self.scaler is not None else 1.0
