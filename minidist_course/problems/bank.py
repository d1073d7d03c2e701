"""The worked problems of chapters 00, 03, 04, 07, 09 and 13: each answer computed by the planner,
the cost model or the pipeline simulator, never typed in.

Hardware numbers: H100-80GB and A100-80GB memory and dense bf16 peak from
:data:`minidist_course.planner.calc.GPUS` (NVIDIA's data sheets); one InfiniBand NDR port of
400 Gb/s (50 GB/s) per GPU, as in a DGX H100 (its data sheet). Latencies are stated as
assumptions in each question.
"""

from __future__ import annotations

import math

from minidist.pipeline_parallel.simulator import bubble_formula

from ..planner import calc, cost
from .core import Problem, register

H100, A100 = calc.GPUS["H100-80GB"], calc.GPUS["A100-80GB"]
NDR = 50e9            # bytes/s: one InfiniBand NDR 400 Gb/s port per GPU (DGX H100 data sheet)
ALPHA = 10e-6         # s per message: an assumption the questions state
DAY, HOUR = 86400.0, 3600.0
B = calc.human_bytes


def _gpus_to_hold(params: float) -> float:
    return math.ceil(calc.training_memory(params, "bf16", "adam").total / H100["memory"])


def _crossover(world: int) -> float:
    """Bytes N where a ring all-reduce's latency term equals its bandwidth term."""
    steps = 2 * (world - 1)
    return steps * ALPHA / (calc.comm_bytes_per_rank("all_reduce", 1.0, world) / NDR)


def _ddp_comm() -> float:
    return calc.comm_time("all_reduce", 2 * 1.3e9, 64, ALPHA, 1 / NDR)


def _ddp_compute() -> float:
    return calc.training_flops(1.3e9, 8 * 2048) / (H100["peak_flops"] * 0.4)


def _zero3_min_gpus() -> float:
    return next(n for n in range(1, 10_000)
                if calc.zero_memory(70e9, n, 3) <= H100["memory"] - 30e9)


_7B_FLOPS = calc.training_flops(7e9, 2e12)

