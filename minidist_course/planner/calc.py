"""Back-of-the-envelope calculators: the memory wall, the time wall, and the cost of communication.

Units: bytes, seconds, FLOPs (floating-point operations), FLOP/s. ``GB`` means 10^9 bytes (as GPU
spec sheets use it); :func:`human_bytes` prints decimal units.

Sources:

* bytes per parameter in mixed-precision Adam training — 2 (fp16/bf16 weights) + 2 (gradients) +
  12 (fp32 master weights, Adam momentum and variance) = 16: Rajbhandari et al. 2020, "ZeRO: Memory
  Optimizations Toward Training Trillion Parameter Models", §3.1; ZeRO stages: §5, Figure 1;
* training FLOPs ≈ 6 · parameters · tokens (2 for the forward pass, 4 for the backward):
  Kaplan et al. 2020, "Scaling Laws for Neural Language Models", §2.1;
* model FLOPs utilisation (MFU): Chowdhery et al. 2022, "PaLM", Appendix B;
* the alpha-beta (latency-bandwidth) cost of collectives: Thakur, Rabenseifner & Gropp 2005,
  "Optimization of Collective Communication Operations in MPICH", §2 and §4.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["DTYPE_BYTES", "GPUS", "bytes_per_param", "weights_bytes", "Memory", "training_memory",
           "zero_memory", "training_flops", "training_time", "gpus_to_fit", "speedup",
           "scaling_efficiency", "comm_bytes_per_rank", "comm_time", "human_bytes", "human_time"]

DTYPE_BYTES = {"fp64": 8, "fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}

# memory in bytes, dense bf16/fp16 tensor-core peak in FLOP/s (vendor spec sheets, SXM parts)
GPUS = {
    "V100-32GB": {"memory": 32e9, "peak_flops": 125e12},
    "A100-80GB": {"memory": 80e9, "peak_flops": 312e12},
    "H100-80GB": {"memory": 80e9, "peak_flops": 989e12},
}


def bytes_per_param(dtype: str) -> int:
    """Bytes one parameter takes in ``dtype`` (``"fp32"``, ``"bf16"``, ``"fp16"``, ``"fp8"``, ...)."""
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPE_BYTES)}") from None


def weights_bytes(params: float, dtype: str = "fp16") -> float:
    """Bytes of the weights alone: 100e9 parameters in fp16 are 200e9 bytes (200 GB)."""
    _check_positive(params=params)
    return params * bytes_per_param(dtype)


@dataclass(frozen=True)
class Memory:
    """Training memory in bytes, by kind (activations excluded: they depend on batch and length)."""

    weights: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer

    def per_param(self, params: float) -> float:
        return self.total / params


def training_memory(params: float, dtype: str = "bf16", optimizer: str = "adam",
                    master_weights: bool | None = None) -> Memory:
    """Bytes for weights, gradients and optimizer state when training ``params`` parameters.

    ``dtype`` is the dtype of weights and gradients. With ``optimizer="adam"`` the state is two fp32
    moments (8 bytes/param), plus an fp32 master copy of the weights (4 bytes/param) when the
    weights are in 16 bits (``master_weights`` defaults to True then): mixed-precision Adam takes
    2 + 2 + 12 = 16 bytes per parameter (ZeRO, §3.1); fp32 Adam takes 4 + 4 + 8 = 16 as well.
    ``"sgd"``: no state; ``"momentum"``: one fp32 buffer (4 bytes/param).
    """
    _check_positive(params=params)
    b = bytes_per_param(dtype)
    if master_weights is None:
        master_weights = b < 4
    states = {"adam": 8, "adamw": 8, "momentum": 4, "sgd": 0}
    if optimizer not in states:
        raise ValueError(f"unknown optimizer {optimizer!r}; expected one of {sorted(states)}")
    opt = states[optimizer] + (4 if master_weights else 0)
    return Memory(weights=params * b, grads=params * b, optimizer=params * opt)


def zero_memory(params: float, world_size: int, stage: int, dtype: str = "fp16") -> float:
    """Bytes per GPU for weights + gradients + Adam state with ZeRO data parallelism (ZeRO, §5).

    Stage 0 (plain data parallelism) replicates everything: 16Ψ for mixed-precision Adam. Stage 1
    shards the optimizer state (2Ψ + 2Ψ + 12Ψ/N), stage 2 also the gradients (2Ψ + 14Ψ/N), stage 3
    also the weights (16Ψ/N). Ψ = 7.5e9, N = 64: 120, 31.4, 16.6, 1.9 GB (ZeRO, Figure 1).
    """
    _check_positive(params=params, world_size=world_size)
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    m = training_memory(params, dtype)
    n = world_size
    w, g, o = m.weights, m.grads, m.optimizer
    return [w + g + o, w + g + o / n, w + (g + o) / n, (w + g + o) / n][stage]


def training_flops(params: float, tokens: float) -> float:
    """FLOPs to train a dense transformer: ≈ 6 · params · tokens (Kaplan et al. 2020, §2.1).

    GPT-3 (175e9 parameters, 300e9 tokens): 3.15e23 FLOPs.
    """
    _check_positive(params=params, tokens=tokens)
    return 6.0 * params * tokens


def training_time(flops: float, n_gpus: int = 1, peak_flops: float = GPUS["A100-80GB"]["peak_flops"],
                  mfu: float = 0.4) -> float:
    """Seconds to do ``flops`` on ``n_gpus`` GPUs reaching ``mfu`` of their ``peak_flops`` each.

    Assumes perfect (linear) scaling: real runs lose some of it to communication and bubbles,
    which is what the measured MFU accounts for.
    """
    _check_positive(flops=flops, n_gpus=n_gpus, peak_flops=peak_flops)
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu must be in (0, 1], got {mfu!r}")
    return flops / (n_gpus * peak_flops * mfu)


def gpus_to_fit(total_bytes: float, gpu_memory: float = GPUS["A100-80GB"]["memory"],
                usable: float = 1.0) -> int:
    """Minimum number of GPUs whose memory (times ``usable``) holds ``total_bytes`` if split evenly."""
    _check_positive(gpu_memory=gpu_memory, usable=usable)
    return max(1, math.ceil(total_bytes / (gpu_memory * usable)))


def speedup(time_1: float, time_n: float) -> float:
    """How many times faster N workers are than one: T(1) / T(N)."""
    _check_positive(time_1=time_1, time_n=time_n)
    return time_1 / time_n


def scaling_efficiency(time_1: float, time_n: float, n: int) -> float:
    """Speedup divided by N: 1.0 is linear scaling; "near-linear" usually means above ~0.9."""
    _check_positive(n=n)
    return speedup(time_1, time_n) / n


# --------------------------------------------------------------------------- communication
_PHASES = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1}


def comm_bytes_per_rank(op: str, nbytes: float, world_size: int, algorithm: str = "ring") -> float:
    """Bytes one rank sends in a collective over ``nbytes`` of data (the all-reduced tensor, or the
    full gathered / scattered tensor).

    ring: all-reduce 2(W-1)/W · N; reduce-scatter and all-gather (W-1)/W · N.
    recursive_doubling (W a power of two): all-reduce log2(W) · N.
    naive (all-reduce through rank 0): rank 0 sends (W-1) · N (after receiving as much) — the
    busiest rank.
    """
    w = world_size
    _check_positive(world_size=w)
    if op not in _PHASES:
        raise ValueError(f"op must be one of {sorted(_PHASES)}, got {op!r}")
    if algorithm == "ring":
        return _PHASES[op] * (w - 1) / w * nbytes
    if algorithm == "recursive_doubling" and op == "all_reduce":
        return math.ceil(math.log2(w)) * nbytes
    if algorithm == "naive" and op == "all_reduce":
        return (w - 1) * nbytes
    raise ValueError(f"no cost formula for {op} with algorithm {algorithm!r}")


def comm_time(op: str, nbytes: float, world_size: int, alpha: float, beta: float,
              algorithm: str = "ring") -> float:
    """Alpha-beta model time (s): ``steps · alpha + bytes sent per rank · beta``.

    ``alpha``: latency per message (s); ``beta``: seconds per byte (1 / link bandwidth). Steps:
    ring all-reduce 2(W-1), ring reduce-scatter/all-gather W-1, recursive-doubling all-reduce ceil(log2 W),
    naive all-reduce 2(W-1) messages through rank 0 (Thakur et al. 2005, §4).
    """
    w = world_size
    per_rank = comm_bytes_per_rank(op, nbytes, w, algorithm)
    if algorithm == "ring":
        steps = _PHASES[op] * (w - 1)
    elif algorithm == "recursive_doubling":
        steps = math.ceil(math.log2(w)) if w > 1 else 0
    else:
        steps = 2 * (w - 1)
        per_rank = 2 * per_rank  # rank 0 receives (W-1)·N and then sends (W-1)·N, one after another
    return steps * alpha + per_rank * beta


# --------------------------------------------------------------------------- printing
def human_bytes(n: float) -> str:
    """``200000000000`` → ``'200 GB'`` (decimal units, as on GPU spec sheets)."""
    for unit, size in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def human_time(seconds: float) -> str:
    """``90000`` → ``'1.04 days'``; picks seconds, minutes, hours, days or years."""
    for unit, size in (("years", 365 * 86400), ("days", 86400), ("hours", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.3g} {unit}"
    return f"{seconds:.3g} s"


def _check_positive(**values) -> None:
    for name, v in values.items():
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
            raise ValueError(f"{name} must be a positive number, got {v!r}")
