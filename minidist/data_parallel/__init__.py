"""Data parallelism from scratch: the same model on every rank, gradients averaged over ranks.

Three DDP versions — :class:`NaiveDDP`, :class:`FlatDDP`, :class:`BucketedDDP` (with
communication hooks) — then what training needs: sampler, evaluation, SyncBatchNorm, mixed
precision, checkpoints, replica checks, DiLoCo, the gradient noise scale.
Design notes: docs/design/data_parallel.md
"""

from .base import DataParallelBase, SyncDecisionError, UnusedParametersError
from .bucketed import Bucket, BucketedDDP, build_buckets
from .clip import clip_by_global_norm_
from .checkpoint import load_checkpoint, save_checkpoint
from .compression import TopK, bf16_compress_hook, fp16_compress_hook
from .diloco import DiLoCo
from .evaluate import evaluate
from .flat import FlatDDP
from .mixed_precision import MixedPrecision
from .naive import NaiveDDP
from .noise_scale import NoiseScale
from .powersgd import PowerSGD, orthogonalize_
from .replicas import (ReplicaMismatchError, assert_replicas_identical,
                       broadcast_module, check_same_structure, replicas_max_difference, unwrap)
from .sampler import DistributedSampler
from .sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm

VERSIONS = {"naive": NaiveDDP, "flat": FlatDDP, "bucketed": BucketedDDP}

__all__ = ["DataParallelBase", "SyncDecisionError", "UnusedParametersError", "Bucket",
           "BucketedDDP", "build_buckets", "clip_by_global_norm_", "load_checkpoint", "save_checkpoint", "TopK",
           "bf16_compress_hook", "fp16_compress_hook", "DiLoCo", "evaluate", "FlatDDP", "MixedPrecision",
           "NaiveDDP", "NoiseScale", "PowerSGD", "orthogonalize_", "ReplicaMismatchError", "assert_replicas_identical", "broadcast_module",
           "check_same_structure", "replicas_max_difference", "unwrap", "DistributedSampler",
           "SyncBatchNorm", "convert_sync_batchnorm", "VERSIONS"]
