"""Data parallelism from scratch: the same model on every rank, gradients averaged over ranks.

Three DDP versions a learner can follow, then the pieces real training needs:

* :class:`NaiveDDP` — after backward, one all-reduce per gradient (:mod:`.naive`);
* :class:`FlatDDP` — one all-reduce over all gradients packed in a flat buffer (:mod:`.flat`);
* :class:`BucketedDDP` — hooks fill buckets, all-reduced on a thread while backward continues
  (:mod:`.bucketed`); communication hooks for compression (:mod:`.compression`, PowerSGD in :mod:`.powersgd`);
* :class:`DistributedSampler`, :func:`evaluate` (every sample counted once), :class:`SyncBatchNorm`,
  mixed precision, checkpoints, and replica checks (:mod:`.replicas`);
* across slow links: :class:`PowerSGD` (:mod:`.powersgd`), :class:`DiLoCo` / local SGD (:mod:`.diloco`);
* how large a global batch still pays: the gradient noise scale (:mod:`.noise_scale`, McCandlish
  et al. 2018), estimated from per-example gradients or from each rank's local gradient norm
  against the averaged one.
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