register(
    Problem("00.1", "Llama-2-70B has 70 billion parameters. Trained with Adam in mixed precision, "
            "how many H100-80GB GPUs does it take just to hold its weights, gradients and "
            "optimizer state (no activations), split evenly?",
            lambda: _gpus_to_hold(70e9), "GPUs",
            lambda a: f"16 bytes per parameter (2 + 2 + 12) × 70e9 = "
                      f"{B(calc.training_memory(70e9).total)}; / 80 GB = "
                      f"{calc.training_memory(70e9).total / 80e9:.2f}, rounded up.",
            rel_tol=0.0, source="ZeRO §3.1; NVIDIA H100 data sheet"),
    Problem("00.2", "Llama-2-7B (7e9 parameters) was trained on 2 trillion tokens. How many "
            "training FLOPs is that?",
            lambda: _7B_FLOPS, "FLOPs",
            lambda a: "6 · N · D = 6 · 7e9 · 2e12 (2 for the forward, 4 for the backward).",
            source="Kaplan et al. 2020 §2.1; Touvron et al. 2023 Table 1"),
    Problem("00.3", "How many days does Problem 00.2 take on 1,024 A100-80GB GPUs at 40 % MFU?",
            lambda: calc.training_time(_7B_FLOPS, 1024, A100["peak_flops"], 0.4) / DAY, "days",
            lambda a: f"{_7B_FLOPS:.3g} FLOPs / (1024 × 312e12 FLOP/s × 0.4) = "
                      f"{a * DAY:,.0f} s.", source="NVIDIA A100 data sheet"),
    Problem("03.1", "A ring all-reduce of the fp32 gradients of a 1.3B-parameter model on 8 GPUs: "
            "how many bytes does each GPU send?",
            lambda: calc.comm_bytes_per_rank("all_reduce", 4 * 1.3e9, 8), "bytes",
            lambda a: "2 (W − 1)/W · N = 2 · 7/8 · 5.2 GB: a reduce-scatter and an all-gather, "
                      "each sending (W − 1)/W of the tensor."),
    Problem("03.2", "The same all-reduce over one InfiniBand NDR port per GPU (50 GB/s), assuming "
            "α = 10 µs per message: how many seconds?",
            lambda: calc.comm_time("all_reduce", 4 * 1.3e9, 8, ALPHA, 1 / NDR), "s",
            lambda a: f"2 (W − 1) α + 2 (W − 1)/W · N / 50 GB/s = {14 * ALPHA * 1e3:.2f} ms + "
                      f"{calc.comm_bytes_per_rank('all_reduce', 5.2e9, 8) / NDR:.3f} s: "
                      "bandwidth-bound.", source="DGX H100 data sheet"),
    Problem("03.3", "On W = 64 ranks with α = 10 µs and 50 GB/s, for which message size do the "
            "latency and bandwidth terms of a ring all-reduce cost the same?",
            lambda: _crossover(64), "bytes",
            lambda a: "2 (W − 1) α = 2 (W − 1)/W · N / B gives N = W · α · B = 64 · 10 µs · "
                      f"50 GB/s = {B(a)}: below it, latency dominates (fuse small tensors)."),
    Problem("04.1", "Data parallelism on 64 H100s for a 1.3B model with bf16 gradients: the ring "
            "all-reduce per step, at 50 GB/s and α = 10 µs, takes how many seconds?",
            _ddp_comm, "s",
            lambda a: f"2 · 63/64 · 2.6 GB / 50 GB/s + 126 · 10 µs = {a:.3f} s."),
    Problem("04.2", "Each GPU computes 8 sequences of 2,048 tokens per step at 40 % MFU. How long "
            "is its forward and backward?",
            _ddp_compute, "s",
            lambda a: f"6 · 1.3e9 · 16,384 tokens = {calc.training_flops(1.3e9, 16384):.3g} "
                      f"FLOPs / (989e12 · 0.4) = {a:.3f} s.", source="NVIDIA H100 data sheet"),
    Problem("04.3", "What fraction of the backward (two thirds of Problem 04.2) does the all-reduce "
            "of Problem 04.1 take? Below 1, bucketed DDP can hide it.",
            lambda: _ddp_comm() / (2 / 3 * _ddp_compute()), "",
            lambda a: f"{_ddp_comm():.3f} s / {2 / 3 * _ddp_compute():.3f} s: hidden, if the "
                      "buckets start early enough (chapter 04's overlap)."),
    Problem("07.1", "A pipeline of P = 8 stages runs 1F1B on M = 32 micro-batches. What fraction of "
            "the time is bubble?", lambda: bubble_formula(8, 32), "",
            lambda a: "(P − 1)/(M + P − 1) = 7/39.", source="Narayanan et al. 2021 §2.2.1"),
    Problem("07.2", "With the same P = 8, how many micro-batches keep the 1F1B bubble under 5 %?",
            lambda: next(m for m in range(1, 10_000) if bubble_formula(8, m) < 0.05),
            "micro-batches", lambda a: "(P − 1)/(M + P − 1) < 0.05 means M + P − 1 > 20 (P − 1), "
                                       f"so M > 19 · 7 = 133: M = {a:.0f}.", rel_tol=0.0),
    Problem("07.3", "Interleaved 1F1B with v = 4 chunks per GPU, P = 8, M = 32: the bubble?",
            lambda: bubble_formula(8, 32, 4), "",
            lambda a: "(P − 1)/(v · M + P − 1) = 7/135, for v times the pipeline messages.",
            source="Narayanan et al. 2021 §2.2.2"),
    Problem("09.1", "Llama-2-70B with mixed-precision Adam under ZeRO-3 on 64 GPUs: bytes of model "
            "state per GPU?", lambda: calc.zero_memory(70e9, 64, 3), "bytes",
            lambda a: f"16 Ψ / N = 16 · 70e9 / 64 = {B(a)}.", source="ZeRO §5, Figure 1"),
    Problem("09.2", "The same with ZeRO-1 (only the optimizer state sharded): bytes per GPU? Does it "
            "fit in 80 GB?", lambda: calc.zero_memory(70e9, 64, 1), "bytes",
            lambda a: f"2 Ψ + 2 Ψ + 12 Ψ / N = {B(a)}: no — the bf16 weights and gradients alone "
                      "are 280 GB.", source="ZeRO §5"),
    Problem("09.3", "Under ZeRO-3, how many GPUs at least, so that model state leaves 30 GB of "
            "each H100-80GB for activations?", _zero3_min_gpus, "GPUs",
            lambda a: f"16 · 70e9 / N ≤ 50 GB gives N ≥ 22.4: {a:.0f}.", rel_tol=0.0),
    Problem("13.1", "Train Llama-2-7B on 2T tokens in 30 days on H100s at 40 % MFU, in nodes of 8: "
            "how many GPUs?",
            lambda: cost.gpus_for_deadline(_7B_FLOPS, 30 * DAY, H100["peak_flops"], 0.4, 8),
            "GPUs", lambda a: f"{_7B_FLOPS:.3g} / (30 days · 989e12 · 0.4) = "
                              f"{_7B_FLOPS / (30 * DAY * H100['peak_flops'] * 0.4):.1f} GPUs, "
                              "rounded up to whole nodes of 8.", rel_tol=0.0),
    Problem("13.2", "At the course's illustrative 4.00 USD per H100-hour, what do the GPU-hours of "
            "Problem 13.1's FLOPs cost?",
            lambda: cost.gpu_hours(_7B_FLOPS, H100["peak_flops"], 0.4) * cost.price("H100-80GB"),
            "USD", lambda a: f"{cost.gpu_hours(_7B_FLOPS, H100['peak_flops'], 0.4):,.0f} GPU-hours "
                             "× 4.00 USD (whole nodes waiting for the deadline cost more).",
            source="minidist_course.planner.cost.PRICES (illustrative)"),
    Problem("13.3", "A checkpoint takes 60 s to write and the job fails every 4 hours on average. "
            "Young's interval between checkpoints?",
            lambda: cost.young_interval(60.0, 4 * HOUR), "s",
            lambda a: f"sqrt(2 · C · MTBF) = sqrt(2 · 60 · 14,400) = {a:.0f} s.",
            source="Young 1974"),
)
