"""A rank killed mid-step (SIGKILL: no Python error, no goodbye) ends the run quickly, for every
strategy: the launcher names the dead rank first, stops the others (which are waiting for it inside
a collective) and leaves no process behind (conftest checks for orphans after every test).

Measured here on 2 shared cores: the RankError arrives in about 1-3 s after the kill; the test
allows 20 s (the launcher's promise is "within seconds"; the process-group timeout is minutes).
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

import minidist
from minidist import collectives as C
from _ckpt_kinds import KINDS

STRATEGIES = ["collectives", "ddp", "zero3-sharded", "3d"]   # 3d here: a 2-stage pipeline


def _killed_mid_step(rank, world, strategy, victim):
    if strategy == "collectives":
        for step in range(50):
            if rank == victim and step == 3:
                os.kill(os.getpid(), signal.SIGKILL)
            C.all_reduce(torch.ones(1000))
        return None
    setup = KINDS[strategy][0]
    _, _, more = setup(rank, world, 0, 1)
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)     # between steps: the others are inside step 2
    more(5)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_rank_killed_mid_step_is_named_first_and_the_run_ends(strategy):
    t0 = time.monotonic()
    with pytest.raises(minidist.RankError) as info:
        minidist.run(_killed_mid_step, 2, strategy, 1, timeout=60)
    took = time.monotonic() - t0
    first = str(info.value).splitlines()[0]
    from minidist.launch import errors as launch_errors
    if launch_errors.oom_kill_count() is None:   # no counter here: the fallback with the RSS
        assert first.startswith("rank 1 failed: rank 1 killed by SIGKILL: maybe out of memory"), first
    else:
        assert first == "rank 1 failed: rank 1 killed by SIGKILL", first
    assert took < 20, f"{strategy}: {took:.1f} s until the dead rank was reported"


def _killed(rank, world):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    C.all_reduce(torch.ones(10))


@pytest.mark.timeout(60)
def test_a_rank_the_oom_killer_ended_is_reported_as_out_of_memory(monkeypatch):
    """The cgroup's oom_kill counter rising during the run turns 'killed by SIGKILL' into 'out of
    memory' with what to try (the counter is faked here: really exhausting memory would hurt the
    other users of this machine); without the rise it stays a plain SIGKILL."""
    from minidist.launch import errors as launch_errors
    counts = iter([0, 1])
    monkeypatch.setattr(launch_errors, "oom_kill_count", lambda: next(counts))
    with pytest.raises(minidist.RankError) as info:
        minidist.run(_killed, 2, timeout=30)
    first = str(info.value).splitlines()[0]
    assert first.startswith("rank 1 failed: rank 1 killed by SIGKILL: out of memory: the "
                            "kernel's OOM killer ended it"), first
    assert "smaller batch" in first and "minidist plan" in first
    monkeypatch.setattr(launch_errors, "oom_kill_count", lambda: 3)
    with pytest.raises(minidist.RankError) as info:
        minidist.run(_killed, 2, timeout=30)
    assert str(info.value).splitlines()[0] == "rank 1 failed: rank 1 killed by SIGKILL"
    monkeypatch.undo()
    count = launch_errors.oom_kill_count()       # this machine's real counter, where readable
    assert count is None or count >= 0


def _grow_then_killed(rank, world):
    if rank == 1:
        hog = torch.ones(64 * 2**20)               # 256 MiB, touched
        time.sleep(1.0)                            # the launcher samples every 0.1 s
        assert hog[-1] == 1
        os.kill(os.getpid(), signal.SIGKILL)
    C.all_reduce(torch.ones(10))


@pytest.mark.timeout(60)
def test_without_the_oom_counter_a_sigkill_reports_the_ranks_last_resident_size(monkeypatch):
    """Where the cgroup's oom_kill counter cannot be read (containers without cgroup files, this
    machine), a SIGKILLed rank is reported with its last resident size sampled by the launcher,
    its share of the memory limit, and what to try."""
    import re
    from minidist.launch import errors as launch_errors
    monkeypatch.setattr(launch_errors, "oom_kill_count", lambda: None)
    with pytest.raises(minidist.RankError) as info:
        minidist.run(_grow_then_killed, 2, timeout=30)
    first = str(info.value).splitlines()[0]
    assert first.startswith("rank 1 failed: rank 1 killed by SIGKILL: maybe out of memory"), first
    size = float(re.search(r"sampled by the launcher, was ([\d.]+) GiB", first)[1])
    assert 0.25 <= size < 4, first            # the 256 MiB tensor plus the interpreter and torch
    assert "smaller batch" in first and "minidist plan" in first
    limit = launch_errors.memory_limit()
    if limit:
        assert f"of {limit[0] / 2**30:.2f} GiB ({limit[1]})" in first, first
    assert launch_errors.describe_exit(-signal.SIGKILL, None, None).count("not sampled") == 1


def _uneven_steps(rank, world):
    for _ in range(3 if rank == 0 else 1):    # rank 1's data ran out after one step
        C.all_reduce(torch.ones(4))
    return rank


@pytest.mark.timeout(60)
def test_a_rank_that_returns_early_is_named_as_the_root_cause_not_gloo():
    """Uneven inputs: rank 1 returned while rank 0 waited in its second all-reduce. The report
    names rank 1, how many collectives each finished and where rank 0 was — not only gloo's
    "connection closed by peer" blaming rank 0."""
    with pytest.raises(minidist.RankError) as e:
        minidist.run(_uneven_steps, 2, timeout=45)
    msg = str(e.value)
    assert msg.startswith("rank 1 returned from the function after 1 collective(s)"), msg
    assert "rank 0 had finished 1 collective(s) and was in: all_reduce/ring (its collective #2)" \
        in msg, msg
    assert "drop_last=True" in msg and "(a consequence: its peer had gone)" in msg
    assert e.value.rank == 1
