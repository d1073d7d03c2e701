"""Context parallelism: the sequence split over ranks (long context).

* :mod:`.sharding` — contiguous / zigzag / striped splits, their inverse, causal work per rank,
  the per-block mask rule (full / diagonal / skipped);
* :mod:`.blocks` — one block's attention with its log-sum-exp, the stable merge, the backward;
* :mod:`.ring` — ring attention on the point-to-point layer (K/V blocks travel, hand-written
  backward), and its traffic formula;
* :mod:`.ulysses` — DeepSpeed-Ulysses: all-to-all to a head split and back;
* :mod:`.positions` — rotary / learned positions at global positions;
* :mod:`.loss` — the token-mean loss over a sharded sequence; summing replicated gradients;
* :mod:`.attention` — the GPT's attention layer on a CP group (used by :mod:`minidist.hybrid`).

What context parallelism costs (activations / cp, the ring's K/V time and overlap, the longest
context in a device) is modelled in the course kit, :mod:`minidist_course.planner.context_parallel`.
"""

from . import blocks, loss, positions, ring, sharding, ulysses  # noqa: F401
from .blocks import attention_reference, log_add_exp, merge, naive_log_add_exp  # noqa: F401
from .loss import allreduce_grads, sharded_cross_entropy  # noqa: F401
from .ring import RingAttention, ring_attention, ring_traffic  # noqa: F401
from .attention import ContextParallelSelfAttention  # noqa: F401
from .sharding import (SPLITS, block_kind, block_table, causal_work, chunks,  # noqa: F401
                       computed_work, positions as split_positions, shard, unshard)
from .ulysses import check_heads, ulysses_attention  # noqa: F401

__all__ = ["blocks", "loss", "positions", "ring", "sharding", "ulysses",
           "attention_reference", "log_add_exp", "merge", "naive_log_add_exp",
           "allreduce_grads", "sharded_cross_entropy",
           "RingAttention", "ring_attention", "ring_traffic", "ContextParallelSelfAttention",
           "SPLITS", "block_kind", "block_table", "causal_work", "chunks", "computed_work",
           "split_positions", "shard", "unshard", "check_heads", "ulysses_attention"]
