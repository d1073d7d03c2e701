"""Every background thread the library starts is stopped and joined before its process group goes.

A communication thread still inside gloo while ``destroy_process_group`` or interpreter exit tears
gloo down aborts the process (SIGABRT). Such threads register here with their stop function;
:func:`stop_all` stops and joins them (the launcher calls it, and ``atexit``)."""

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
    """Stop and join every registered thread; returns the names still alive after ``timeout`` s."""
    with _LOCK:
        items, _LIVE[:] = list(_LIVE), []
    for _, stop in items:
        stop()
    deadline = time.monotonic() + timeout
    for t, _ in items:
        t.join(max(0.0, deadline - time.monotonic()))
    return [t.name for t, _ in items if t.is_alive()]


atexit.register(stop_all)
