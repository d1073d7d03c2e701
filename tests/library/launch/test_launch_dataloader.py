"""A rank may start processes of its own: ``DataLoader(..., num_workers=2)`` under ``minidist.run``.

Ranks used to be daemonic processes, and Python refuses children to those ("daemonic processes
are not allowed to have children"). Ranks are now ordinary processes that lead their own process
group, so the launcher still stops a rank's workers with the rank. Tested with ranks forked and
spawned, and with the loader's workers forked and spawned.
"""

import time

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import minidist


def _load(rank, world, worker_method):
    data = TensorDataset(torch.arange(16, dtype=torch.float32))
    loader = DataLoader(data, batch_size=4, num_workers=2, multiprocessing_context=worker_method)
    seen = torch.cat([batch for (batch,) in loader])
    total = seen.sum().reshape(1)
    dist.all_reduce(total)
    return seen.tolist(), total.item()


# ranks started with spawn (each re-imports torch: 12-19 s) are the integration tier's; the default
# tier keeps fork ranks with both kinds of loader workers
@pytest.mark.parametrize("rank_method", ["fork", pytest.param("spawn", marks=pytest.mark.exhaustive)])
@pytest.mark.parametrize("worker_method", ["fork", "spawn"])
def test_dataloader_workers_inside_a_rank(rank_method, worker_method):
    res = minidist.run(_load, 2, worker_method, start_method=rank_method, timeout=240)
    for seen, total in res:
        assert seen == list(map(float, range(16)))
        assert total == 2 * sum(range(16))


def _workers_then_fail(rank, world, pid_file):
    data = TensorDataset(torch.arange(64, dtype=torch.float32))
    loader = iter(DataLoader(data, batch_size=1, num_workers=2, persistent_workers=True))
    next(loader)
    if rank == 0:
        with open(pid_file, "w") as f:
            f.write(" ".join(str(w.pid) for w in loader._workers))
        raise RuntimeError("rank 0 fails while its loader workers are alive")
    time.sleep(60)


def test_a_failing_ranks_loader_workers_are_stopped_too(tmp_path):
    pid_file = tmp_path / "workers"
    with pytest.raises(minidist.RankError, match="rank 0 failed: RuntimeError"):
        minidist.run(_workers_then_fail, 2, str(pid_file), timeout=120)
    pids = [int(p) for p in pid_file.read_text().split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 10
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in pids if _alive(p)]
        time.sleep(0.2)
    assert not alive, f"loader workers left behind: {alive}"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
