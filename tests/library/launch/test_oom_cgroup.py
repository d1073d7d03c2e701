"""The OOM killer's count is read from the ranks' own memory cgroup (v1: summed over the cgroup and
those below it, where v1 counts a kill only in the victim's own cgroup; v2: ``memory.events``,
which counts it in every ancestor). Reading the mount's root missed every kill in a container, a
Slurm job or a systemd scope: a rank the kernel ended for memory was reported as a plain SIGKILL."""
import os

import pytest
import torch

import minidist
from minidist import collectives as C
from minidist.launch import cgroups


def _tree(tmp_path, version):
    mount = tmp_path / "memory"
    own = mount / "job" / "step"
    child = own / "rank1"
    child.mkdir(parents=True)
    if version == 1:
        for folder, kills in ((mount, 5), (mount / "job", 0), (own, 1), (child, 2)):
            (folder / "memory.oom_control").write_text(
                f"oom_kill_disable 0\nunder_oom 0\noom_kill {kills}\n")
        (mount / "job" / "memory.limit_in_bytes").write_text(str(3 * 2**30))
        (own / "memory.limit_in_bytes").write_text(str(2**63 - 4096))   # unset: the parent's
    else:
        (own / "memory.events").write_text("low 0\nhigh 0\nmax 4\noom 3\noom_kill 3\n")
        (mount / "job" / "memory.max").write_text(str(2 * 2**30))
        (own / "memory.max").write_text("max\n")
    return cgroups.MemoryCgroup(version, "/job/step", str(own), str(mount))


@pytest.mark.parametrize("version", [1, 2])
def test_the_count_and_limit_are_the_own_cgroups_not_the_roots(tmp_path, version):
    group = _tree(tmp_path, version)
    assert group.oom_kills() == (3 if version == 1 else 3)   # v1: own 1 + child 2, not root's 5
    assert group.limit() == (3 if version == 1 else 2) * 2**30


def test_this_process_has_a_memory_cgroup_whose_counter_reads():
    group = cgroups.memory_cgroup()
    if group is None:
        pytest.skip("no memory cgroup readable on this machine")
    assert group.oom_kills() is not None and group.oom_kills() >= 0


def _hog_in(rank, world, child):
    if rank == 1:
        with open(os.path.join(child, "cgroup.procs"), "w") as fh:
            fh.write(str(os.getpid()))
        hog = torch.ones(256 * 2**20)                # 1 GiB, past the child's 320 MiB limit
        assert hog[-1] == 1
    C.all_reduce(torch.ones(10))


def _limited_child():
    """A child memory cgroup (v1) with a 320 MiB limit, or a skip where one cannot be made."""
    group = cgroups.memory_cgroup()
    if group is None or group.version != 1 or os.geteuid() != 0:
        pytest.skip("needs root and a cgroup v1 memory controller to make a limited child cgroup")
    child = os.path.join(group.dir, f"minidist-oom-{os.getpid()}")
    try:
        os.makedirs(child)
        for name in ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes"):
            if os.path.exists(os.path.join(child, name)):
                with open(os.path.join(child, name), "w") as fh:
                    fh.write(str(320 * 2**20))
    except OSError as e:
        pytest.skip(f"cannot make a limited child cgroup here: {e}")
    return child


@pytest.mark.timeout(90)
def test_a_rank_the_kernel_really_kills_for_memory_is_named_out_of_memory():
    """A real OOM kill in a 320 MiB child cgroup: the report names it, the rank and the count."""
    child = _limited_child()
    try:
        with pytest.raises(minidist.RankError) as info:
            minidist.run(_hog_in, 2, child, timeout=60)
    finally:
        os.rmdir(child)
    first = str(info.value).splitlines()[0]
    assert first.startswith("rank 1 failed: rank 1 killed by SIGKILL: out of memory: the kernel's "
                            "OOM killer ended it (the oom_kill count of cgroup "), first
    assert "rose by 1 during the run" in first and "minidist plan" in first, first
