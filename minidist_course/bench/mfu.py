"""Model FLOPs utilisation (MFU) of a GPT training step: the FLOPs the model needs per second, over
the hardware's peak (Chowdhery et al. 2022, "PaLM", §4.1 and App. B).

**Training FLOPs per step** = ``tokens · (6·N + attention)``, ``tokens = global_batch · seq_len``:

* ``6·N``: every weight a token multiplies costs 2 FLOPs forward (a multiply and an add) and 4
  backward (the gradients of the input and of the weight): Kaplan et al. 2020, "Scaling Laws for
  Neural Language Models", §2.1 and Table 1. ``N`` counts the weights of the matmuls a token goes
  through: ``12·h²`` per block (QKV 3h², output projection h², MLP 8h²: Kaplan's
  ``2·d_model·n_layer·(2·d_attn + d_ff)``) and the output head ``V·h`` (Kaplan's "de-embed", which
  a tiny model cannot ignore). Not counted: the token and position embeddings (lookups, no
  FLOPs), biases and LayerNorms (element-wise, O(h) per token). A tied head is counted once, as
  the head.
* attention: the context-dependent matmuls ``QKᵀ`` and ``softmax · V``, ``4·L·s·h`` forward per
  token, ``12·L·s·h`` for training — PaLM App. B's ``12·L·H·Q·T`` with ``H·Q = h`` and
  ``T = s`` (:func:`minidist_course.planner.cost.attention_flops_per_token`, convention ``"palm"``; Kaplan's Table 1
  counts ``QKᵀ`` only). The causal mask is ignored, as PaLM does.

This is the same count :func:`minidist_course.planner.predict` turns into compute time (forward
``24bsh² + 4bs²h`` per layer and ``2bshV`` for the logits, backward twice that): MFU counts no
recomputation and no communication — those are what lowers it.

**MFU** = ``flops_per_step / step_seconds / peak`` (:func:`minidist_course.planner.cost.mfu`). On this CPU
machine the peak is the *measured* single-thread matmul rate (``minidist bench flops``, one rank
of :func:`minidist.run` uses one thread) × ``min(ranks, cores)``: ranks beyond the core count
share the cores and add no FLOP/s. It is a measured ceiling, not a vendor's spec sheet number.
"""

from __future__ import annotations

import os

from ..planner.cost import attention_flops_per_token, mfu as _mfu

__all__ = ["matmul_params", "model_flops_per_token", "model_flops_per_step", "cpu_peak_flops", "mfu"]


def matmul_params(cfg) -> int:
    """``N`` of 6·N: ``n_layer·12·h² + vocab·h`` for a GPTConfig (see the module docstring)."""
    return cfg.n_layer * 12 * cfg.n_embd ** 2 + cfg.vocab_size * cfg.n_embd


def model_flops_per_token(cfg, seq_len: int | None = None) -> float:
    """Training FLOPs per token: ``6·N + 12·L·s·h`` (``s``: ``seq_len``, default ``block_size``)."""
    s = seq_len or cfg.block_size
    return 6 * matmul_params(cfg) + attention_flops_per_token(cfg.n_layer, s, cfg.n_embd, "palm")


def model_flops_per_step(cfg, global_batch: int, seq_len: int | None = None) -> float:
    """Training FLOPs of one step on ``global_batch`` sequences of ``seq_len`` tokens."""
    if global_batch < 1:
        raise ValueError(f"model_flops_per_step: global_batch must be >= 1, got {global_batch}")
    s = seq_len or cfg.block_size
    return global_batch * s * model_flops_per_token(cfg, s)


def cpu_peak_flops(flop_rate_one_thread: float, ranks: int, cores: int | None = None) -> float:
    """This machine's peak for ``ranks`` processes: the measured one-thread rate (FLOP/s) ×
    ``min(ranks, cores)`` (``cores`` default: the CPUs this process may run on)."""
    if not flop_rate_one_thread > 0 or ranks < 1:
        raise ValueError(f"cpu_peak_flops: need a positive FLOP rate and ranks >= 1, got "
                         f"{flop_rate_one_thread} and {ranks}")
    cores = cores or len(os.sched_getaffinity(0))
    return flop_rate_one_thread * min(ranks, cores)


def mfu(cfg, global_batch: int, step_seconds: float, peak_flops: float,
        seq_len: int | None = None) -> float:
    """Model FLOPs utilisation of a step of ``step_seconds`` (a fraction; 0.4 = 40%)."""
    s = seq_len or cfg.block_size
    tokens_per_s = global_batch * s / step_seconds
    return _mfu(tokens_per_s, model_flops_per_token(cfg, s), peak_flops)
