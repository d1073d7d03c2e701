"""The GPU code paths, tested on the CPU: device planning, start method, per-rank GPU setup (with
torch.cuda faked), out-of-memory reporting, and tools/gpu-check.sh on a machine without a GPU.

What these tests cannot show is GPU behaviour itself; tools/gpu-check.sh checks that on a GPU.
"""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import minidist
from minidist import env
from minidist.launch import launcher as launch
from minidist.launch.errors import RankError

ROOT = Path(__file__).resolve().parents[3]
HAS_GPU = torch.cuda.is_available()


# --------------------------------------------------------------------------- device planning
@pytest.mark.parametrize("device,backend,ranks,gpus,want", [
    ("cuda", "auto", 4, 1, ("gloo", "cuda", 4)),   # the course's first rung: 4 ranks share 1 GPU
    ("cuda", "gloo", 2, 1, ("gloo", "cuda", 2)),
    ("cuda", "auto", 2, 2, ("nccl", "cuda", 1)),   # one GPU each: NCCL, as without device=
    ("cuda", "gloo", 2, 2, ("gloo", "cuda", 1)),
    ("cuda", "auto", 3, 2, ("gloo", "cuda", 2)),   # ceil(3/2) ranks on the busiest GPU
    ("cuda", "nccl", 1, 1, ("nccl", "cuda", 1)),
    ("cpu", "auto", 4, 8, ("gloo", "cpu", 1)),
    (None, "auto", 4, 0, ("gloo", "cpu", 1)),
])
def test_plan_devices(device, backend, ranks, gpus, want):
    if device is None and torch.cuda.device_count():
        pytest.skip("device=None asks the real machine")
    plan = env.plan_devices(device, backend, ranks, gpus)
    assert (plan.backend, plan.device, plan.ranks_per_gpu) == want
    assert plan.memory_fraction == (1 / want[2] if want[2] > 1 else None)


def test_plan_devices_refuses_nccl_on_a_shared_gpu():
    with pytest.raises(ValueError, match="NCCL refuses two ranks on one device") as e:
        env.plan_devices("cuda", "nccl", 2, 1)
    assert "backend='gloo'" in str(e.value)
    with pytest.raises(ValueError, match="no GPU"):
        env.plan_devices("cuda", "auto", 2, 0)
    with pytest.raises(ValueError, match="CUDA tensors only"):
        env.plan_devices("cpu", "nccl", 1, 1)
    with pytest.raises(ValueError, match="device must be"):
        env.plan_devices("tpu", "auto", 1, 1)


def test_run_checks_the_device_before_starting_ranks(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="NCCL refuses two ranks on one device"):
        minidist.run(lambda r, w: r, 2, backend="nccl", device="cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ValueError, match="device='cuda' but torch sees no GPU"):
        minidist.run(lambda r, w: r, 2, device="cuda")
    assert time.monotonic() - t0 < 5  # refused at once, no rank started


# --------------------------------------------------------------------------- start method
def test_ranks_that_touch_cuda_always_spawn(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert launch._choose_start_method("gloo", None, "cpu") == "fork"
    assert launch._choose_start_method("gloo", None, "cuda") == "spawn"
    assert launch._choose_start_method("nccl", None, "cuda") == "spawn"
    assert launch._choose_start_method("gloo", "forkserver", "cuda") == "forkserver"  # asked
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # a kernel that used CUDA
    assert launch._choose_start_method("gloo", None, "cpu") == "spawn"


_MARK = "module default"


def _where(rank, world):
    return _MARK, torch.cuda.is_initialized()


def test_a_parent_that_used_cuda_still_launches_ranks(monkeypatch):
    """A notebook cell that already used CUDA: the ranks must be spawned (a fresh interpreter,
    which does not see the parent's globals), and still run the function."""
    monkeypatch.setattr(sys.modules[__name__], "_MARK", "set in the parent")
    assert [m for m, _ in minidist.run(_where, 2)] == ["set in the parent"] * 2  # fork
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    res = minidist.run(_where, 2, timeout=120)
    assert [m for m, _ in res] == ["module default"] * 2  # spawned: a fresh interpreter


def test_the_launcher_does_not_initialise_cuda_in_the_parent():
    minidist.run(_where, 2)
    assert not torch.cuda.is_initialized()


# --------------------------------------------------------------------------- inside a rank
@pytest.fixture(autouse=True)
def _restore_device_env(monkeypatch):
    """set_device writes MINIDIST_DEVICE / MINIDIST_MEMORY_FRACTION; undo it after each test."""
    for var in ("MINIDIST_DEVICE", "MINIDIST_MEMORY_FRACTION"):
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)


class _FakeCuda:
    def __init__(self, gpus):
        self.gpus, self.current, self.fractions = gpus, None, []

    def install(self, monkeypatch):
        monkeypatch.setattr(torch.cuda, "device_count", lambda: self.gpus)
        monkeypatch.setattr(torch.cuda, "set_device", lambda d: setattr(self, "current", d))
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current.index)
        monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                            lambda f, d=None: self.fractions.append((f, d)))


