"""Shared test fixtures: every test must leave no child process behind."""

import os
import time

import pytest


_LONG_LIVED = ("ipykernel", "resource_tracker", "forkserver")

# algorithm="auto" reads the table shipped with minidist, never a learner's measurement of their
# machine (~/.cache/minidist/alpha_beta.json): the suite's choices, traffic counts and notebook
# outputs are then the same everywhere (tests that need another table set it themselves)
os.environ.setdefault("MINIDIST_ALPHA_BETA", "default")

# Tests that need root, apt, containers or extra environments (tests/integration/), and the
# exhaustive sweeps (whose representative subsets run in the default tier), form the integration tier: bare `pytest`
# deselects them (pyproject's addopts), `pytest -m integration` runs only them.
INTEGRATION = ("docker", "frameworks", "browser", "slurm", "exhaustive")


def pytest_xdist_auto_num_workers(config):
    """How many pytest-xdist workers `-n auto` (pyproject's addopts) starts.

    The default tier runs on two workers, whole files at a time (`--dist loadfile`: a notebook's
    cells share one kernel, a file's launches share its fixtures). On 2 cores one worker leaves a
    core idle while ranks start, wait on a socket or a timeout; two fill it. More workers than two
    would oversubscribe the ranks the tests start (up to 4 each) and stretch the tests that time a
    deadlock. The integration tier runs serially: its Slurm cluster, containers and framework
    environments are shared, single resources. MINIDIST_TEST_WORKERS=N overrides (0: no workers).
    """
    if "MINIDIST_TEST_WORKERS" in os.environ:
        return int(os.environ["MINIDIST_TEST_WORKERS"])
    markexpr = config.getoption("markexpr", "") or ""
    if "integration" in markexpr and "not integration" not in markexpr:
        return 0
    return 2 if (os.cpu_count() or 1) >= 2 else 0


INTEGRATION_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "integration") + os.sep
# Notebooks whose nbval run is the integration tier's, with the reason (the default tier's 15
# minutes cannot hold them); each is still executed by `pytest -m integration`.
# The solution notebooks run under nbval in the integration tier too; the default tier runs every
# grading cell of every solution in one process (tests/course/grading/test_exercises.py).
INTEGRATION_NOTEBOOKS = {
    "08_multi_node.ipynb": "six torchrun process trees and two pods' agents, 3.5 minutes; the "
                           "default tier keeps torchrun in test_launch_isolation.py, "
                           "test_env_kubernetes.py and chapter 12",
}


# The default tier's heaviest files, slowest first (seconds of test time on two idle cores, from
# `pytest --durations=0`; re-measure when a file's cost changes much). `--dist loadfile` hands
# whole files to the two workers in collection order, so a long notebook collected last (chapter
# 12 is) runs alone at the end while the other worker idles; starting the longest first
# (longest-processing-time scheduling) fills both workers to the end. Order only, not selection.
HEAVY_FIRST: list[str] = [       # measured 2026-12-03 (1,959 tests, 1,437 s of test time)
    "course/12_capstone.ipynb",                              # 102 s
    "tests/course/grading/test_exercises.py",                # 100 s
    "course/16_fault_tolerance.ipynb",                       # 58 s
    "course/03_ring_allreduce.ipynb",                        # 57 s
    "tests/course/grading/test_exercise_rules.py",           # 55 s
    "course/05_data_parallel_in_practice.ipynb",             # 50 s
    "course/07_pipeline_parallel.ipynb",                     # 42 s
    "tests/library/hybrid/test_hybrid_equivalence.py",       # 37 s
    "course/07b_zero_bubble.ipynb",                          # 36 s
    "tests/course/test_matrix.py",                           # 34 s
    "tests/course/lessons/test_hybrid_demo.py",              # 28 s
    "tests/library/sharding/test_sharding_differential.py",  # 28 s
    "tests/library/checkpoint_io/test_checkpoint_faults.py",  # 27 s
    "course/06_tensor_parallel.ipynb",                       # 25 s
    "tests/library/launch/test_launcher.py",                 # 25 s
    "course/04b_measurement_and_large_batches.ipynb",        # ~20 s (04's second half)
]
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _file_weight(item) -> int:
    rel = os.path.relpath(str(item.path), _ROOT)
    try:
        return HEAVY_FIRST.index(rel)
    except ValueError:
        return len(HEAVY_FIRST)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_file_weight)      # stable: each file's tests keep their order
    for item in items:
        if (any(item.get_closest_marker(m) for m in INTEGRATION)
                or str(item.path).startswith(INTEGRATION_DIR)
                or (item.path.parent.name == "course" and item.path.name in INTEGRATION_NOTEBOOKS)
                or (item.path.parent.name == "solutions" and item.path.suffix == ".ipynb")):
            item.add_marker(pytest.mark.integration)


def started_again(start):
    """``start`` (nbval's kernel start) retried twice when the kernel dies before it replies:
    ipykernel binds ports jupyter_client picked a moment earlier, and under xdist another process
    (a rank's rendezvous, an outgoing connection) can take one in between (treebeardtech/nbmake#129:
    "Address already in use"; CI saw "Kernel died before replying to kernel_info" on one solution
    notebook on 2026-12-08). A fresh set of ports is an independent draw; a kernel that dies for
    another reason dies three times and still fails the test."""
    def start_again(*args, **kwargs):
        for attempt in range(3):
            try:
                return start(*args, **kwargs)
            except RuntimeError as e:
                if "Kernel died before replying" not in str(e) or attempt == 2:
                    raise
        raise AssertionError("unreachable")
    return start_again


try:
    from nbval import kernel as _nbval_kernel
    _nbval_kernel.start_new_kernel = started_again(_nbval_kernel.start_new_kernel)
except ImportError:
    pass


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            kids.append(int(entry))
    return kids


def children_of_this_process() -> list[int]:
    """Live (non-zombie) child processes of the test process."""
    return _children(os.getpid())


@pytest.fixture(autouse=True)
def no_orphans():
    """Fail a test that leaves processes behind (ranks that were not stopped)."""
    before = set(children_of_this_process())
    yield
    deadline = time.monotonic() + 5
    while True:
        left = set(children_of_this_process()) - before
        # notebook kernels and multiprocessing's helper servers outlive a test by design
        left = {p for p in left if not any(k in _cmd(p) for k in _LONG_LIVED)}
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not left, f"processes left behind: {sorted(left)}"


def _cmd(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
