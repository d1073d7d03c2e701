"""Grade a learner's collective against torch.distributed on many world sizes and sizes.

When a sum is wrong, the grader runs the code once more on inputs that name their contributors:
chunk ``c`` of rank ``k`` holds ``10**(k + W·c)`` (float64, exact for W <= 4), so each decimal digit
of a sum counts one (rank, chunk) contribution: a result reads "ranks {0, 1, 3}", "rank 2 counted
2 times" or "chunk 1 of ranks {2}" (data of the wrong chunk). It reports, for every failing rank,
which ranks a chunk holds and which are missing; with ``traffic="ring"`` it also decodes every
message each rank sent through ``minidist.comm.p2p`` and names the first step that differs from
chapter 03's ring. Where the exercise teaches pairing, :mod:`.waits` also checks that every
send and receive was waited before its buffer was used.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from minidist.comm import p2p
from minidist.launch import run
from ..diagrams import ring_schedule
from minidist.launch import RankError, RankTimeoutError
from .core import Report, compare, describe_exception
from .generated import examples, st
from .waits import wait_problem, watch_waits

__all__ = ["grade_collective", "REFERENCES", "collective_rules"]


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


def _collective_rank(rank, world, fn, reference, n, op, dtype, traffic, watch=False):
    case = REFERENCES[reference][0]
    x = _rank_data(rank, world, n, dtype)
    posted: list = []
    undo = watch_waits(posted, poison=reference != "all_gather") if watch else (lambda: None)
    try:
        with p2p.count_traffic() as t:
            got, expected = case(fn, x, rank, world, op)
    finally:
        undo()
    unwaited = [w.what for w in posted if not w.waited]
    for w in posted:   # finish what the learner left posted, so the next check starts clean
        if not w.waited:
            w.wait()
    return got, expected, t.bytes_sent // x.element_size(), unwaited


def _collective_batch_rank(rank, world, fn, reference, sizes, op, dtype):
    """Every size of ``sizes`` in one launch: ``[(got, expected), ...]``."""
    case = REFERENCES[reference][0]
    return [case(fn, _rank_data(rank, world, n, dtype), rank, world, op) for n in sizes]


def _generated_sizes(learner_fn, reference, world_sizes, sizes, op, dtype, timeout):
    """The learner's collective on ``sizes`` (drawn by hypothesis) at every world size, one launch
    per world size; ``(rule, message)`` for the smallest failing (world size, size), or None."""
    for world in world_sizes:
        try:
            outs = run(_collective_batch_rank, world, learner_fn, reference, sizes, op, dtype,
                       timeout=timeout)
        except RankError as e:
            for n in sorted(sizes):   # which size crashes? the smallest, one launch each
                try:
                    run(_collective_batch_rank, world, learner_fn, reference, [n], op, dtype,
                        timeout=timeout)
                except RankError as one:
                    return "sizes", (f"world size {world}, {n} elements (generated): "
                                     f"{describe_exception(one)}")
            return "equal", f"world size {world}, sizes {sorted(sizes)}: {describe_exception(e)}"
        for i in sorted(range(len(sizes)), key=lambda i: sizes[i]):
            wrong = [m for r, results in enumerate(outs) if (m := compare(*results[i], r))]
            if wrong:
                n = sizes[i]
                rule = "sizes" if n % world != 0 or n // world < 2 else "equal"
                return rule, f"world size {world}, {n} elements (generated):\n" + "\n".join(wrong)
    return None


PEER_LEFT = ("(gloo's 'Connection closed by peer' and no other error: a rank returned or exited "
             "while another still waited for a message from it — a send or receive without its "
             "match: a step one rank skipped, or a chunk index that differs between the two sides, "
             "so that one sends an empty chunk (nothing is sent) while the other waits for data)")


def _peer_left(e: RankError) -> bool:
    """Every failing rank lost its connection, and none crashed otherwise (a size mismatch
    kills one rank with SIGABRT first): a peer left the exchange early."""
    return not isinstance(e, RankTimeoutError) and bool(e.failures) and all(
        "Connection closed by peer" in f"{summary} {details}" for _, summary, details in e.failures)


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


def _code(rank: int, chunk: int, world: int) -> float:
    """What rank ``rank`` holds in chunk ``chunk`` for the decoding run: digit rank + W·chunk."""
    return float(10 ** (rank + world * chunk))


def _decode(v: float, world: int) -> list[list[int]] | None:
    """``counts[c][k]``: how many times rank k's chunk c is summed into ``v`` (None: not a sum)."""
    if v != v or v < 0 or v != int(v):
        return None
    counts, v = [[0] * world for _ in range(world)], int(v)
    for c in range(world):
        for k in range(world):
            counts[c][k], v = v % 10, v // 10
    return counts if v == 0 else None


def _set(ranks) -> str:
    return "{" + ", ".join(str(k) for k in ranks) + "}"


