"""Where a process's memory is accounted: its own memory cgroup, read from ``/proc/<pid>/cgroup``.

The launcher asks it how many processes the OOM killer ended there and the memory limit the ranks
share; cgroup v1 sums ``oom_kill`` over the cgroup and those below it (kernel docs:
cgroup-v1/memory.rst, cgroup-v2.rst)."""
from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["MemoryCgroup", "memory_cgroup"]

_V1_ROOT = "/sys/fs/cgroup/memory"
_V2_ROOTS = ("/sys/fs/cgroup", "/sys/fs/cgroup/unified")


@dataclass(frozen=True)
class MemoryCgroup:
    """One memory cgroup: ``version`` 1 or 2, ``path`` as /proc names it, ``dir`` under ``mount``."""
    version: int
    path: str
    dir: str
    mount: str

    def oom_kills(self) -> int | None:
        """Processes the OOM killer ended in this cgroup (v1: and below it); None if unreadable."""
        if self.version == 2:
            return _read_key(os.path.join(self.dir, "memory.events"), "oom_kill")
        total, seen = 0, False
        for folder, _, files in os.walk(self.dir):
            if "memory.oom_control" in files:
                n = _read_key(os.path.join(folder, "memory.oom_control"), "oom_kill")
                if n is not None:
                    total, seen = total + n, True
        return total if seen else None

    def limit(self) -> int | None:
        """The tightest memory limit on this cgroup and its ancestors, in bytes; None if unset."""
        name = "memory.max" if self.version == 2 else "memory.limit_in_bytes"
        best, folder = None, os.path.normpath(self.dir)
        while True:
            value = _read_int(os.path.join(folder, name))
            if value is not None and value < 1 << 60 and (best is None or value < best):
                best = value
            if folder == os.path.normpath(self.mount) or folder == os.path.dirname(folder):
                return best
            folder = os.path.dirname(folder)


def memory_cgroup(pid: int | str = "self") -> MemoryCgroup | None:
    """Process ``pid``'s memory cgroup from ``/proc/<pid>/cgroup`` if its folder exists; else None."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    v1 = v2 = None
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if "memory" in controllers.split(","):
            v1 = path
        elif controllers == "":
            v2 = path
    if v1 is not None:
        folder = os.path.join(_V1_ROOT, v1.lstrip("/"))
        if os.path.isfile(os.path.join(folder, "memory.oom_control")):
            return MemoryCgroup(1, v1, folder, _V1_ROOT)
    if v2 is not None:
        for root in _V2_ROOTS:
            folder = os.path.join(root, v2.lstrip("/"))
            if os.path.isfile(os.path.join(folder, "memory.events")):
                return MemoryCgroup(2, v2, folder, root)
    return None


def _read_key(path: str, key: str) -> int | None:
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return None


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            value = f.read().strip()
        return None if value == "max" else int(value)
    except (OSError, ValueError):
        return None
