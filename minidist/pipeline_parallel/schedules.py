"""Pipeline schedules as data: for every rank, the ordered list of (op, micro-batch, stage).

``P`` ranks, ``M`` micro-batches, ``v`` chunks per rank; stage ``s`` lives on rank ``s % P``
(placement ``"v"``, ZB-V and DualPipe-V: stage ``s >= P`` on rank ``2P-1-s``).
GPipe (Huang et al. 2019), 1F1B and interleaved 1F1B (Narayanan et al. 2021).
Design notes: docs/design/pipeline_parallel.md
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["Op", "Schedule", "gpipe", "one_f_one_b", "interleaved_one_f_one_b", "validate",
           "ScheduleError"]


class ScheduleError(ValueError):
    """A schedule that cannot be run (bad P/M/v, or a list that misses or repeats an op)."""


class Op(NamedTuple):
    """``kind`` "F", "B" or "W" of micro-batch ``mb`` on ``stage``; with a W for the same pair, B
    computes only the input gradient."""

    kind: str
    mb: int
    stage: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.mb}@s{self.stage}"


@dataclass(frozen=True)
class Schedule:
    """``ops[r]`` is the ordered op list of rank ``r``. ``P`` ranks, ``M`` micro-batches, ``v`` chunks."""

    name: str
    P: int
    M: int
    v: int
    ops: tuple
    placement: str = "loop"  # "loop": stage s on rank s % P; "v": chunk 1 runs back, P-1 -> 0

    @property
    def n_stages(self) -> int:
        return self.P * self.v

    def owner(self, stage: int) -> int:
        """The rank that holds ``stage``."""
        if self.placement == "v" and stage >= self.P:
            return 2 * self.P - 1 - stage
        return stage % self.P

    def stages_of(self, rank: int) -> list[int]:
        """The stages rank ``rank`` holds, chunk order."""
        if self.placement == "v":
            return [rank, 2 * self.P - 1 - rank]
        return [c * self.P + rank for c in range(self.v)]

    def split(self, rank: int) -> set:
        """(mb, stage) pairs whose backward rank ``rank`` runs as B then W (not fused)."""
        return {(op.mb, op.stage) for op in self.ops[rank] if op.kind == "W"}

    def __getitem__(self, rank: int) -> list[Op]:
        return list(self.ops[rank])

    def __repr__(self) -> str:
        rows = "\n".join(f"  rank {r}: {' '.join(map(repr, ops))}" for r, ops in enumerate(self.ops))
        where = "" if self.placement == "loop" else f", placement={self.placement}"
        return f"Schedule({self.name}, P={self.P}, M={self.M}, v={self.v}{where})\n{rows}"


def _check_args(name: str, P: int, M: int, v: int = 1) -> None:
    for key, val in (("P", P), ("M", M), ("v", v)):
        if not isinstance(val, int) or val < 1:
            raise ScheduleError(f"{name}: {key} must be an int >= 1, got {val!r}")


def gpipe(P: int, M: int) -> Schedule:
    """GPipe: every rank runs F for micro-batches 0..M-1, then B for 0..M-1. Any M >= 1 works."""
    _check_args("gpipe", P, M)
    ops = tuple(tuple([Op("F", m, r) for m in range(M)] + [Op("B", m, r) for m in range(M)])
                for r in range(P))
    return validate(Schedule("gpipe", P, M, 1, ops))


def one_f_one_b(P: int, M: int) -> Schedule:
    """1F1B: ``min(P-1-r, M)`` warm-up forwards, 1F+1B pairs, cool-down backwards; any M >= 1."""
    _check_args("1f1b", P, M)
    ops = []
    for r in range(P):
        warmup = min(P - 1 - r, M)
        row = [Op("F", m, r) for m in range(warmup)]
        for i in range(M - warmup):  # steady state: one forward, one backward
            row += [Op("F", warmup + i, r), Op("B", i, r)]
        row += [Op("B", m, r) for m in range(M - warmup, M)]  # cool-down
        ops.append(tuple(row))
    return validate(Schedule("1f1b", P, M, 1, tuple(ops)))


def interleaved_one_f_one_b(P: int, M: int, v: int = 2) -> Schedule:
    """Interleaved 1F1B with ``v`` chunks per rank (Megatron-LM's virtual pipeline).
    ``ScheduleError`` unless ``M % P == 0``."""
    _check_args("interleaved", P, M, v)
    if M % P != 0:
        raise ScheduleError(f"interleaved 1F1B needs the number of micro-batches M to be a multiple "
                            f"of the pipeline size P (micro-batches go round in groups of P): got "
                            f"M={M}, P={P}. Use M={max(P, M // P * P)} or {(M // P + 1) * P}, or "
                            f"the plain 1F1B schedule.")
    total = M * v

    def op(kind: str, k: int, r: int) -> Op:
        chunk = (k % (P * v)) // P
        if kind == "B":
            chunk = v - 1 - chunk
        return Op(kind, (k // (P * v)) * P + k % P, chunk * P + r)

    ops = []
    for r in range(P):
        warmup = min((P - 1 - r) * 2 + (v - 1) * P, total)
        row = [op("F", k, r) for k in range(warmup)]
        for k in range(total - warmup):
            row += [op("F", k + warmup, r), op("B", k, r)]
        row += [op("B", k, r) for k in range(total - warmup, total)]
        ops.append(tuple(row))
    return validate(Schedule(f"interleaved(v={v})", P, M, v, tuple(ops)))


def validate(schedule: Schedule) -> Schedule:
    """Check every rank runs F then B once per (micro-batch, own stage), at most one W after
    its B. ``ScheduleError`` naming the rank and the op. Returns ``schedule``."""
    P, M = schedule.P, schedule.M
    if schedule.placement not in ("loop", "v") or (schedule.placement == "v" and schedule.v != 2):
        raise ScheduleError(f"{schedule.name}: placement must be 'loop' or 'v' (with v=2), got "
                            f"{schedule.placement!r} with v={schedule.v}")
    if len(schedule.ops) != P:
        raise ScheduleError(f"{schedule.name}: {len(schedule.ops)} op lists for P={P} ranks")
    for r, row in enumerate(schedule.ops):
        own = set(schedule.stages_of(r))
        seen = set()
        for op in row:
            if not isinstance(op, Op) or op.kind not in ("F", "B", "W"):
                raise ScheduleError(f"{schedule.name}, rank {r}: {op!r} is not an Op('F'|'B'|'W', mb, stage)")
            if op.stage not in own:
                raise ScheduleError(f"{schedule.name}, rank {r}: {op!r} is for stage {op.stage}, "
                                    f"but rank {r} holds stages {sorted(own)}")
            if not 0 <= op.mb < M:
                raise ScheduleError(f"{schedule.name}, rank {r}: {op!r}: micro-batch not in 0..{M - 1}")
            if op in seen:
                raise ScheduleError(f"{schedule.name}, rank {r}: {op!r} appears twice")
            if op.kind == "B" and Op("F", op.mb, op.stage) not in seen:
                raise ScheduleError(f"{schedule.name}, rank {r}: {op!r} comes before its forward")
            if op.kind == "W" and Op("B", op.mb, op.stage) not in seen:
                raise ScheduleError(f"{schedule.name}, rank {r}: {op!r} (weight gradient) comes "
                                    f"before its B{op.mb}@s{op.stage} (input gradient): W needs "
                                    f"the gradient B receives")
            seen.add(op)
        missing = [Op(k, m, s) for s in sorted(own) for m in range(M) for k in "FB"
                   if Op(k, m, s) not in seen]
        if missing:
            raise ScheduleError(f"{schedule.name}, rank {r}: missing ops {missing[:6]}"
                                f"{' ...' if len(missing) > 6 else ''}")
    return schedule