def _holds(v: float, world: int, chunk: int, complete: bool = True) -> str:
    """'holds ranks {0, 2}, missing {1, 3}' for a sum that should be chunk ``chunk`` of every rank;
    names another chunk's data and double counts too."""
    counts = _decode(v, world)
    if counts is None:
        return f"holds {v:g}, which is no sum of the ranks' chunks"
    own = [k for k in range(world) if counts[chunk][k]]
    text = f"holds ranks {_set(own)}"
    missing = [k for k in range(world) if not counts[chunk][k]]
    if missing and complete:
        text += f", missing {_set(missing)}"
    text += "".join(f", rank {k} counted {n} times" for k, n in enumerate(counts[chunk]) if n > 1)
    for c in range(world):
        if c != chunk and any(counts[c]):
            text += f", and chunk {c} of ranks {_set(k for k in range(world) if counts[c][k])}"
    return text


def _spy_rank(rank, world, fn, reference, n):
    """Run the learner's collective with chunk c of rank k holding _code(k, c); return (result,
    [(index of the chunk sent, its first value) for every message this rank sent through p2p])."""
    x = torch.cat([torch.full((c.numel(),), _code(rank, j, world), dtype=torch.float64)
                   for j, c in enumerate(torch.empty(n).tensor_split(world))])
    sent, original = [], p2p.isend

    def isend(tensor, dst, group=None, tag=0):
        if tensor.numel():
            sent.append(float(tensor.reshape(-1)[0]))
        return original(tensor, dst, group, tag)

    p2p.isend = isend
    try:
        got, _ = REFERENCES[reference][0](fn, x, rank, world, "sum")
    finally:
        p2p.isend = original
    return got, sent


def _first_divergence(sent: list, world: int, phases: int) -> str | None:
    """Compare each rank's decoded messages with the taught ring's (diagrams.ring_schedule)."""
    steps = ring_schedule(world)
    for s in range(phases * (world - 1)):
        before, chunk_sent = steps[s][1], steps[s + 1][2]
        phase = "reduce-scatter" if s < world - 1 else "all-gather"
        step = s % (world - 1) + 1
        for r in range(world):
            c = chunk_sent[r]
            want = sum(_code(k, c, world) for k in before[r][c])
            where = (f"first difference from the ring taught above: at {phase} step {step} "
                     f"(s = {step - 1} in the loop) rank {r}")
            if len(sent[r]) <= s:
                return (f"{where} sent nothing (it sent {len(sent[r])} messages in all, the ring "
                        f"sends {phases * (world - 1)})")
            if sent[r][s] != want:
                counts = _decode(sent[r][s], world)
                got_c = next((j for j in range(world) if counts and any(counts[j])), c)
                return (f"{where} sent chunk {got_c}, which {_holds(sent[r][s], world, got_c, False)}; "
                        f"the ring sends chunk {c}, holding ranks {_set(sorted(before[r][c]))}")
    return None


def _diagnose_sum(fn, reference: str, world: int, n: int, timeout: float,
                  ring: bool = True) -> list[str]:
    """Lines decoding a wrong sum: which ranks each failing rank's chunk holds, and (``ring``: the
    code is meant to be chapter 03's ring) the first step that differs from it."""
    try:
        outs = run(_spy_rank, world, fn, reference, n, timeout=timeout)
    except Exception:  # noqa: BLE001 - the diagnosis is a bonus; the failure is already reported
        return []
    sizes = [c.numel() for c in torch.empty(n).tensor_split(world)]
    owner = [j for j in range(world) for _ in range(sizes[j])]  # chunk of each element
    lines = []
    for rank, (got, _) in enumerate(outs):
        if not isinstance(got, torch.Tensor) or got.numel() != (
                sizes[rank] if reference == "reduce_scatter" else n):
            continue  # a type or shape problem: already reported as such
        got = got.reshape(-1)
        chunk_of = [rank] * got.numel() if reference == "reduce_scatter" else owner
        for i in range(got.numel()):
            c = chunk_of[i]
            if float(got[i]) != sum(_code(k, c, world) for k in range(world)):
                lines.append(f"rank {rank}: chunk {c} {_holds(float(got[i]), world, c)}")
                break
    if lines and ring and n >= world:
        div = _first_divergence([s for _, s in outs], world, REFERENCES[reference][1])
        if div:
            lines.append(div)
    if lines:
        lines.insert(0, f"decoded by a second run of your code (world size {world}, {n} elements, "
                        "chosen so that each rank's chunks hold distinct powers of ten and a sum "
                        "names its contributors):")
    return lines


