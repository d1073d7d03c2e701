"""Tensor parallelism from scratch, Megatron-LM style (Shoeybi et al. 2019; Korthikanti et al. 2022).

One module per idea (regions f/g, layers, mlp, attention, cross_entropy, random, sequence,
sharding, accounting, gpt); every function takes ``group=None`` (the world) or a process group.
Design notes: docs/design/tensor_parallel.md
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
