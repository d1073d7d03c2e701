"""Every background thread the library starts is stopped and joined before its process group goes.

:class:`minidist.communicator.CommThread` (the one communication thread BucketedDDP, ZeRO-2 and
FSDP's prefetch use) runs collectives on a thread of its own. Each stops when its owner is closed
or garbage-collected — but an owner that is still alive when the rank ends (a model returned from the training function,
a module-level optimizer) would keep its thread inside gloo while ``destroy_process_group`` and
interpreter exit tear gloo down under it: the process then aborts with C++'s ``terminate called
without an active exception`` (SIGABRT). So every such thread is registered here with its stop
function; :func:`stop_all` stops and joins them all — the launcher calls it before destroying the
process group, and it runs at interpreter exit (``atexit``) for scripts.
"""

from __future__ import annotations

import atexit
import threading
import time
from collections.abc import Callable

__all__ = ["register", "stop_all", "live"]

_LOCK = threading.Lock()
_LIVE: list[tuple[threading.Thread, Callable[[], object]]] = []


def register(thread: threading.Thread, stop: Callable[[], object]) -> None:
    """Track ``thread``; ``stop()`` (idempotent, e.g. a ``weakref.finalize``) asks it to end."""
    with _LOCK:
        _LIVE[:] = [(t, s) for t, s in _LIVE if t.is_alive()]
        _LIVE.append((thread, stop))


def live() -> list[str]:
    """Names of the registered threads still running."""
    with _LOCK:
        return [t.name for t, _ in _LIVE if t.is_alive()]


def stop_all(timeout: float = 10.0) -> list[str]:
    """Stop every registered thread and join it (each finishes the collective it is in); returns
    the names of those still alive after ``timeout`` seconds in all (empty when all stopped)."""
    with _LOCK:
        items, _LIVE[:] = list(_LIVE), []
    for _, stop in items:
        stop()
    deadline = time.monotonic() + timeout
    for t, _ in items:
        t.join(max(0.0, deadline - time.monotonic()))
    return [t.name for t, _ in items if t.is_alive()]


atexit.register(stop_all)