def collective_rules(traffic: str | None = None, pairing: bool = False) -> dict:
    """The rules :func:`grade_collective` checks, as ``{id: text}`` (``traffic="ring"`` adds the
    ring's traffic; ``pairing`` a rule for the exercises that teach send/receive pairing)."""
    rules = {
        "equal": "every rank's result equals torch.distributed's, exactly, on 1-4 ranks",
        "sizes": "any size: empty, at most one element per rank, sizes W does not divide "
                 "(uneven chunks)",
    }
    if traffic == "ring":
        rules["p2p"] = "built on minidist.comm.p2p's sends and receives (not a torch collective)"
        rules["ring"] = ("a ring's traffic: (W-1)·N elements in all per phase, at most "
                         "(W-1)·ceil(N/W) per rank")
    if pairing:
        rules["pairing"] = ("every send meets a receive posted at the same time (isend/irecv or "
                            "exchange): no deadlock")
        rules["wait"] = ("every isend/irecv is waited (p2p.wait_all or .wait()) before its buffer "
                         "is read or the function returns")
    return rules


def grade_collective(learner_fn, reference: str = "all_reduce", world_sizes=(1, 2, 3, 4),
                     sizes=(0, 1, 3, 10, 1001), op: str = "sum", dtype=torch.float32,
                     timeout: float = 20.0, traffic: str | None = None, points: float = 1.0,
                     title: str | None = None, total: float | None = None,
                     requires: dict | None = None, pairing: bool = False) -> Report:
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
    match exactly; every failing rank is listed. A wrong sum is decoded (see the module docstring).
    ``traffic="ring"`` also checks, through ``minidist.comm.p2p``'s counters, that the ranks sent
    what a ring sends ((W-1)·N elements in all per phase). A hang ends after ``timeout`` seconds as
    a failed check naming where every rank waited; every later check is then failed unrun (each
    would wait as long), as after ``NotImplementedError``.

    Args:
        points: points per check; ``total``: the part's points in the exercise text (the printed
            score is scaled to it).
        requires: ``{reference: function}`` of earlier parts this function calls (e.g.
            ``{"reduce_scatter": ring_reduce_scatter}``); when this one fails, each is checked
            quickly and the report says "fails because ... fails" if one does.

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
    rules = collective_rules(traffic, pairing)
    report = Report(title or f"{name} graded against torch.distributed ({what})", total=total,
                    rules=rules, default_rule="equal",
                    timeout_rule="pairing" if pairing else "", brief_repeats=True)
    decoded = False
    for world in world_sizes:
        for n in sizes:
            def one(world=world, n=n):
                awkward = n % world != 0 or n // world < 2
                try:
                    outs = run(_collective_rank, world, learner_fn, reference, n, op, dtype,
                               traffic, pairing, timeout=timeout)
                except RankError as e:   # a crash only on awkward sizes: the sizes rule
                    if _peer_left(e):
                        rule = "sizes" if awkward and any(r.passed for r in report.results) else "equal"
                        return rule, f"{describe_exception(e)}\n{PEER_LEFT}"
                    if not isinstance(e, RankTimeoutError) and awkward and any(r.passed for r in report.results):
                        return "sizes", describe_exception(e)
                    raise
                if pairing:
                    problem = wait_problem(outs, reference, name)
                    if problem:
                        return "wait", problem
                wrong = [m for r, (got, expected, _, _) in enumerate(outs)
                         if (m := compare(got, expected, r))]
                if wrong:
                    return ("sizes" if awkward else "equal"), "\n".join(wrong)
                if traffic == "ring":
                    problem = _traffic_problem([o[2] for o in outs], reference, world, n)
                    if problem:
                        return ("p2p" if problem.startswith("no elements") else "ring"), problem
                return None

            result = report.check(f"world size {world}, {n} element{'s' if n != 1 else ''}", one,
                                  points)
            if (not result.passed and not decoded and not result.stop and op == "sum"
                    and reference != "all_gather" and "expected" in result.message
                    and 1 < world <= 4):
                decoded = True
                # on at least one element per chunk first, so every ring step sends something
                ring = traffic == "ring"
                extra = _diagnose_sum(learner_fn, reference, world, max(n, world), timeout, ring)
                if not extra and n < world:
                    extra = _diagnose_sum(learner_fn, reference, world, n, timeout, ring)
                if extra:
                    result.message += "\n" + "\n".join(extra)
    if not report.failed:   # the named sizes pass: sizes hypothesis draws, one launch per W
        drawn = examples(st.integers(0, 5000), 10)
        report.check(f"world sizes {', '.join(map(str, world_sizes))}: {len(drawn)} generated sizes "
                     f"(0-5000 elements) each", lambda: _generated_sizes(
                         learner_fn, reference, world_sizes, drawn, op, dtype, timeout), points)
    if any(r.rule == "equal" for r in report.failed):   # wrong on even sizes too: not the sizes
        report.relabel("sizes", "equal")
    if report.failed and requires:
        for ref, fn in requires.items():
            sub = grade_collective(fn, ref, world_sizes=(2, 3), sizes=(10,), timeout=timeout)
            if sub.failed:
                first = sub.failed[0]
                report.notes.append(
                    f"fails because {getattr(fn, '__name__', ref)} fails ({first.name}: "
                    f"{first.message.splitlines()[0]}); fix that part first")
    return report
