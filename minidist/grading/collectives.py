"""Grade a learner's collective against torch.distributed on many world sizes and sizes."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..comm import p2p
from ..launch import run
from .core import Report, Result, _not_implemented, compare

__all__ = ["grade_collective", "REFERENCES"]


def _rank_data(rank: int, world: int, n: int, dtype) -> torch.Tensor:
    """Small integers (exact sums in fp32 whatever the order), different on every rank."""
    g = torch.Generator().manual_seed(1000 * world + 7 * rank + n)
    return torch.randint(-50, 50, (n,), generator=g).to(dtype)


_TORCH_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _ref_all_reduce(x, rank, world, op):
    y = x.clone()
    dist.all_reduce(y, op=_TORCH_OPS[op])
    return y


def _ref_all_gather(piece, world):
    """torch's all_gather of pieces whose sizes may differ by rank (padded to the largest)."""
    sizes = torch.tensor([piece.numel()])
    all_sizes = [torch.zeros_like(sizes) for _ in range(world)]
    dist.all_gather(all_sizes, sizes)
    m = max(int(s) for s in all_sizes)
    padded = torch.zeros(m, dtype=piece.dtype)
    padded[: piece.numel()] = piece
    out = [torch.zeros_like(padded) for _ in range(world)]
    if m:
        dist.all_gather(out, padded)
    return [o[: int(s)] for o, s in zip(out, all_sizes)]


def _case_all_reduce(fn, x, rank, world, op):
    expected = _ref_all_reduce(x, rank, world, op)
    t = x.clone()
    out = fn(t, rank, world)
    return (t if out is None else out), expected


def _case_reduce_scatter(fn, x, rank, world, op):
    expected = _ref_all_reduce(x, rank, world, op).tensor_split(world)[rank]
    chunks = [c.clone() for c in x.tensor_split(world)]
    out = fn(chunks, rank, world)
    return (chunks[rank] if out is None else out), expected


def _case_all_gather(fn, x, rank, world, op):
    mine = x.tensor_split(world)[rank].clone()
    expected = torch.cat(_ref_all_gather(mine, world))
    # the other ranks' slots start as NaN, so a slot that is never received is caught
    chunks = [c.clone().fill_(float("nan")) if x.is_floating_point() else c.clone().zero_()
              for c in x.tensor_split(world)]
    chunks[rank].copy_(mine)
    out = fn(chunks, rank, world)
    got = torch.cat(list(chunks if out is None else out))
    return got, expected


REFERENCES = {
    "all_reduce": (_case_all_reduce, 2, "fn(tensor, rank, world_size): reduce in place (or return)"),
    "reduce_scatter": (_case_reduce_scatter, 1,
                       "fn(chunks, rank, world_size): chunks = tensor.tensor_split(W); afterwards "
                       "chunks[rank] holds the reduction of every rank's chunks[rank]"),
    "all_gather": (_case_all_gather, 1,
                   "fn(chunks, rank, world_size): chunks[rank] holds this rank's piece; afterwards "
                   "every chunks[j] holds rank j's piece"),
}


def _collective_rank(rank, world, fn, reference, n, op, dtype, traffic):
    case = REFERENCES[reference][0]
    x = _rank_data(rank, world, n, dtype)
    with p2p.count_traffic() as t:
        got, expected = case(fn, x, rank, world, op)
    return got, expected, t.bytes_sent // x.element_size()


def _traffic_problem(sent: list, reference: str, world: int, n: int) -> str | None:
    """A ring moves each of the W chunks W-1 times per phase: (W-1)·N elements in all per phase,
    at most (W-1)·ceil(N/W) per rank (all-reduce: two phases)."""
    phases = REFERENCES[reference][1]
    total_expected = phases * (world - 1) * n
    per_rank_max = phases * (world - 1) * math.ceil(n / world)
    if sum(sent) == 0 and total_expected:
        return (f"no elements went through minidist.comm.p2p (expected {total_expected} in all): "
                "send with p2p.isend/irecv/exchange, not torch.distributed directly")
    worst = max(range(world), key=lambda r: sent[r])
    if sent[worst] > per_rank_max or sum(sent) != total_expected:
        return (f"traffic is not a ring's: ranks sent {sent} elements (total {sum(sent)}); a ring "
                f"sends {total_expected} in all and at most {per_rank_max} per rank")
    return None


def grade_collective(learner_fn, reference: str = "all_reduce", world_sizes=(1, 2, 3, 4),
                     sizes=(0, 1, 3, 10, 1001), op: str = "sum", dtype=torch.float32,
                     timeout: float = 20.0, traffic: str | None = None, points: float = 1.0,
                     title: str | None = None) -> Report:
    """Grade a learner's collective against torch.distributed on every (world size, size) pair.

    Calling conventions (``REFERENCES``; the function runs inside each rank, process group set up):

    * ``"all_reduce"``: ``fn(tensor, rank, world_size)`` reduces the 1-D ``tensor`` in place
      (or returns the result);
    * ``"reduce_scatter"``: ``fn(chunks, rank, world_size)`` with ``chunks = x.tensor_split(W)``
      (sizes differ when W does not divide N; some are empty when N < W); afterwards
      ``chunks[rank]`` must hold the reduction over ranks (or return it);
    * ``"all_gather"``: ``fn(chunks, rank, world_size)``; ``chunks[rank]`` holds this rank's
      piece, the others are NaN; afterwards ``chunks[j]`` must hold rank j's piece everywhere.

    Every rank's data are small random integers (so fp32 sums are exact in any order): results must
    match exactly. ``traffic="ring"`` also checks, through ``minidist.comm.p2p``'s counters, that the
    ranks sent what a ring sends ((W-1)·N elements in all per phase). A hang ends after ``timeout``
    seconds as a failed check naming where every rank waited; the remaining sizes on that world
    size are then skipped (failed) to keep grading short; once the function raises
    ``NotImplementedError`` every remaining check is failed without running.

    Returns:
        a :class:`Report`, one check per (world size, size). Call ``.assert_passed()`` on it.
    """
    if reference not in REFERENCES:
        raise ValueError(f"grade_collective: reference must be one of {sorted(REFERENCES)}, "
                         f"got {reference!r}")
    if op not in _TORCH_OPS:
        raise ValueError(f"grade_collective: op must be one of {sorted(_TORCH_OPS)}, got {op!r}")
    name = getattr(learner_fn, "__name__", "learner function")
    what = reference if reference == "all_gather" else f"{reference}, op={op}"
    report = Report(title or f"{name} graded against torch.distributed ({what})")
    todo = None
    for world in world_sizes:
        timed_out = None
        for n in sizes:
            label = f"world size {world}, {n} element{'s' if n != 1 else ''}"
            if todo or timed_out is not None:
                why = f"not run: {todo}" if todo else f"skipped: {timed_out} timed out"
                report.add(Result(label, False, 0.0, points, why))
                continue

            def one(world=world, n=n):
                outs = run(_collective_rank, world, learner_fn, reference, n, op, dtype, traffic,
                           timeout=timeout)
                for rank, (got, expected, _) in enumerate(outs):
                    msg = compare(got, expected, rank)
                    if msg:
                        return msg
                if traffic == "ring":
                    return _traffic_problem([o[2] for o in outs], reference, world, n)
                return None

            result = report.check(label, one, points)
            todo = _not_implemented(result)
            if not result.passed and result.message.startswith("minidist.run timed out"):
                timed_out = f"{n} elements"
    return report
