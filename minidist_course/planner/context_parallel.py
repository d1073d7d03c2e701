"""What context parallelism costs and buys, in formulas: activation memory per rank, the ring's
K/V traffic (α-β) and how much of it hides behind the block compute, and the longest context that
fits in a device's memory. Units: bytes, seconds, FLOP/s. The planner (``minidist plan``) and
chapter 14 use these; :mod:`.ring` is what they describe (``ring_traffic`` counts the same
messages exactly).

**Activations** (Korthikanti et al. 2022, §4, Table 2, 16-bit, scaled by ``act_bytes``/2), per
layer, with each rank holding ``s/cp`` tokens: ``(s/cp)·b·h·(10 + 24/t)`` (``34/t`` with sequence
parallelism). Ring attention never stores the ``s×s`` scores (the backward recomputes P from the
saved log-sum-exp), so the ``5as/h`` term is absent whatever the recomputation. Full
recomputation keeps the layer input, ``2·(s/cp)·b·h/t`` (``/t`` with SP) per layer, plus one
layer's full set while it is recomputed; the fp32 logits add ``4·(s/cp)·b·V/t``. Everything is
divided by ``cp``: the point of context parallelism.

**Ring traffic** per rank and layer (Liu et al. 2023 §3; Megatron-LM's CP): forward ``cp - 1``
messages of K and V, ``2·(s/cp)·b·h_kv·d/t`` elements; backward ``cp - 1`` K/V messages plus
``cp`` dK/dV accumulators (``grad_bytes`` per element). Each costs ``α + n·β``. Each step's
transfer overlaps that step's block attention: ``4·b·(h/t)·(s/cp)²/2`` FLOPs forward under a
causal mask balanced by the zigzag split (half of each block pair is skipped or masked), twice
that backward; the exposed time is ``Σ max(0, transfer - block)``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["activation_bytes", "ring_time", "RingTime", "state_bytes", "longest_context"]


def activation_bytes(layers: int, hidden: int, vocab: int, seq_len: int, cp: int = 1, tp: int = 1,
                     micro_batch: int = 1, recompute: str = "full", act_bytes: int = 2,
                     sequence_parallel: bool = True) -> float:
    """Activation bytes per rank of one micro-batch (see the module docstring)."""
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"activation_bytes: recompute must be none/selective/full, got {recompute!r}")
    sbh = seq_len / cp * micro_batch * hidden
    k = act_bytes / 2
    full_set = sbh * (34 / tp if sequence_parallel else 10 + 24 / tp) * k
    per_layer = 2 * sbh / (tp if sequence_parallel else 1) * k if recompute == "full" else full_set
    logits = 4 * seq_len / cp * micro_batch * vocab / tp
    return layers * per_layer + (full_set if recompute == "full" else 0.0) + logits


@dataclass
class RingTime:
    """Per layer and micro-batch: ``messages`` (forward, backward), ``bytes`` sent per rank,
    ``comm_s`` all transfers, ``block_s`` all block compute, ``exposed_s`` what the compute does
    not hide, ``hidden`` = 1 - exposed/comm."""
    messages: tuple
    bytes: float
    comm_s: float
    block_s: float
    exposed_s: float
    hidden: float


def ring_time(hidden: int, heads: int, seq_len: int, cp: int, alpha: float, beta: float,
              flop_rate: float, tp: int = 1, kv_heads: int | None = None, micro_batch: int = 1,
              act_bytes: int = 2, grad_bytes: int = 4) -> RingTime:
    """The ring's communication and its overlap with the block compute (module docstring)."""
    if cp == 1:
        return RingTime((0, 0), 0.0, 0.0, 0.0, 0.0, 1.0)
    kv_heads = heads if kv_heads is None else kv_heads
    elems = 2 * seq_len / cp * micro_batch * hidden / heads * kv_heads / tp
    kv_s, dkv_s = alpha + elems * act_bytes * beta, alpha + elems * grad_bytes * beta
    block_f = 4 * micro_batch * (hidden / tp) * (seq_len / cp) ** 2 / 2 / flop_rate
    block_b = 2 * block_f
    fwd_exposed = (cp - 1) * max(0.0, kv_s - block_f)
    bwd_exposed = (cp - 1) * max(0.0, kv_s + dkv_s - block_b) + max(0.0, dkv_s - block_b)
    comm = (2 * (cp - 1)) * kv_s + cp * dkv_s
    exposed = fwd_exposed + bwd_exposed
    return RingTime((cp - 1, 2 * cp - 1), elems * (2 * (cp - 1) * act_bytes + cp * grad_bytes),
                    comm, cp * (block_f + block_b), exposed, 1.0 - exposed / comm)


def state_bytes(params: float, tp: int, dp_cp: int, precision=(2, 2, 12)) -> float:
    """Weights, gradients and optimizer state per device: weights and gradients split by TP, the
    optimizer state also sharded over the DP×CP group (Megatron's distributed optimizer shards
    over data-parallel ranks *with* context parallel). ``precision``: bytes per parameter
    (weights, gradients, optimizer), default mixed precision with Adam."""
    wb, gb, ob = precision
    return params / tp * (wb + gb + ob / dp_cp)


def longest_context(layers: int, hidden: int, heads: int, vocab: int, params: float,
                    n_devices: int, device_memory: float = 80e9, step: int = 1024,
                    recompute: str = "full", reserve: float = 0.0) -> list[dict]:
    """For every ``tp · cp = n_devices`` (tp dividing ``heads``, at most 8: one node's NVLink),
    the longest sequence (a multiple of ``step`` and of ``2·cp``) whose states plus activations
    (micro-batch 1, sequence parallelism) fit in ``device_memory - reserve``. Longest first:
    ``[{"tp", "cp", "seq_len", "states", "activations"}]``."""
    out = []
    for tp in (t for t in range(1, min(8, n_devices) + 1) if n_devices % t == 0 and heads % t == 0):
        cp = n_devices // tp
        states = state_bytes(params, tp, cp)
        free = device_memory - reserve - states
        per_token = activation_bytes(layers, hidden, vocab, 1, 1, tp, recompute=recompute)
        unit = step * 2 * cp // _gcd(step, 2 * cp)
        s = int(max(0.0, free) / per_token * cp) // unit * unit
        out.append({"tp": tp, "cp": cp, "seq_len": s, "states": states,
                    "activations": activation_bytes(layers, hidden, vocab, s, cp, tp,
                                                    recompute=recompute)})
    return sorted(out, key=lambda r: -r["seq_len"])


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a
