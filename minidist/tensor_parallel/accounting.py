"""Communication accounting for tensor parallelism: which collective ran in which layer and pass.

Region operators report to every open :func:`comm_log`, filed under the forward's :func:`scope`.
Design notes: docs/design/tensor_parallel.md
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

from ..comm import p2p

__all__ = ["CommEvent", "comm_log", "scope", "current_scope", "record", "collective", "summarize",
           "block_formula"]


@dataclass(frozen=True)
class CommEvent:
    """One collective run by a region operator on this rank."""

    scope: str        # layer that ran it, e.g. "block0.mlp"
    op: str           # all_reduce | all_gather | reduce_scatter
    phase: str        # forward | backward
    payload_bytes: int  # the full tensor the collective is about (all-gather: the gathered output)
    bytes_sent: int   # what this rank sent for it (p2p counters)
    start: float = field(default=0.0, compare=False, repr=False)  # perf_counter() s, when it began
    end: float = field(default=0.0, compare=False, repr=False)    # ... and when it returned


class _Local(threading.local):
    def __init__(self):
        self.scopes = []


_local = _Local()
_logs: list[list] = []


@contextlib.contextmanager
def comm_log():
    """Collect the :class:`CommEvent` of every region collective in the block (this process)."""
    log: list[CommEvent] = []
    _logs.append(log)
    try:
        yield log
    finally:
        _logs.remove(log)


@contextlib.contextmanager
def scope(name: str):
    """Name the layer running inside the block (nested scopes join with '.')."""
    _local.scopes.append(name)
    try:
        yield
    finally:
        _local.scopes.pop()


def current_scope() -> str:
    return ".".join(_local.scopes) or "-"


def record(scope_name: str, op: str, phase: str, payload_bytes: int, bytes_sent: int,
           start: float = 0.0, end: float = 0.0) -> None:
    if _logs:
        event = CommEvent(scope_name, op, phase, int(payload_bytes), int(bytes_sent), start, end)
        for log in _logs:
            log.append(event)


@contextlib.contextmanager
def collective(scope_name: str, op: str, phase: str, payload_bytes: int):
    """Time the block, count the bytes this rank sends, then :func:`record` it (to every open
    :func:`comm_log`; with none open, the block runs uncounted)."""
    if not _logs:
        yield
        return
    start = time.perf_counter()
    with p2p.count_traffic() as sent:
        yield
    record(scope_name, op, phase, payload_bytes, sent.bytes_sent, start, time.perf_counter())


def summarize(log, by=("scope", "phase", "op")) -> dict:
    """``{key: {"count", "payload_bytes", "bytes_sent"}}`` with key the tuple of the ``by`` fields."""
    out: dict = defaultdict(lambda: {"count": 0, "payload_bytes": 0, "bytes_sent": 0})
    for e in log:
        row = out[tuple(getattr(e, f) for f in by)]
        row["count"] += 1
        row["payload_bytes"] += e.payload_bytes
        row["bytes_sent"] += e.bytes_sent
    return dict(out)


def block_formula(batch: int, seq: int, hidden: int, tp: int, bytes_per_element: int = 4,
                  sequence_parallel: bool = False) -> dict:
    """Expected traffic of one transformer block per pass and rank:
    ``{"ops": {op: count}, "payload_bytes": ..., "bytes_sent": ...}``."""
    act = batch * seq * hidden * bytes_per_element
    if tp == 1:
        return {"ops": {}, "payload_bytes": 0, "bytes_sent": 0}
    if sequence_parallel:
        return {"ops": {"all_gather": 2, "reduce_scatter": 2}, "payload_bytes": 4 * act,
                "bytes_sent": 4 * act * (tp - 1) // tp}
    return {"ops": {"all_reduce": 2}, "payload_bytes": 2 * act,
            "bytes_sent": 2 * 2 * act * (tp - 1) // tp}
