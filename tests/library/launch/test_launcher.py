"""minidist.run: results, failures, timeouts, output, notebooks, concurrency, no orphans.

The autouse fixture in conftest.py fails any test that leaves a process behind.
"""

import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

import minidist
from minidist.comm import p2p


def _whoami(rank, world, tag):
    return (tag, rank, world, dist.get_rank(), dist.get_world_size(), os.environ["LOCAL_RANK"])


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_results_come_back_indexed_by_rank(world):
    res = minidist.run(_whoami, world, "x")
    assert res == [("x", r, world, r, world, str(r)) for r in range(world)]


def _big(rank, world):
    return torch.full((4 * 1024 * 1024,), float(rank))  # 16 MB: far beyond a pipe buffer


def test_large_tensor_results_do_not_deadlock_and_outlive_the_ranks():
    res = minidist.run(_big, 2)
    time.sleep(0.2)  # the ranks are gone; shared-memory handles would be dead by now
    assert [t[-1].item() for t in res] == [0.0, 1.0] and res[1].shape == (4 * 1024 * 1024,)


def _fails(rank, world, bad_rank):
    if rank == bad_rank:
        raise ValueError(f"bad input on rank {rank}")
    dist.all_reduce(torch.zeros(4))  # the others block here until stopped
    return rank


def test_a_rank_that_raises_is_the_root_cause_and_the_others_are_stopped():
    """W=3, rank 2 raises before the first all-reduce: rank 2 is named, not a peer's secondary error."""
    t0 = time.monotonic()
    with pytest.raises(minidist.RankError) as info:
        minidist.run(_fails, 3, 2, timeout=60)
    elapsed = time.monotonic() - t0
    msg = str(info.value)
    assert info.value.rank == 2
    assert msg.startswith("rank 2 failed: ValueError: bad input on rank 2")
    assert "--- rank 2 (root cause) ---" in msg and "raise ValueError" in msg
    assert elapsed < 15, f"the launcher took {elapsed:.1f} s to notice"


def _exits(rank, world):
    if rank == 1:
        os._exit(3)
    dist.all_reduce(torch.zeros(4))


def test_a_rank_that_calls_os_exit_is_named():
    with pytest.raises(minidist.RankError, match=r"^rank 1 failed: rank 1 exited with code 3") as info:
        minidist.run(_exits, 3, timeout=60)
    assert info.value.rank == 1


def _killed(rank, world):
    import signal
    if rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.zeros(4))


def test_a_rank_killed_by_a_signal_is_named():
    with pytest.raises(minidist.RankError, match=r"^rank 0 failed: rank 0 killed by SIGKILL"):
        minidist.run(_killed, 2, timeout=60)


def _deadlock(rank, world):
    t = torch.zeros(1000)
    p2p.recv(t, (rank + 1) % world)  # everyone receives, nobody sends


def test_a_deadlock_ends_within_the_timeout_naming_the_waiting_ranks():
    t0 = time.monotonic()
    with pytest.raises(minidist.RankTimeoutError) as info:
        minidist.run(_deadlock, 3, timeout=4)
    elapsed = time.monotonic() - t0
    msg = str(info.value)
    assert elapsed < 4 + 5
    assert "timed out after 4 s; 3 of 3 ranks were still running" in msg
    for r in range(3):
        assert f"rank {r}: p2p: recv from rank {(r + 1) % 3}, 4000 bytes, seq 1 (waiting)" in msg
        # and the Python line each rank was stuck on
    assert msg.count("in _deadlock") == 3


def _blocking_send_first(rank, world):
    t = torch.zeros(4 * 1024 * 1024)
    dist.send(t, (rank + 1) % world)  # plain torch: the classic send/send deadlock
    dist.recv(t, (rank - 1) % world)


def test_a_deadlock_in_plain_torch_calls_shows_the_stuck_line():
    with pytest.raises(minidist.RankTimeoutError) as info:
        minidist.run(_blocking_send_first, 2, timeout=4)
    assert str(info.value).count("in _blocking_send_first") == 2


def _prints(rank, world):
    print(f"hello from rank {rank}")
    print(f"second line from rank {rank}")
    return rank


def test_ordered_output_is_prefixed_and_grouped_by_rank(capsys):
    minidist.run(_prints, 3, ordered_output=True)
    out = capsys.readouterr().out.splitlines()
    assert out == [line for r in range(3) for line in
                   (f"[rank {r}] hello from rank {r}", f"[rank {r}] second line from rank {r}")]


def test_spawn_start_method_runs_closures():
    offset = 10
    res = minidist.run(lambda rank, world: rank + offset, 2, start_method="spawn", timeout=120)
    assert res == [10, 11]


def test_bad_arguments_are_rejected_before_starting_anything():
    with pytest.raises(ValueError, match="world_size must be an int >= 1"):
        minidist.run(_whoami, 0)
    with pytest.raises(ValueError, match="backend must be 'auto', 'gloo' or 'nccl'"):
        minidist.run(_whoami, 2, backend="mpi")
    with pytest.raises(TypeError, match="fn must be callable"):
        minidist.run("not a function", 2)


def test_a_busy_port_29500_does_not_matter():
    """Something already listens on the default port 29500: the launcher needs no port at all."""
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", 29500))
        s.listen()
    except OSError:
        pass  # already taken by something else: even better
    try:
        assert minidist.run(_whoami, 2, "p")[1][1] == 1
    finally:
        s.close()


_SCRIPT = textwrap.dedent("""
    import sys, torch, torch.distributed as dist, minidist
    def f(rank, world):
        t = torch.ones(1000) * (rank + 1)
        for _ in range(20):
            dist.all_reduce(t)
            t /= t[0] / (rank + 1)
        return t.sum().item()
    print(minidist.run(f, 2, timeout=60))
""")


def test_two_launches_at_the_same_moment_do_not_collide():
    procs = [subprocess.Popen([sys.executable, "-c", _SCRIPT], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert out.strip() == "[1000.0, 2000.0]"


_NOTEBOOK_CELLS = [
    "import minidist, torch, torch.distributed as dist",
    # a function defined in a cell, run on forked and on spawned ranks
    "def f(rank, world):\n    t = torch.tensor([rank + 1.0])\n    dist.all_reduce(t)\n"
    "    print('rank', rank, 'sees', t.item())\n    return t.item()",
    "torch.ones(512, 512) @ torch.ones(512, 512)  # the kernel has used intra-op threads before forking",
    "assert minidist.run(f, 3, ordered_output=True) == [6.0] * 3",
    "assert minidist.run(f, 2, start_method='spawn', timeout=120) == [3.0] * 2",
    "def g(rank, world):\n    if rank == 1:\n        raise KeyError('oops')\n    dist.barrier()",
    "try:\n    minidist.run(g, 2)\nexcept minidist.RankError as e:\n    print(str(e).splitlines()[0])",
]


@pytest.mark.integration   # a kernel of its own (13-18 s); every chapter runs functions defined in
def test_functions_defined_in_a_notebook_cell_work():   # its cells under nbval in the default tier
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in _NOTEBOOK_CELLS])
    nbclient.NotebookClient(nb, timeout=180, kernel_name="python3").execute()
    outputs = ["".join(o.get("text", "") for o in c.outputs) for c in nb.cells]
    assert outputs[3] == "[rank 0] rank 0 sees 6.0\n[rank 1] rank 1 sees 6.0\n[rank 2] rank 2 sees 6.0\n"
    assert outputs[6].strip() == "rank 1 failed: KeyError: 'oops'"
