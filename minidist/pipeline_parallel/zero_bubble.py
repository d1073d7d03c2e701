"""Zero-bubble schedules: the backward split into B (input gradient) and W (weight gradients).

ZB-H1 and ZB-V (Qi et al. 2023, arXiv:2401.10241) and DualPipe-V (DeepSeek-AI 2024, §3.2.1).
Design notes: docs/design/pipeline_parallel.md
"""

from __future__ import annotations

from .schedules import Op, Schedule, ScheduleError, _check_args, validate

__all__ = ["zb_h1", "zb_v", "dualpipe_v"]


def zb_h1(P: int, M: int) -> Schedule:
    """ZB-H1: 1F1B's order of F and B; on rank ``r``, W of micro-batch ``k`` follows B of ``k+r``."""
    _check_args("zb-h1", P, M)
    ops = []
    for r in range(P):
        warmup = min(P - 1 - r, M)
        row = [Op("F", m, r) for m in range(warmup)]
        for b in range(M):  # 1F1B: the steady state's F before each B, then the cool-down's B
            if warmup + b < M:
                row.append(Op("F", warmup + b, r))
            row.append(Op("B", b, r))
            if b >= r:  # W lags its B by r backwards: they fill the gaps the B ops leave
                row.append(Op("W", b - r, r))
        row += [Op("W", m, r) for m in range(max(M - r, 0), M)]
        ops.append(tuple(row))
    return validate(Schedule("zb-h1", P, M, 1, tuple(ops)))


def zb_v(P: int, M: int) -> Schedule:
    """ZB-V: rank ``r`` holds stages ``r`` (chunk 0) and ``2P-1-r`` (chunk 1); any M >= 1."""
    _check_args("zb-v", P, M)
    n = max(M, 2 * P - 1)
    ops = tuple(tuple(op for op in _zb_v_row(P, n, r) if op.mb < M) for r in range(P))
    return validate(Schedule("zb-v", P, M, 2, ops, placement="v"))


def _zb_v_row(P: int, n: int, r: int) -> list[Op]:
    c0, c1 = r, 2 * P - 1 - r
    nxt = {("F", c0): 0, ("F", c1): 0, ("B", c0): 0, ("B", c1): 0, ("W", c0): 0, ("W", c1): 0}
    row = []

    def put(kind, stage):
        row.append(Op(kind, nxt[(kind, stage)], stage))
        nxt[(kind, stage)] += 1

    for _ in range(2 * (P - r) - 1):
        put("F", c0)
    for _ in range(r):
        put("F", c1)
        put("F", c0)
    for _ in range(P - r):
        put("F", c1), put("B", c1), put("W", c1)
    while nxt[("F", c1)] < nxt[("F", c0)] or nxt[("F", c0)] < n:
        if nxt[("F", c0)] < n:
            put("F", c0)
        put("B", c0), put("W", c0)
        put("F", c1), put("B", c1), put("W", c1)
    for _ in range(r):
        put("B", c0), put("B", c1)
    for _ in range(P - r):
        put("B", c0), put("W", c0)
    while nxt[("W", c1)] < nxt[("B", c1)]:
        put("W", c1)
    while nxt[("W", c0)] < nxt[("B", c0)]:
        put("W", c0)
    return row


def dualpipe_v(P: int, M: int) -> Schedule:
    """DualPipe-V: ZB-V's placement; steady-state pairs (F of one chunk, whole B of the other).
    Needs ``M >= 2P`` (the order of torch's ``ScheduleDualPipeV``)."""
    _check_args("dualpipe-v", P, M)
    if M < 2 * P:
        raise ScheduleError(f"dualpipe-v needs at least 2P micro-batches (one per stage of the V): "
                            f"got M={M} for P={P}; use M >= {2 * P}, or ZB-V (any M)")
    ops = tuple(tuple(_dualpipe_v_row(P, M, r)) for r in range(P))
    return validate(Schedule("dualpipe-v", P, M, 2, ops, placement="v"))


def _dualpipe_v_row(P: int, M: int, r: int) -> list[Op]:
    """Rank ``r``'s DualPipe-V list (phases 1-8 in the design notes)."""
    c0, c1 = r, 2 * P - 1 - r
    count: dict = {}
    row: list[Op] = []
    pending_w: list[Op] = []

    def put(kind, stage, split=False):
        m = count.get((kind, stage), 0)
        count[(kind, stage)] = m + 1
        row.append(Op(kind, m, stage))
        if split:
            pending_w.append(Op("W", m, stage))

    def weight():
        if pending_w:
            row.append(pending_w.pop(0))

    for _ in range(2 * (P - 1 - r)):
        put("F", c0)
    for _ in range(r + 1):
        put("F", c0), put("F", c1)
    for _ in range(P - 1 - r):
        put("B", c1, split=True), weight(), put("F", c1)
    for _ in range(M - 2 * P + r + 1):
        put("F", c0), put("B", c1)
        put("F", c1), put("B", c0)
    for _ in range(P - 1 - r):
        put("B", c1)
        put("F", c1), put("B", c0)
    split = False
    for i in range(r + 1):
        split = split or (i == (r + 1) // 2 and r % 2 == 1)
        put("B", c1, split)
        split = split or (i == (r + 1) // 2 and r % 2 == 0)
        put("B", c0, split)
    for _ in range(P - 1 - r):
        weight(), put("B", c0, split)
    while pending_w:
        weight()
    return row
