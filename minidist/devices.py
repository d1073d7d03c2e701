"""Where a job's ranks compute when the user chooses the device: the pure planning behind
``minidist.run(..., device="cuda")`` and ``minidist.init(device="cuda")`` (re-exported by
:mod:`minidist.env`, the one place that picks backend and device).

Several ranks may share one GPU: each rank is its own process with its own CUDA context, gloo
carries the messages (CUDA tensors staged through pinned CPU buffers, :mod:`minidist.comm.staging`)
and each rank may use ``1 / ranks per GPU`` of the device's memory. NCCL refuses two ranks on one
device, so a plan that asks for it is an error that says so.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

__all__ = ["DevicePlan", "plan_devices", "oom_hint"]


@dataclass(frozen=True)
class DevicePlan:
    """Where a job's ranks compute and what carries their messages (see :func:`plan_devices`).

    ``ranks_per_gpu`` > 1 means ranks share a GPU: gloo moves the bytes (CUDA tensors through
    :mod:`minidist.comm.staging`) and each rank may use ``memory_fraction`` of the device.
    """

    backend: str  # "gloo" | "nccl"
    device: str  # "cpu" | "cuda"
    ranks_per_gpu: int = 1

    @property
    def memory_fraction(self) -> float | None:
        return 1.0 / self.ranks_per_gpu if self.ranks_per_gpu > 1 else None


def plan_devices(device: str | None, backend: str, local_world_size: int, gpus: int,
                 nccl_available: bool = True) -> DevicePlan:
    """Backend and device for ``local_world_size`` ranks on a node with ``gpus`` GPUs; pure.

    ``device=None``/``"auto"``: as :func:`choose_backend` (nccl and ``cuda:LOCAL_RANK`` when every
    rank can have its own GPU, else gloo on the CPU). ``device="cpu"``: gloo. ``device="cuda"``:
    every rank computes on a GPU; with fewer GPUs than ranks they share (rank i on GPU
    ``i % gpus``, ``ceil(ranks / gpus)`` per GPU) and the backend is gloo, because NCCL refuses
    two ranks on one device ("Duplicate GPU detected"; NCCL troubleshooting guide).

    Raises:
        ValueError: unknown device/backend; ``device="cuda"`` with no GPU; nccl with
            ``device="cpu"``; nccl with more ranks than GPUs.
    """
    if device in (None, "auto"):
        from .env import choose_backend  # env re-exports this module: import at call time
        chosen = choose_backend(backend, local_world_size)
        return DevicePlan(chosen, "cuda" if chosen == "nccl" else "cpu")
    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {backend!r}")
    if device == "cpu":
        if backend == "nccl":
            raise ValueError("backend 'nccl' moves CUDA tensors only; device='cpu' needs "
                             "backend='gloo' (or 'auto')")
        return DevicePlan("gloo", "cpu")
    if device != "cuda":
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if gpus < 1:
        raise ValueError("device='cuda' but torch sees no GPU (torch.cuda.device_count() == 0; "
                         "check CUDA_VISIBLE_DEVICES and the driver, e.g. with `minidist doctor`). "
                         "Use device='cpu'.")
    if backend == "nccl" and gpus < local_world_size:
        raise ValueError(
            f"backend 'nccl' with device='cuda': {local_world_size} ranks but {gpus} GPU(s). NCCL "
            "refuses two ranks on one device (each NCCL rank needs a GPU of its own), so ranks "
            "cannot share a GPU over NCCL. Use backend='gloo' (or 'auto'): every rank still "
            "computes on the GPU, gloo carries the messages.")
    if backend == "auto":
        backend = "nccl" if nccl_available and gpus >= local_world_size else "gloo"
    return DevicePlan(backend, "cuda", max(1, -(-local_world_size // gpus)))


def oom_hint(error: BaseException) -> str:
    """A sentence to append to an out-of-memory error raised inside a rank (empty for others)."""
    if not isinstance(error, getattr(torch, "OutOfMemoryError", ())):
        return ""
    frac = os.environ.get("MINIDIST_MEMORY_FRACTION")
    if frac:
        return (f" [this rank ran out of GPU memory: it may use {float(frac):.0%} of a GPU it shares "
                "with other ranks; use fewer ranks per GPU, a smaller batch, or a larger "
                "memory_fraction]")
    return " [this rank ran out of GPU memory: use a smaller batch or model]"
