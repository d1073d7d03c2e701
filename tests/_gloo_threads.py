"""How many gloo groups this process holds, from the threads they run (Linux only): each gloo
group has one TCP loop thread, named ``gloo_tcp_loop``."""

from __future__ import annotations

import os

HAVE_PROC = os.path.isdir("/proc/self/task")


def gloo_threads() -> int:
    """Live ``gloo_tcp_loop`` threads of this process (a thread may end while they are listed)."""
    n = 0
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                n += f.read().strip() == "gloo_tcp_loop"
        except FileNotFoundError:
            pass
    return n
