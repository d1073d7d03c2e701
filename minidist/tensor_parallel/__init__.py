"""Tensor parallelism from scratch, Megatron-LM style (Shoeybi et al. 2019; Korthikanti et al. 2022).

Region operators (f, g, scatter, gather) in :mod:`.regions`; ColumnParallelLinear,
RowParallelLinear and VocabParallelEmbedding in :mod:`.layers`; sharding helpers in
:mod:`.sharding`; communication accounting in :mod:`.accounting`.
"""

from . import accounting, compare, layers, regions, sharding  # noqa: F401
from .layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,  # noqa: F401
                     pad_to_multiple)
from .regions import (copy_to_tensor_model_parallel_region,  # noqa: F401
                      gather_from_sequence_parallel_region,
                      gather_from_tensor_model_parallel_region,
                      reduce_from_tensor_model_parallel_region,
                      reduce_scatter_to_sequence_parallel_region,
                      scatter_to_sequence_parallel_region,
                      scatter_to_tensor_model_parallel_region)
from .sharding import gather_state_dict, gather_tensor, shard_state_dict  # noqa: F401
