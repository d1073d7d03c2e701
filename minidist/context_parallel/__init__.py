"""Context parallelism: the sequence split over ranks (long context).

``sharding`` (the splits), ``blocks`` (block attention and the log-sum-exp merge), ``ring``,
``ulysses``, ``positions``, ``loss``, ``attention`` (the GPT's attention on a CP group).
Design notes: docs/design/context_parallel.md
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
