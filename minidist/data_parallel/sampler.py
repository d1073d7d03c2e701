"""Which samples each rank sees: a DistributedSampler with ``set_epoch`` (failure case D4).

Every epoch the indices 0..N-1 are shuffled with a generator seeded by ``seed + epoch`` — the same
permutation on every rank, no communication — then rank r takes every W-th index starting at r.
So shards are disjoint and together cover the data; the order changes with the epoch and repeats
with the seed. Forgetting ``set_epoch`` repeats one order forever: iterating twice in the same
epoch warns.

To make every rank take the same number of steps (DDP needs it: a rank with one batch fewer would
leave the others waiting in an all-reduce), the permutation is padded by wrapping around to a
multiple of W (``drop_last=False``, so up to W-1 samples are seen twice per epoch) or truncated
(``drop_last=True``). Same indices as ``torch.utils.data.DistributedSampler``. For *evaluation*,
where duplicates change the metric, use :func:`minidist.data_parallel.evaluate` instead.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

__all__ = ["DistributedSampler"]


class DistributedSampler(Sampler[int]):
    """Indices of rank ``rank``'s shard of a dataset (or of ``range(n)`` when given an int).

    Args:
        dataset: a sized dataset, or its length.
        num_replicas, rank: default to the process group's world size and rank.
        shuffle: shuffle with ``seed + epoch``; False gives rank, rank+W, rank+2W, ...
        drop_last: drop the tail to a multiple of W instead of padding.
    """

    def __init__(self, dataset, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False):
        n = dataset if isinstance(dataset, int) else len(dataset)
        if num_replicas is None:
            num_replicas = dist.get_world_size() if dist.is_initialized() else 1
        if rank is None:
            rank = dist.get_rank() if dist.is_initialized() else 0
        if not 0 <= rank < num_replicas:
            raise ValueError(f"DistributedSampler: rank {rank} is not in 0..{num_replicas - 1}")
        self.n, self.num_replicas, self.rank = n, num_replicas, rank
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0
        if drop_last:
            self.num_samples = n // num_replicas
        else:
            self.num_samples = math.ceil(n / num_replicas)
        self.total_size = self.num_samples * num_replicas
        self._iterated_epoch = None

    def set_epoch(self, epoch: int) -> None:
        """Call before each epoch: the shuffle is seeded with ``seed + epoch``."""
        self.epoch = epoch

    def __iter__(self):
        if self.shuffle and self._iterated_epoch == self.epoch:
            warnings.warn(f"DistributedSampler (rank {self.rank}): iterated twice in epoch "
                          f"{self.epoch}: the same order again. Call set_epoch(epoch) before each "
                          "epoch.", stacklevel=2)
        self._iterated_epoch = self.epoch
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            indices = torch.randperm(self.n, generator=g).tolist()
        else:
            indices = list(range(self.n))
        if self.drop_last:
            indices = indices[: self.total_size]
        elif self.total_size > len(indices) and indices:
            pad = self.total_size - len(indices)
            indices += (indices * math.ceil(pad / len(indices)))[:pad]
        return iter(indices[self.rank: self.total_size: self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples
