"""DDP's default bucket size from the alpha-beta model of :mod:`minidist.comm.tuner`: fewer,
larger buckets where latency dominates (torch's 25 MiB where it does not)."""

from __future__ import annotations

from minidist.comm.tuner import Table, coefficients

__all__ = ["BUCKET_FLOOR", "latency_share", "bucket_cap_bytes"]

BUCKET_FLOOR = 25 << 20   # torch DDP's bucket_cap_mb=25 (Li et al. 2020, §5.2 measured it)


def latency_share(t: Table, world: int, nbytes: int, op: str = "all_reduce") -> float:
    """The latency share (``c_alpha·alpha``) of auto's choice's alpha-beta model time."""
    a = t.choose(op, world, nbytes)
    total = t.model(op, a, world, nbytes)   # 0 at W = 1: nothing moves
    return coefficients(op, a, world, nbytes)[0] * t.alpha_beta(op, a, world)[0] / total if total else 0.0


def bucket_cap_bytes(t: Table, world: int, share: float = 0.05, floor: int = BUCKET_FLOOR,
                     ceiling: int = 4 * BUCKET_FLOOR) -> int:
    """A DDP bucket size: the smallest (MiB steps) at which auto's all-reduce latency is at most
    ``share`` of its alpha-beta time, within [``floor``, ``ceiling``] (torch's 25 MiB, 100 MiB)."""
    if world <= 1:
        return floor
    mib = max(1, floor >> 20)
    while (mib << 20) < ceiling and latency_share(t, world, mib << 20) > share:
        mib += 1
    return min(ceiling, mib << 20)
