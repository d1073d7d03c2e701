"""Tensor parallelism from scratch, Megatron-LM style (Shoeybi et al. 2019; Korthikanti et al. 2022).

======================  =====================================================================
module                  what it holds
======================  =====================================================================
``regions``             the region operators f, g, scatter/gather (tensor and sequence), and
                        differentiable all-reduce / all-gather / reduce-scatter along a dim
``layers``              ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
``mlp``, ``attention``  ParallelMLP, ParallelSelfAttention (heads split across ranks)
``cross_entropy``       vocab_parallel_cross_entropy (global max, padding, label smoothing)
``random``              dropout generators: same masks where replicated, different on shards
``sequence``            sequence parallelism: gradient all-reduce of sequence-sharded params
``sharding``            full weight / state dict <-> this rank's shards; parameter bytes per rank
``accounting``          which collective the region operators ran in which layer and pass
``gpt``                 TPGPT: the tiny GPT of :mod:`minidist.models.gpt`, tensor-parallel
======================  =====================================================================

Demos and the checks against the single-process model live in the course kit
(``minidist_course.references.tensor_parallel``, ``minidist_course.lessons.tensor_parallel_demo``).
Every function takes ``group=None`` (the world) or a process group, so a 3-D grid can pass its TP
group.
"""

from . import (accounting, attention, cross_entropy, gpt, layers, mlp, random,
               regions, sequence, sharding)
from .attention import ParallelSelfAttention
from .cross_entropy import vocab_parallel_cross_entropy
from .gpt import GPTStage, TPGPT, use_tracker_dropout
from .layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                     pad_to_multiple)
from .mlp import ParallelMLP
from .random import Dropout, get_rng_tracker, model_parallel_seed
from .regions import (copy_to_tensor_model_parallel_region,
                      gather_from_sequence_parallel_region,
                      gather_from_tensor_model_parallel_region,
                      reduce_from_tensor_model_parallel_region,
                      reduce_scatter_to_sequence_parallel_region,
                      scatter_to_sequence_parallel_region,
                      scatter_to_tensor_model_parallel_region)
from .sequence import allreduce_sequence_parallel_grads
from .sharding import gather_state_dict, gather_tensor, parameter_bytes, shard_state_dict

__all__ = ["accounting", "attention", "cross_entropy", "gpt", "layers", "mlp", "random", "regions",
           "sequence", "sharding", "ParallelSelfAttention", "vocab_parallel_cross_entropy",
           "GPTStage", "TPGPT", "use_tracker_dropout", "ColumnParallelLinear", "RowParallelLinear",
           "VocabParallelEmbedding", "pad_to_multiple", "ParallelMLP", "Dropout",
           "get_rng_tracker", "model_parallel_seed", "copy_to_tensor_model_parallel_region",
           "gather_from_sequence_parallel_region", "gather_from_tensor_model_parallel_region",
           "reduce_from_tensor_model_parallel_region",
           "reduce_scatter_to_sequence_parallel_region", "scatter_to_sequence_parallel_region",
           "scatter_to_tensor_model_parallel_region", "allreduce_sequence_parallel_grads",
           "gather_state_dict", "gather_tensor", "parameter_bytes", "shard_state_dict"]
