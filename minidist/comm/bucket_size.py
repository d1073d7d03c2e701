"""DDP's default bucket size from the alpha-beta model of :mod:`minidist.comm.tuner`: fewer,
larger buckets where latency dominates (torch's 25 MiB where it does not)."""

from __future__ import annotations

from minidist.comm.tuner import Table, coefficients

__all__ = ["BUCKET_FLOOR", "latency_share", "bucket_cap_bytes"]

BUCKET_FLOOR = 25 << 20   # torch DDP's bucket_cap_mb=25 (Li et al. 2020, §5.2 measured it)


def latency_share(t: Table, world: int, nbytes: int, op: str = "all_reduce") -> float:
    """The share of auto's choice's alpha-beta model time (:meth:`Table.model`) that is latency
    (``c_alpha·alpha``)."""
    a = t.choose(op, world, nbytes)
    total = t.model(op, a, world, nbytes)   # 0 at W = 1: nothing moves
    return coefficients(op, a, world, nbytes)[0] * t.alpha_beta(op, a, world)[0] / total if total else 0.0


def bucket_cap_bytes(t: Table, world: int, share: float = 0.05, floor: int = BUCKET_FLOOR,
                     ceiling: int = 4 * BUCKET_FLOOR) -> int:
    """A DDP bucket size from the same model: the smallest size (MiB steps) at which the
    latency of auto's all-reduce is at most ``share`` of its alpha-beta model time, kept within
    [``floor``, ``ceiling``].

    Why: B buckets of a model's n gradient bytes cost about ``B·c_alpha·alpha + c_beta·n·beta``
    of communication, of which only the last bucket's is not hidden behind backward. Smaller
    buckets start communicating earlier and leave a smaller last bucket; each costs one more
    alpha. Where latency dominates (a slow alpha, many ranks: c_alpha grows with W), a bucket
    must be larger before its alpha stops mattering, so fewer, larger buckets; where bandwidth
    dominates, torch's 25 MiB (the floor) already pays under 5 % latency (chapter 03, section 5
    prints the shares and caps of the table in use). The ceiling (100 MiB) bounds the
    un-overlapped last bucket.
    """
    if world <= 1:
        return floor
    mib = max(1, floor >> 20)
    while (mib << 20) < ceiling and latency_share(t, world, mib << 20) > share:
        mib += 1
    return min(ceiling, mib << 20)
