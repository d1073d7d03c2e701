"""Which samples each rank sees: indices shuffled with ``seed + epoch``, padded or truncated to a
multiple of W, every W-th from rank r — those of ``torch.utils.data.DistributedSampler``.
Design notes: docs/design/data_parallel.md
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

__all__ = ["DistributedSampler"]


class DistributedSampler(Sampler[int]):
    """Indices of rank ``rank``'s shard of ``dataset`` (sized, or its length). ``num_replicas``/``rank``
    default to the group's; ``shuffle`` with ``seed + epoch``; ``drop_last`` instead of padding."""

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
        """Epoch, seed and ``position`` (indices handed out this epoch): resumes mid-epoch. With
        read-ahead DataLoader workers save ``steps * batch_size`` as the position instead."""
        return {"epoch": self.epoch, "seed": self.seed, "position": self.position,
                "num_replicas": self.num_replicas}

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict`."""
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
