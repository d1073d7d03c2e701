"""Constructor arguments of the wrappers are checked on every rank before anything runs: bucket
sizes (0, negative, NaN, a string), groups (a name instead of a process group), optimizer classes.
Before: ZeRO accepted bucket_cap_mb=0 and -1, NaN gave "cannot convert float NaN to integer", a
string group gave torch's "Group dp is not registered" or "'str' object has no attribute 'size'"."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import minidist
from minidist import collectives as C
from minidist.data_parallel import BucketedDDP
from minidist.sharding import ShardedOptimizer, fsdp

CASES = {
    "ddp-cap-0": (lambda: BucketedDDP(nn.Linear(4, 4), bucket_cap_mb=0),
                  "BucketedDDP (rank {r}): bucket_cap_mb must be a positive number of MiB, got 0"),
    "ddp-cap-nan": (lambda: BucketedDDP(nn.Linear(4, 4), bucket_cap_mb=float("nan")),
                    "bucket_cap_mb must be a positive number of MiB, got nan"),
    "ddp-first-cap": (lambda: BucketedDDP(nn.Linear(4, 4), first_bucket_cap_mb=-1),
                      "first_bucket_cap_mb must be a positive number of MiB or None, got -1"),
    "ddp-cap-str": (lambda: BucketedDDP(nn.Linear(4, 4), bucket_cap_mb="25"),
                    "bucket_cap_mb must be a positive number of MiB, got '25'"),
    "zero-cap-0": (lambda: ShardedOptimizer(nn.Linear(4, 4).parameters(), torch.optim.SGD,
                                            stage=2, bucket_cap_mb=0, lr=0.1),
                   "ShardedOptimizer: bucket_cap_mb must be a positive number of MiB or None"),
    "zero-cap-neg": (lambda: ShardedOptimizer(nn.Linear(4, 4).parameters(), torch.optim.SGD,
                                              bucket_cap_mb=-1, lr=0.1),
                     "bucket_cap_mb must be a positive number of MiB or None, got -1"),
    "zero-class": (lambda: ShardedOptimizer(nn.Linear(4, 4).parameters(), "adam", lr=0.1),
                   "optimizer_class must be a torch.optim class"),
    "zero-group": (lambda: ShardedOptimizer(nn.Linear(4, 4).parameters(), torch.optim.SGD,
                                            group="dp", lr=0.1),
                   "sharding: group must be None (the world) or a process group"),
    "fsdp-group": (lambda: fsdp.fully_shard(nn.Linear(4, 4), group="world"),
                   "sharding: group must be None (the world) or a process group"),
    "ddp-group": (lambda: BucketedDDP(nn.Linear(4, 4), group="world"),
                  "data parallel: group must be None (the world) or a process group"),
    "collective-group": (lambda: C.all_reduce(torch.ones(2), group="world"),
                         "all_reduce: group must be None (the world) or a process group"),
}


def _constructors(rank, world):
    out = {}
    for name, (make, _) in CASES.items():
        try:
            made = make()
            out[name] = "accepted"
            getattr(made, "close", lambda: None)()
        except (TypeError, ValueError) as e:
            out[name] = str(e)
    probe = torch.ones(2)                         # nothing was left half-started
    C.all_reduce(probe)
    out["next call"] = probe.tolist()
    return out


@pytest.mark.timeout(60)
def test_bad_constructor_arguments_are_clear_errors_on_every_rank():
    for rank, out in enumerate(minidist.run(_constructors, 2, timeout=30)):
        for name, (_, expected) in CASES.items():
            assert expected.format(r=rank) in out[name], (rank, name, out[name])
        assert out["next call"] == [2.0, 2.0]
