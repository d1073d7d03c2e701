"""MixedPrecision's default: bf16 autocast wherever bf16 is supported, fp16 + loss scaling only on a
CUDA device without bf16 (checked by faking torch.cuda.is_bf16_supported: no GPU needed)."""

import torch

from minidist.data_parallel.mixed_precision import MixedPrecision, default_dtype


def test_cpu_default_is_bf16_without_scaling():
    mp = MixedPrecision(device="cpu")
    assert default_dtype("cpu") == torch.bfloat16 and mp.dtype == torch.bfloat16 and mp.scaler is None


def test_cuda_default_follows_bf16_support(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert default_dtype("cuda") == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert default_dtype("cuda:1") == torch.float16


def test_emulated_bf16_counts_as_unsupported(monkeypatch):
    """A V100 or T4: torch's is_bf16_supported() is True by emulation (slow); only native counts."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                        lambda including_emulation=True: including_emulation)
    assert default_dtype("cuda") == torch.float16
