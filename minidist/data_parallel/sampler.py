"""Which samples each rank sees: a DistributedSampler with ``set_epoch`` (without it
every epoch repeats the first epoch's order).

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
        self.position = 0  # indices of this epoch handed out so far (see state_dict)
        self._skip = 0  # set by load_state_dict: indices of the resumed epoch already seen
        if drop_last:
            self.num_samples = n // num_replicas
        else:
            self.num_samples = math.ceil(n / num_replicas)
        self.total_size = self.num_samples * num_replicas
        self._iterated_epoch = None

    def set_epoch(self, epoch: int) -> None:
        """Call before each epoch: the shuffle is seeded with ``seed + epoch``."""
        if epoch != self.epoch:
            self._skip = 0
        self.epoch = epoch

    checkpoint_scope = "per_rank"           # each rank its own position (minidist.state)

    def state_dict(self) -> dict:
        """Epoch, seed and position in the epoch: a checkpoint resumes mid-epoch with it.

        ``position`` counts the indices this sampler has handed out in the current epoch. A
        DataLoader with workers reads ahead of the training loop: there, save the position of the
        batches actually trained on instead (``state["position"] = steps * batch_size``).
        """
        return {"epoch": self.epoch, "seed": self.seed, "position": self.position,
                "num_replicas": self.num_replicas}

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict`: the next pass over epoch ``state["epoch"]`` skips the
        first ``position`` indices of this rank's shard. Raises ValueError on another world size."""
        if state["num_replicas"] != self.num_replicas:
            raise ValueError(f"DistributedSampler (rank {self.rank}): the saved state is for "
                             f"{state['num_replicas']} replicas, this sampler has {self.num_replicas}")
        self.epoch, self.seed = state["epoch"], state["seed"]
        self._skip, self.position, self._iterated_epoch = state["position"], state["position"], None

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
        start, self._skip = self._skip, 0
        self.position = start
        return self._counted(indices[self.rank: self.total_size: self.num_replicas][start:])

    def _counted(self, indices):
        for i in indices:
            self.position += 1
            yield i

    def __len__(self) -> int:
        return self.num_samples - self._skip
