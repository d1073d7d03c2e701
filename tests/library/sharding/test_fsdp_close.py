"""``close_units``: a fully_shard model's communication thread and its group copies go when the
model is done (a process that builds model after model, as the resume matrix does, would keep
every one's gloo threads otherwise)."""

import pytest
import torch
from torch import nn

import minidist
from minidist.sharding import close_units, fully_shard

from _gloo_threads import HAVE_PROC, gloo_threads


def _build_step_close(rank, world):
    before, seen = gloo_threads(), []
    for _ in range(2):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
        fully_shard(model[0])
        fully_shard(model[2])
        fully_shard(model)
        model(torch.randn(4, 6)).sum().backward()     # the comm thread starts at the first forward
        live = gloo_threads()
        close_units(model)
        close_units(model)                            # idempotent
        seen.append((live, gloo_threads()))
    try:
        model(torch.randn(4, 6)).sum().backward()
        after_close = None
    except RuntimeError as e:
        after_close = str(e)
    return before, seen, after_close


@pytest.mark.skipif(not HAVE_PROC, reason="Linux /proc")
@pytest.mark.timeout(90)
def test_close_units_frees_the_comm_threads_groups():
    for before, seen, after_close in minidist.run(_build_step_close, 2, timeout=60):
        for live, closed in seen:
            assert live > before, (before, seen)           # the comm thread's group was live
            assert closed == before, (before, seen)        # ... and is gone, model after model
        assert after_close is not None and "close" in after_close, after_close
