"""Data parallelism from scratch: the same model on every rank, gradients averaged over ranks.

Three DDP versions a learner can follow, then the pieces real training needs:

* :class:`NaiveDDP` — after backward, one all-reduce per gradient (:mod:`.naive`);
* :class:`FlatDDP` — one all-reduce over all gradients packed in a flat buffer (:mod:`.flat`);
* :class:`BucketedDDP` — hooks fill buckets, all-reduced on a thread while backward continues
  (:mod:`.bucketed`); communication hooks for compression (:mod:`.compression`);
* :class:`DistributedSampler`, :func:`evaluate` (every sample counted once), :class:`SyncBatchNorm`,
  mixed precision, checkpoints, and replica checks (:mod:`.replicas`).
"""

from .base import DataParallelBase, SyncDecisionError, UnusedParametersError  # noqa: F401
from .bucketed import Bucket, BucketedDDP, build_buckets  # noqa: F401
from .checkpoint import load_checkpoint, save_checkpoint  # noqa: F401
from .compression import TopK, bf16_compress_hook, fp16_compress_hook  # noqa: F401
from .evaluate import evaluate  # noqa: F401
from .flat import FlatDDP  # noqa: F401
from .mixed_precision import MixedPrecision  # noqa: F401
from .naive import NaiveDDP  # noqa: F401
from .replicas import (ReplicaMismatchError, assert_replicas_identical,  # noqa: F401
                       broadcast_module, check_same_structure, replicas_max_difference, unwrap)
from .sampler import DistributedSampler  # noqa: F401
from .sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm  # noqa: F401

VERSIONS = {"naive": NaiveDDP, "flat": FlatDDP, "bucketed": BucketedDDP}
