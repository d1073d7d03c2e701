"""Zero-bubble schedules: the backward split into B (input gradient) and W (weight gradients).

B is on the critical path — the stage above waits for its result — and W is not: it may run
whenever the rank would otherwise idle, as long as it follows its own B (Qi et al. 2023, "Zero
Bubble Pipeline Parallelism", arXiv:2401.10241, ICLR 2024). Costs below: F, B, W each one unit.

* :func:`zb_h1` — 1F1B's order of F and B, with W ops delayed to fill the bubble (§2.1, "ZB-H1").
  Rank ``r`` runs its first ``r`` backwards as B alone and then one W per B, lagging ``r``
  behind; the remaining W close the step. Every rank holds at most ``min(P, M)`` micro-batches,
  1F1B's peak (the paper's ``p·M_B``): the last ranks hold more than in 1F1B, the first the same.
  With ``M >= P`` and equal costs the step takes ``3M + P - 1`` units, against 1F1B's
  ``3(M + P - 1)``: a third of the bubble.
* :func:`zb_v` — two chunks per rank in a V (stage ``r`` and ``2P-1-r`` on rank ``r``: the last
  stage, with the loss, is on rank 0 next to the first), §6 of arXiv:2401.10241, "ZB-V". The V
  makes the way down and back up meet on the same rank, so B of chunk 1 can start as soon as its
  F ends; W fills the rest. At most ``2P`` chunk-micro-batches (``P`` rank-shares, 1F1B's peak)
  in flight per rank.
* :func:`dualpipe_v` — DeepSeek-V3's DualPipe folded into a V (DeepSeek-AI 2024, §3.2.1; the
  "cut-in-half" DualPipeV of github.com/deepseek-ai/DualPipe): same placement as ZB-V, but in
  the steady state each rank pairs the forward of one micro-batch on one chunk with the backward
  of another on the other chunk, so one direction's compute can hide the other's communication.
  Steady-state backwards are fused; B and W are split outside it: in the warm-up (rank ``r``'s
  first ``P-1-r`` backwards of chunk 1, each W right after its B) and in the cool-down (the
  second half of the last backwards, their W deferred to fill the end), as steps 3 and 6-8 of
  ``dualpipev.py`` in github.com/deepseek-ai/DualPipe (:func:`dualpipe_v`).

ZB-H1 and ZB-V take any ``M >= 1`` (smaller ``M`` only shortens the phases); DualPipe-V needs
``M >= 2P``. With equal costs and no communication time, ZB-V and DualPipe-V take
``3M + (P-1)/2`` units: half of ZB-H1's idle time.
"""

from __future__ import annotations

from .schedules import Op, Schedule, ScheduleError, _check_args, validate

__all__ = ["zb_h1", "zb_v", "dualpipe_v"]


def zb_h1(P: int, M: int) -> Schedule:
    """ZB-H1: 1F1B's order of F and B; on rank ``r``, W of micro-batch ``k`` follows B of ``k+r``.

    Rank ``r``: ``min(P-1-r, M)`` warm-up F; then F, B pairs; after each B from the ``r+1``-th
    on, W of the oldest micro-batch still waiting; the W still waiting end the list.
    """
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
    """ZB-V: rank ``r`` holds stages ``r`` (chunk 0) and ``2P-1-r`` (chunk 1).

    Rank ``r``: ``2(P-r)-1`` forwards of chunk 0; ``r`` pairs (F chunk 1, F chunk 0); ``P-r``
    triples (F, B, W of chunk 1); then, while forwards remain, (F, B, W of chunk 0) and (F, B, W
    of chunk 1); the cool-down runs ``r`` pairs (B chunk 0, B chunk 1), ``P-r`` pairs (B, W of
    chunk 0), then the W still waiting, chunk 1 first. The counts are those of a pipeline of
    ``max(M, 2P-1)`` micro-batches; with fewer, the ops of the missing ones are left out (the
    phases shrink, the order stays valid).
    """
    _check_args("zb-v", P, M)
    n = max(M, 2 * P - 1)
    ops = tuple(tuple(op for op in _zb_v_row(P, n, r) if op.mb < M) for r in range(P))
    return validate(Schedule("zb-v", P, M, 2, ops, placement="v"))


def _zb_v_row(P: int, n: int, r: int) -> list[Op]:
    """Rank ``r``'s ZB-V list for ``n >= 2P-1`` micro-batches (see :func:`zb_v`)."""
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

    DualPipe (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", §3.2.1) feeds micro-batches into
    both ends of the pipeline, so every rank always has a forward of one direction and a backward
    of the other to run together: one's compute hides the other's communication (on a GPU the
    pair really overlaps; this engine runs it as F then B). Folded into a V (stage ``r`` and
    ``2P-1-r`` on rank ``r``) the two directions are the two chunks — chunk 0 flows down, chunk 1
    flows back up — and the model is stored once. Rank ``r``, with ``c0 = r``, ``c1 = 2P-1-r``:

    1. ``2(P-1-r)`` F(c0);  2. ``r+1`` × [F(c0), F(c1)];
    3. ``P-1-r`` × [B(c1), W(c1), F(c1)]  (split: the gradient goes up at once);
    4. ``M-2P+r+1`` × [F(c0), B(c1)], [F(c1), B(c0)]  (pairs; fused backwards);
    5. ``P-1-r`` × [B(c1)], [F(c1), B(c0)];
    6. ``r+1`` × [B(c1), B(c0)], the second half split into B and W (odd ranks switch one op
       earlier), so 7. ``P-1-r`` × [W, B(c0)] and 8. the last ``r+1`` W fill the cool-down.

    The order of torch's ``ScheduleDualPipeV`` (after github.com/deepseek-ai/DualPipe,
    ``dualpipev.py``). Needs ``M >= 2P`` (every rank's steady state needs a micro-batch per stage).
    """
    _check_args("dualpipe-v", P, M)
    if M < 2 * P:
        raise ScheduleError(f"dualpipe-v needs at least 2P micro-batches (one per stage of the V): "
                            f"got M={M} for P={P}; use M >= {2 * P}, or ZB-V (any M)")
    ops = tuple(tuple(_dualpipe_v_row(P, M, r)) for r in range(P))
    return validate(Schedule("dualpipe-v", P, M, 2, ops, placement="v"))


def _dualpipe_v_row(P: int, M: int, r: int) -> list[Op]:
    """Rank ``r``'s DualPipe-V list (phases 1-8 of :func:`dualpipe_v`)."""
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
