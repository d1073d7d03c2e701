"""Grade exercise 02: all-gather and reduce-scatter composed from broadcast and reduce, and the
nccl-tests bus-bandwidth factors.

* ``all_gather_by_broadcast(chunks, rank, W)``: W broadcasts, rank j's chunk from rank j;
* ``reduce_scatter_by_reduce(chunks, rank, W)``: W reduces, chunk j's sum to rank j.

Their results are compared with torch's own collectives by :func:`grade_collective` (every world
size 1-4, sizes 0, 1, 3, 10, 1001); :func:`grade_composed` adds a check that the function is
built from the primitive it is meant to use: it counts the calls of ``torch.distributed.broadcast``
/ ``reduce`` on every rank (W of them, one per root, every root once) and fails on a call of the
collective being written (``dist.all_gather`` ...), which would be no composition at all.

* ``busbw_factor(op, W)``: nccl-tests' factor (``busbw = algbw × factor``): 2(W-1)/W for
  all-reduce, (W-1)/W for all-gather, reduce-scatter and all-to-all, 1 for broadcast and reduce —
  nccl-tests, doc/PERFORMANCE.md, "Bus bandwidth".
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from minidist.launch import run
from .collectives import grade_collective
from .core import Report
from .generated import generated_check, st

__all__ = ["grade_composed", "grade_busbw_factor", "BUSBW_FACTOR", "BUSBW_RULES",
           "composed_rules"]

BUSBW_FACTOR = {
    "all_reduce": lambda w: 2 * (w - 1) / w,
    "all_gather": lambda w: (w - 1) / w,
    "reduce_scatter": lambda w: (w - 1) / w,
    "all_to_all": lambda w: (w - 1) / w,
    "broadcast": lambda w: 1.0,
    "reduce": lambda w: 1.0,
}

_PRIMITIVE = {"all_gather": "broadcast", "reduce_scatter": "reduce"}
_FORBIDDEN = ("all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
              "all_reduce", "all_to_all", "all_to_all_single")


def _count_calls(rank, world, fn, reference, n):
    """Run ``fn`` with torch.distributed's collectives counted; return (roots used, forbidden)."""
    primitive = _PRIMITIVE[reference]
    roots, forbidden, saved = [], [], {}

    def spy(name):
        original = getattr(dist, name)
        saved[name] = original

        def wrapper(tensor, *args, **kwargs):
            if name == primitive:
                root = kwargs.get("src", kwargs.get("dst", args[0] if args else None))
                roots.append(root)
            else:
                forbidden.append(f"dist.{name}")
            return original(tensor, *args, **kwargs)
        setattr(dist, name, wrapper)

    for name in (primitive,) + _FORBIDDEN:
        if hasattr(dist, name):
            spy(name)
    chunks = [c.clone() for c in torch.arange(float(n)).add(rank).tensor_split(world)]
    try:
        fn(chunks, rank, world)
    finally:
        for name, original in saved.items():
            setattr(dist, name, original)
    return roots, forbidden


def _check_composition(fn, reference, world, n, timeout):
    primitive = _PRIMITIVE[reference]
    outs = run(_count_calls, world, fn, reference, n, timeout=timeout)
    problems = []
    for rank, (roots, forbidden) in enumerate(outs):
        if forbidden:
            problems.append(f"rank {rank} called {', '.join(sorted(set(forbidden)))}: write "
                            f"{reference} from dist.{primitive} only")
        elif sorted(r for r in roots if r is not None) != list(range(world)):
            problems.append(f"rank {rank} called dist.{primitive} with roots {roots}: expected one "
                            f"call per rank as root, {list(range(world))} (in any order)")
    return "\n".join(problems) or None


BUSBW_RULES = {
    "all_reduce": "all-reduce: 2(W-1)/W (a reduce-scatter and an all-gather)",
    "one_phase": "all-gather, reduce-scatter, all-to-all: (W-1)/W",
    "rooted": "broadcast and reduce: 1, whatever W",
}
_BUSBW_RULE = {"all_reduce": "all_reduce", "broadcast": "rooted", "reduce": "rooted"}


def composed_rules(reference: str) -> dict:
    """:func:`grade_composed`'s rules: grade_collective's, and the composition."""
    from .collectives import collective_rules
    primitive = _PRIMITIVE[reference]
    return {**collective_rules(),
            "compose": f"made of dist.{primitive} only: W calls, each rank the root once, no "
                       f"torch {reference}"}


def grade_composed(fn, reference: str, total: float, timeout: float = 20.0) -> Report:
    """Results against torch's collective (``grade_collective``), then the composition rule."""
    if reference not in _PRIMITIVE:
        raise ValueError(f"grade_composed: reference must be one of {sorted(_PRIMITIVE)}, "
                         f"got {reference!r}")
    primitive = _PRIMITIVE[reference]
    name = getattr(fn, "__name__", "learner function")
    report = grade_collective(fn, reference, world_sizes=(1, 2, 3, 4), sizes=(0, 1, 3, 10, 1001),
                              timeout=timeout,
                              title=f"{name}: {reference} from dist.{primitive}, against torch's")
    report.rules = dict(report.rules or {}, **composed_rules(reference))
    for world in (2, 4):
        report.check(f"made of dist.{primitive}: one call per root (world size {world})",
                     lambda w=world: _check_composition(fn, reference, w, 10, timeout),
                     points=2, rule="compose")
    report.total = total
    return report


def grade_busbw_factor(fn, total: float = 2) -> Report:
    """``fn(op, world_size)`` against :data:`BUSBW_FACTOR` for every op, W = 1, 2, 3, 4, 8, 64."""
    report = Report("Part C: busbw factors (nccl-tests)", total=total, rules=BUSBW_RULES)
    for op, formula in BUSBW_FACTOR.items():
        def one(op=op, formula=formula):
            for w in (1, 2, 3, 4, 8, 64):
                got, want = fn(op, w), formula(w)
                if not isinstance(got, (int, float)) or abs(got - want) > 1e-12:
                    hint = ""
                    if isinstance(got, (int, float)) and want and abs(got * w / (w - 1 or 1)
                                                                       - want) < 1e-12:
                        hint = " (multiplied by (W-1)/W once too often?)"
                    return f"{op}, W={w}: expected {want:.6g}, got {got!r}{hint}"
            return None
        report.check(f"{op}", one, rule=_BUSBW_RULE.get(op, "one_phase"))

    def generated(case):
        op, w = case
        got, want = fn(op, w), BUSBW_FACTOR[op](w)
        if not isinstance(got, (int, float)) or abs(got - want) > 1e-12:
            return _BUSBW_RULE.get(op, "one_phase"), f"expected {want:.6g}, got {got!r}"
        return None
    generated_check(report, "every op, W = 1-4096", st.tuples(
        st.sampled_from(sorted(BUSBW_FACTOR)), st.integers(1, 4096)), generated, max_examples=60,
        describe=lambda c: f"{c[0]}, W={c[1]}")
    return report