@pytest.mark.parametrize("rank,world,gpus,index,fraction", [
    (3, 4, 1, 0, 0.25), (1, 2, 1, 0, 0.5), (1, 2, 2, 1, None), (2, 3, 2, 0, 0.5)])
def test_set_device_shares_the_gpu_with_a_memory_fraction(monkeypatch, rank, world, gpus, index,
                                                          fraction):
    fake = _FakeCuda(gpus)
    fake.install(monkeypatch)
    backend = env.plan_devices("cuda", "gloo", world, gpus).backend
    dev = env.set_device(backend, rank, device="cuda", local_world_size=world)
    assert dev == torch.device("cuda", index) == fake.current
    assert fake.fractions == ([] if fraction is None else [(fraction, dev)])
    assert env.device() == dev  # what the lessons ask for: the GPU, though the backend is gloo


def test_memory_fraction_option_wins(monkeypatch):
    fake = _FakeCuda(1)
    fake.install(monkeypatch)
    env.set_device("gloo", 0, device="cuda", local_world_size=4, memory_fraction=0.6)
    assert fake.fractions == [(0.6, torch.device("cuda", 0))]


def test_cpu_ranks_never_touch_cuda(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("torch.cuda called for a CPU rank")
    monkeypatch.setattr(torch.cuda, "set_device", boom)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", boom)
    assert env.set_device("gloo", 3, device="cpu", local_world_size=4) == torch.device("cpu")
    assert env.set_device("gloo", 3) == torch.device("cpu")


# --------------------------------------------------------------------------- out of memory
def _oom_rank(rank, world, shared):
    from minidist import collectives as C
    os.environ.pop("MINIDIST_MEMORY_FRACTION", None)
    if shared:
        os.environ["MINIDIST_MEMORY_FRACTION"] = str(1 / world)  # as set_device does on a GPU
    if rank == 1:
        time.sleep(0.5)  # the others are already waiting in the collective
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    C.all_reduce(torch.ones(4))


@pytest.mark.parametrize("shared", [True, False])
def test_out_of_memory_in_one_rank_is_reported_first(shared):
    with pytest.raises(RankError) as e:
        minidist.run(_oom_rank, 3, shared, timeout=60)
    text = str(e.value)
    assert text.startswith("rank 1 failed: OutOfMemoryError: CUDA out of memory"), text[:300]
    assert "--- rank 1 (root cause) ---" in text
    if shared:
        assert "it may use 33% of a GPU it shares with other ranks" in text
    else:
        assert "ran out of GPU memory: use a smaller batch" in text
    assert e.value.failures[0][0] == 1


def test_other_errors_get_no_memory_hint():
    assert env.oom_hint(RuntimeError("CUDA out of memory")) == ""
    assert "ran out of GPU memory" in env.oom_hint(torch.OutOfMemoryError("x"))


# --------------------------------------------------------------------------- the GPU check
@pytest.mark.skipif(HAS_GPU, reason="this machine has a GPU: the script would run the checks")
def test_gpu_check_says_it_needs_a_gpu_and_runs_nothing():
    p = subprocess.run(["bash", str(ROOT / "tools" / "gpu-check.sh")], cwd=ROOT, text=True,
                       capture_output=True, timeout=120,
                       env={**os.environ, "PYTHON": sys.executable})
    assert p.returncode == 0, p.stdout + p.stderr
    assert "needs a GPU" in p.stdout
    assert "nothing was run" in p.stdout
    assert not any(line.startswith(("PASS", "FAIL")) for line in p.stdout.splitlines()), p.stdout


def test_gpu_check_lists_every_check_it_would_run():
    from minidist_course.lessons import gpu_check
    names = [name for name, _ in gpu_check.CHECKS]
    for want in ("collectives", "ddp", "tp", "pp", "zero", "nccl", "memory", "bf16", "demo"):
        assert any(want in n for n in names), (want, names)
