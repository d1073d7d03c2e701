"""Grade exercise 08b: the sub-groups of a two-level cluster, then a hierarchical all-reduce on them.

The learner writes (see ``exercises/08b_hierarchical_allreduce.ipynb``), for W = M·L ranks on M
nodes of L ranks, global rank r on node r // L with local index r % L:

* ``node_groups(rank, world_size, ranks_per_node) -> (intra, inter)``: every rank creates every
  node's group and every "rail" (the ranks with one local index, one per node), in the same
  order, and returns the two it belongs to;
* ``hierarchical_all_reduce(tensor, rank, world_size, ranks_per_node, groups, op)``: in place,
  reduce-scatter inside the node, all-reduce this rank's piece across the nodes, all-gather inside
  the node, from :mod:`minidist.comm.ring`'s pieces.

Part A needs no ranks: ``dist.new_group`` is replaced, while the learner's function runs once per
rank of a layout, by a recorder that returns a stand-in group holding its ranks; the grader then
compares what every rank created (the same list in the same order, or the ranks would meet the
wrong peers) and the two groups each rank returned. Named layouts, then layouts hypothesis draws.

Part B runs on every layout of 1-4 ranks (1×1; 1×2, 2×1; 1×3, 3×1; 1×4, 2×2, 4×1), one launch per
world size holding all of them: the grader's own groups (made once per launch, as Part A's
solution makes them), a topology installed in each rank (:mod:`minidist.comm.topology`, links
unshaped: it only counts), and per size and op the learner's result against torch's
``all_reduce`` (what it returns; the caller's tensor must hold the same: in place), the bytes
each rank sent across nodes against ``2(M-1)/M · n/L`` per rank (``2(M-1)·n`` summed: exact for
any n), and whether the learner's call made groups. Sizes: named (multiples of 12 first, then the
awkward 0, 1, 3, 10, 1001) and drawn by hypothesis (:func:`~.generated.examples`). A crash inside
the learner's code names the case; a crash on an awkward size is relaunched without them, so the
other rules are still checked. Each failure names its rule of :data:`GROUP_RULES` or
:data:`ALL_REDUCE_RULES` (``[id] rule text: ...``).

Every rank's values are ``16·a + 2^rank``: a wrong sum decodes into the set of ranks each element
holds, which names the phase that did not run (across the nodes; the all-gather; the
reduce-scatter); a wrong average is decoded by its divisor on each layout (÷L: over the node only).
Rules are weighted (:data:`ALL_REDUCE_POINTS`: ``[inter_bytes]`` is half). A rule that cannot be
judged apart from another's failure is "not checked" (no points, shown ``–``), never ✓: the sizes
and ops when the plain sums are wrong, the bytes when no sum on several nodes is right, and every
rule but ``[inter_bytes]`` when nothing went through minidist's p2p (torch's collectives).
"""

from __future__ import annotations

import math
import re

import torch
import torch.distributed as dist

from .core import Report, Result, compare, describe_exception
from .generated import examples, generated_check, st

__all__ = ["GROUP_RULES", "ALL_REDUCE_RULES", "ALL_REDUCE_POINTS", "LAYOUTS", "GROUP_LAYOUTS", "grade_node_groups",
           "grade_all_reduce", "grade_all_reduce_many", "inter_bytes_per_rank", "inter_bytes_total"]

GROUP_RULES = {
    "intra": "intra holds this rank's node: global ranks m·L … m·L + L - 1 (m = rank // L)",
    "inter": "inter holds the ranks with this rank's local index, one per node: l, L + l, 2L + l, "
             "… (l = rank % L)",
    "every_rank": "every rank creates every group, in the same order (dist.new_group is collective "
                  "over the world: a rank that skips a group it is not in meets the wrong peers)",
}
ALL_REDUCE_RULES = {
    "result": "every rank's result equals torch.distributed's all_reduce, exactly, on every layout "
              "of 1-4 ranks (M nodes × L ranks)",
    "uneven": "any size: empty, fewer elements than ranks, sizes L or W does not divide "
              "(tensor_split's uneven pieces)",
    "op": "op reaches every phase ('max', 'min'); 'avg' is the sum divided by W (dividing once, at "
          "the end, is simplest: the ring pieces add for 'avg' and leave the division to the caller)",
    "in_place": "in place: afterwards the tensor you were given holds the result, the one you return",
    "inter_bytes": "across nodes each rank sends only its piece's all-reduce: 2(M-1)/M · n/L "
                   "elements, 2(M-1)·n in all, through minidist's p2p (a flat ring's ranks at a node "
                   "boundary send 2(W-1)/W · n)",
    "once": "the groups are made once, before (Part A): hierarchical_all_reduce creates none "
            "(dist.new_group is a synchronization of the whole world, and every group keeps "
            "threads and sockets)",
}
# What each rule is worth (Report scales the sum to the part's points): [inter_bytes] is what makes
# the all-reduce hierarchical, half of the part, so a flat ring or the whole tensor across (right
# results, the wrong bytes) scores 2 of 4, and torch's all_reduce 0 (nothing else can be credited).
ALL_REDUCE_POINTS = {"result": 1.0, "uneven": 0.5, "op": 0.5, "in_place": 0.5, "inter_bytes": 3.0,
                     "once": 0.5}
NOT_P2P = ("not checked: the all-reduce must be built from minidist.comm.ring's pieces (torch's "
           "collectives are neither counted nor shaped)")
IN_PLACE = ("reassigning `tensor = …` or `torch.cat` makes a new one; write into it, e.g. with "
            "`.copy_()`/`.div_()`")
LAZY = ("the library caches lazily because its signature has no `groups` argument; here you are "
        "given them: use those")

# (M nodes, L ranks per node) per world size: every layout of 1-4 ranks
LAYOUTS = {1: ((1, 1),), 2: ((1, 2), (2, 1)), 3: ((1, 3), (3, 1)), 4: ((1, 4), (2, 2), (4, 1))}
GROUP_LAYOUTS = ((1, 1), (1, 2), (2, 1), (2, 2), (1, 4), (4, 1), (2, 3), (3, 2), (2, 4), (4, 2))
SIZES = (24, 48, 1008, 0, 1, 3, 10, 1001)       # multiples of 12 (= lcm of 1..4) first
OP_CASES = (("avg", 48), ("max", 48), ("min", 24), ("avg", 1008))   # plain sizes: the op alone
ITEMSIZE = 4                                     # float32


def _where(M: int, L: int) -> str:
    return f"{M} node{'s' if M != 1 else ''} × {L} rank{'s' if L != 1 else ''}"


def inter_bytes_per_rank(M: int, L: int, n: int, itemsize: int = ITEMSIZE) -> float:
    """Bytes one rank sends across nodes in a hierarchical all-reduce of n elements: its piece
    (n/L) all-reduced by a ring of M ranks, 2(M-1)/M of it (exact when W = M·L divides n)."""
    return 2 * (M - 1) / M * n / L * itemsize


def inter_bytes_total(M: int, L: int, n: int, itemsize: int = ITEMSIZE) -> int:
    """Bytes sent across nodes by all ranks together: 2(M-1)·n, for any n (every piece's ring
    moves each of its M chunks M-1 times per phase)."""
    return 2 * (M - 1) * n * itemsize


# --------------------------------------------------------------------------- Part A: the groups
class _Group:
    """What ``dist.new_group`` returns while Part A is graded: the sorted global ranks."""

    def __init__(self, ranks: tuple):
        self.ranks = ranks

    def __repr__(self) -> str:
        return f"the group of ranks {list(self.ranks)}"


def _created(fn, rank: int, world: int, L: int):
    """Run ``fn(rank, world, L)`` with ``dist.new_group`` recording; (its result, the groups made)."""
    made: list = []

    def new_group(ranks=None, *args, **kwargs):
        members = tuple(sorted(int(r) for r in (range(world) if ranks is None else ranks)))
        made.append(_Group(members))
        return made[-1]

    real = dist.new_group
    dist.new_group = new_group
    try:
        out = fn(rank, world, L)
    finally:
        dist.new_group = real
    return out, made


def _returned(out, made, rank: int, key: str, want: tuple):
    """A message (``(rule, text)``) if ``out`` is not a group this rank made holding ``want``."""
    if not (isinstance(out, tuple) and len(out) == 2):
        return "intra", (f"rank {rank}: expected the tuple (intra, inter), got "
                         f"{type(out).__name__}")
    g = out[0 if key == "intra" else 1]
    if not isinstance(g, _Group) or not any(g is m for m in made):
        return key, (f"rank {rank}: {key} should be a group dist.new_group returned on this rank, "
                     f"got {g!r}" + (" (a list of ranks is not a group: pass it to "
                                      "dist.new_group)" if isinstance(g, (list, tuple, range)) else ""))
    if g.ranks != want:
        return key, f"rank {rank}: {key} is {g!r}, expected the group of ranks {list(want)}"
    return None


def _groups_check(fn, layout):
    M, L = layout
    W = M * L
    made_by = {}
    for rank in range(W):
        out, made = _created(fn, rank, W, L)
        made_by[rank] = [g.ranks for g in made]
        m, l_ = divmod(rank, L)
        for key, want in (("intra", tuple(range(m * L, m * L + L))),
                          ("inter", tuple(range(l_, W, L)))):
            problem = _returned(out, made, rank, key, want)
            if problem:
                return problem
    for rank in range(1, W):
        if made_by[rank] != made_by[0]:
            mine, first = made_by[rank], made_by[0]
            k = next((j for j, (a, b) in enumerate(zip(first, mine)) if a != b),
                     min(len(first), len(mine)))
            asks = [f"{list(seq[k])}" if k < len(seq) else "nothing more" for seq in (first, mine)]
            return "every_rank", (f"dist.new_group call {k + 1}: rank 0 asks for {asks[0]}, "
                                  f"rank {rank} for {asks[1]} (rank 0 made "
                                  f"{[list(g) for g in first]}, rank {rank} "
                                  f"{[list(g) for g in mine]}); every rank must make every group, "
                                  "its own and the others', in one order")
    return None


def grade_node_groups(fn, total: float = 2) -> Report:
    """``fn(rank, world_size, ranks_per_node) -> (intra, inter)`` on :data:`GROUP_LAYOUTS`, then on
    layouts hypothesis draws (M, L up to 6)."""
    report = Report("Part A: the groups of a two-level cluster", total=total, rules=GROUP_RULES,
                    default_rule="intra")
    for layout in GROUP_LAYOUTS:
        report.check(f"{_where(*layout)} (W = {layout[0] * layout[1]})",
                     lambda c=layout: _groups_check(fn, c))
    generated_check(report, "M nodes × L ranks", st.tuples(st.integers(1, 6), st.integers(1, 6)),
                    lambda c: _groups_check(fn, c), max_examples=40,
                    describe=lambda c: _where(*c), crash_rule="intra")
    return report


# --------------------------------------------------------------------------- Part B: the all-reduce
class _Crash(Exception):
    """A learner's call raised: ``rule|case|what``, parsed back from the launcher's report."""


_TORCH_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
              "min": dist.ReduceOp.MIN}


def _awkward(n: int, W: int) -> bool:
    return n == 0 or n % W != 0


def _rule_of(op: str, n: int, W: int) -> str:
    return "op" if op != "sum" else ("uneven" if _awkward(n, W) else "result")


def _data(rank: int, world: int, n: int) -> torch.Tensor:
    """Small integers, different on every rank, that say whose they are: ``16·a + 2^rank`` (a drawn
    in -20..20). A sum of any set S of ranks' values, each once, is exact in float32 and is
    ``Σ_{r∈S} 2^r`` modulo 16 (W ≤ 4): a wrong sum decodes into the ranks it holds."""
    g = torch.Generator().manual_seed(1009 * world + 31 * rank + n)
    return (16 * torch.randint(-20, 21, (n,), generator=g) + 2 ** rank).float()


def _ranks_in(mask: int) -> str:
    return "{" + ", ".join(str(r) for r in range(4) if mask >> r & 1) + "}"


def _decode_sum(got: torch.Tensor, xs: torch.Tensor, rank: int, M: int, L: int) -> str:
    """Which ranks' values each wrong element of this rank's sum holds (``xs``: every rank's data,
    W × n), and what that says about the phases; "" when nothing is wrong."""
    W, n = M * L, xs.shape[1]
    m, local = divmod(rank, L)
    full = xs.sum(0)
    wrong = (got != full).nonzero().flatten().tolist()
    if not wrong:
        return ""
    integral = got == got.round()
    masks = torch.where(integral, got.nan_to_num(0).round().long() % 16,
                        torch.zeros_like(got, dtype=torch.long))
    bits = torch.stack([(masks >> r) & 1 for r in range(W)]).float()          # W × n
    decoded = integral & ((bits * xs).sum(0) == got) & (masks < 2 ** W)
    bad = next((i for i in wrong if not decoded[i]), None)
    if bad is not None:
        return (f"result[{bad}] = {got[bad].item():g} is not a sum of the ranks' values at index "
                f"{bad}, each counted once (one counted twice, or values from another index: a "
                "piece in the wrong place?)")
    mask = {i: int(masks[i]) for i in wrong}
    starts = [0] + torch.tensor([c.numel() for c in torch.empty(n).tensor_split(L)]).cumsum(0).tolist()
    piece = {i: next(j for j in range(L) if starts[j] <= i < starts[j + 1]) for i in wrong}
    node = sum(1 << r for r in range(m * L, m * L + L))
    rail = {j: sum(1 << (mm * L + j) for mm in range(M)) for j in range(L)}
    first = wrong[0]
    holds = f"result[{first}] holds the sum of ranks {_ranks_in(mask[first])} only"
    if M > 1 and all(v == node for v in mask.values()):
        return (f"{holds}, its node's{' (this rank alone)' if L == 1 else ''}: the phase across the "
                "nodes did not run")
    mine = range(starts[local], starts[local + 1])
    if L > 1 and len(mine) and all(piece[i] != local for i in wrong):
        return (f"{holds}; only its own piece (result[{mine.start}:{mine.stop}], place {local} in "
                "the node) was reduced: the all-gather inside the node did not run")
    if L > 1 and M > 1 and all(v == rail[piece[i]] for i, v in mask.items()):
        return (f"{holds}, the ranks with that piece's place on every node: each piece was reduced "
                "across the nodes only: the reduce-scatter inside the node did not run")
    if all(v == 1 << rank for v in mask.values()):
        return f"{holds}, this rank's own value: nothing was reduced"
    return holds


def _divisor(got: torch.Tensor, xs: torch.Tensor) -> float | None:
    """What an average that is wrong was divided by, if one number explains every wrong element."""
    total = xs.sum(0).double()
    keep = total != 0
    if not bool(keep.any()) or bool((got[keep] == 0).any()):
        return None
    ratio = total[keep] / got[keep].double()
    d = float(ratio[0])
    return round(d, 4) if bool(torch.isclose(ratio, torch.full_like(ratio, d), rtol=1e-5).all()) \
        else None


# What a wrong average was divided by, per layout, and why (first match wins: "not divided" comes
# first, since on a layout with one rank per node ÷L is ÷1).
_AVG_MISTAKES = ((lambda M, L: 1, "not divided: 'avg' is the sum divided by W"),
                 (lambda M, L: L, "÷L: averaged over the node only; divide by W = M·L"),
                 (lambda M, L: M, "÷M: averaged over the nodes only; divide by W = M·L"),
                 (lambda M, L: (M * L) ** 2, "divided by W twice"),
                 (lambda M, L: M * L * L, "÷L inside the node and ÷W: divide once"),
                 (lambda M, L: M * M * L, "÷M across the nodes and ÷W: divide once"))


def _avg_words(d: float, M: int, L: int) -> str:
    """Why an average divided by ``d`` on M × L is wrong, in the terms of the layout."""
    said = next((text for rule, text in _AVG_MISTAKES if abs(d - rule(M, L)) < 1e-3), "")
    return f"the sum ÷{d:g}" + (f" ({said})" if said else "") + f", where W = {M * L}"


def _decode_op(got: torch.Tensor, xs: torch.Tensor, op: str, M: int, L: int) -> str:
    """For 'max'/'min': the sum, or the op in one phase and a sum in the other."""
    red = (lambda t, d: t.amax(d)) if op == "max" else (lambda t, d: t.amin(d))
    by_node = xs.reshape(M, L, -1)
    for value, text in ((xs.sum(0), f"the sum, not the {op}: pass op to every ring call"),
                        (red(by_node, 1).sum(0), f"the {op} inside each node, then added across the "
                                                 "nodes: pass op to the all-reduce across too"),
                        (red(by_node.sum(1), 0), f"added inside the node, then the {op} across: "
                                                 "pass op to the reduce-scatter inside the node too")):
        if torch.equal(got, value):
            return text
    return ""


def _decoded(got, x_all: torch.Tensor, op: str, rank: int, M: int, L: int) -> str:
    """A wrong sum decoded into the ranks it holds; a wrong max/min into the phase that added."""
    if not (isinstance(got, torch.Tensor) and got.shape == x_all.shape[1:]
            and got.dtype == torch.float32):
        return ""
    got = got.detach().cpu()
    if op == "sum":
        return _decode_sum(got, x_all, rank, M, L)
    return _decode_op(got, x_all, op, M, L)


def _in_place_problem(t: torch.Tensor, x: torch.Tensor, got) -> str | None:
    """Why the caller's tensor ``t`` (``x`` before the call) does not hold what the call returned."""
    if not isinstance(got, torch.Tensor) or got is t or got.shape != t.shape:
        return None     # nothing returned (the result is t), or a result [result] rejects
    if torch.equal(got, t):
        return None
    if torch.equal(t, x) and not torch.equal(got, x):
        return f"the tensor you were given was not changed — {IN_PLACE}"
    i = int((got != t).nonzero()[0])
    return (f"the tensor you were given holds {t[i].item():g} at [{i}] where you returned "
            f"{got[i].item():g}: a new tensor was made on the way — {IN_PLACE}")


def _reference_groups(rank: int, world: int, L: int, cache: dict):
    """(intra, inter) as Part A's solution makes them; every rank makes every group, in order."""
    mine = []
    M = world // L
    for members in [tuple(range(m * L, m * L + L)) for m in range(M)] + \
                   [tuple(range(l_, world, L)) for l_ in range(L)]:
        if members not in cache:
            cache[members] = dist.new_group(list(members))
        if rank in members:
            mine.append(cache[members])
    return mine[0], mine[1]


class _Spy:
    """``dist.new_group`` while the learner's all-reduce runs: each call counted, the grader's own
    group of those ranks given back (made once: a group per call would leak threads)."""

    def __init__(self, real, world: int, cache: dict):
        self.real, self.world, self.cache, self.calls = real, world, cache, []

    def __call__(self, ranks=None, *args, **kwargs):
        members = tuple(sorted(int(r) for r in (range(self.world) if ranks is None else ranks)))
        self.calls.append(members)
        if members not in self.cache:
            self.cache[members] = self.real(list(members), *args, **kwargs)
        return self.cache[members]


def _all_reduce_rank(rank, world, fns, sizes, op_cases):
    """Every learner function of ``fns`` on every layout of ``world`` ranks, every case: per
    function ``{"fail": [(rule, text)], "inter": {(M, L, n): (bytes, right)}, "made": [...],
    "p2p": bytes sent through minidist's p2p in all, "avg": [(M, L, divisor of a wrong avg)]}``."""
    from minidist.comm import p2p, topology

    cache: dict = {}
    out = [{"fail": [], "inter": {}, "made": [], "p2p": 0, "avg": []} for _ in fns]
    real = dist.new_group
    for M, L in LAYOUTS[world]:
        topology.install(topology.Topology(M, L))        # unshaped: counts bytes per link class
        groups = _reference_groups(rank, world, L, cache)
        spy = _Spy(real, world, cache)                     # a learner's new_group: counted
        calls = spy.calls

        for i, fn in enumerate(fns):
            cases = [("sum", n) for n in sizes] + list(op_cases)
            for op, n in cases:
                x = _data(rank, world, n)
                expected = x.clone()
                dist.all_reduce(expected, op=_TORCH_OPS[op])
                if op == "avg":
                    expected.div_(world)
                t = x.clone()
                del calls[:]
                dist.new_group = spy
                try:
                    with p2p.count_traffic() as sent:
                        got = fn(t, rank, world, L, groups, op)
                except NotImplementedError:
                    raise
                except Exception as e:  # noqa: BLE001 - the learner's bug, reported by its case
                    raise _Crash(f"{_rule_of(op, n, world)}|{_where(M, L)}, {n} element"
                                 f"{'s' if n != 1 else ''}, op={op!r}|"
                                 f"{type(e).__name__}: {e}"[:600]) from e
                finally:
                    dist.new_group = real
                out[i]["p2p"] += sent.bytes_sent
                value = t if got is None else got      # the result: what it returns (it should be t)
                case = f"{_where(M, L)}, {n} element{'s' if n != 1 else ''}, op={op!r}"
                if calls and not out[i]["made"]:
                    out[i]["made"] = [case, list(calls)]
                wrong = compare(value, expected, rank, rtol=1e-6 if op == "avg" else 0.0)
                if wrong:
                    x_all = torch.stack([_data(r, world, n) for r in range(world)])
                    if op == "avg":      # decoded by its divisor, here and over every layout
                        d = _decoded_divisor(value, x_all)
                        out[i]["avg"].append((M, L, d))
                        why = "" if d is None else _avg_words(d, M, L)
                    else:
                        why = _decoded(value, x_all, op, rank, M, L)
                    out[i]["fail"].append((_rule_of(op, n, world),
                                           f"{case}: {wrong}" + (f"; decoded: {why}" if why else "")))
                moved = _in_place_problem(t, x, got)
                if moved:
                    out[i]["fail"].append(("in_place", f"{case}: rank {rank}: {moved}"))
                if op == "sum":     # (bytes, right here): bytes are judged where the sum is right
                    out[i]["inter"][(M, L, n)] = (sent.bytes_sent_inter, not wrong)
    topology.uninstall()
    return out


def _inter_problem(per_rank: list, M: int, L: int, n: int) -> str | None:
    """Why the bytes each rank sent across nodes are not a hierarchical all-reduce's, or None."""
    W = M * L
    total, want_total = sum(per_rank), inter_bytes_total(M, L, n)
    bound = 2 * (M - 1) * math.ceil(math.ceil(n / L) / M) * ITEMSIZE
    if total == want_total and max(per_rank) <= bound:
        return None
    case = f"{_where(M, L)}, {n} element{'s' if n != 1 else ''}"
    want = (f"the hierarchical all-reduce sends 2(M-1)/M · n/L = "
            f"{inter_bytes_per_rank(M, L, n) / ITEMSIZE:g} elements = "
            f"{inter_bytes_per_rank(M, L, n):g} bytes from every rank ({want_total} in all)"
            if n % W == 0 else f"the hierarchical all-reduce sends {want_total} in all, at most "
                               f"{bound} from one rank")
    text = f"{case}: bytes sent across nodes per rank {per_rank} ({total} in all); {want}"
    if total == 0 and want_total:
        return (text + ": nothing crossed the nodes through minidist.comm.p2p — build the phases "
                "from minidist.comm.ring (torch's collectives are neither counted nor shaped)")
    if total == L * want_total and L > 1:
        return text + (": the whole tensor crossed the nodes — across nodes all-reduce only this "
                       "rank's piece, after the reduce-scatter inside the node")
    senders = [[r for r in range(m * L, (m + 1) * L) if per_rank[r]] for m in range(M)]
    if total == want_total and L > 1 and all(len(s) == 1 for s in senders):
        return text + (": a leader scheme — one rank per node sends the whole tensor across. The "
                       "same bytes cross in all, but through one rank's link per node, while its "
                       f"{L - 1} neighbours' links stay idle: on a cluster with one NIC (rail) per "
                       f"GPU that is {L}× the time across. The hierarchical all-reduce gives every "
                       "rank a piece (reduce-scatter inside the node) and each sends only its "
                       "piece across, over its own rail")
    flat = 2 * (W - 1) * n // W * ITEMSIZE
    if sorted(set(per_rank)) == sorted({0, flat}) and M > 1:
        return text + (f": a flat ring's — its {M} ranks at a node boundary send all of their "
                       f"2(W-1)/W · n = {flat} bytes across, the others nothing")
    return text


def _launch(world, fns, sizes, op_cases, timeout):
    from minidist.launch import run
    return run(_all_reduce_rank, world, fns, sizes, op_cases, timeout=timeout)


def _crash_of(e) -> tuple[str, str] | None:
    """``(rule, text)`` of a learner's crash the rank reported (see :class:`_Crash`), else None."""
    for rank, summary, _ in getattr(e, "failures", []):
        m = re.search(r"_Crash: (\w+)\|([^|]*)\|(.*)", summary, re.S)
        if m:
            return m.group(1), (f"rank {rank}, {m.group(2)}: your code raised "
                                f"{m.group(3).strip()}")
    return None


def _decoded_divisor(got, x_all: torch.Tensor) -> float | None:
    ok = isinstance(got, torch.Tensor) and got.shape == x_all.shape[1:] and got.is_floating_point()
    return _divisor(got.detach().cpu().float(), x_all) if ok else None


def _avg_summary(divisors: set) -> str | None:
    """One mistake that explains what every wrong average was divided by, on every layout where
    one was wrong, or None."""
    if not divisors or any(d is None for _, _, d in divisors):
        return None
    for rule, text in _AVG_MISTAKES:
        if all(abs(d - rule(M, L)) < 1e-3 for M, L, d in divisors):
            shown = ", ".join(f"{M}×{L}: ÷{d:g}" for M, L, d in sorted(divisors))
            return f"decoded on the layouts (M × L) where the average is wrong ({shown}): {text}"
    return None


def _not_crossed(inter: dict, judged: set) -> str | None:
    """A plain size on M > 1 nodes where nothing crossed the nodes, though the result was wrong
    there (so not judged by :func:`_inter_problem`): the phase across did not run."""
    for (M, L, n), (per_rank, _) in sorted(inter.items()):
        W = M * L
        if M > 1 and n and n % W == 0 and (M, L, n) not in judged and sum(per_rank) == 0:
            return (f"{_where(M, L)}, {n} elements: bytes sent across nodes per rank {per_rank}; "
                    f"the hierarchical all-reduce sends {inter_bytes_total(M, L, n)} in all: "
                    "nothing crossed the nodes — the phase across the nodes did not run (or went "
                    "through torch's collectives, which are neither counted nor shaped)")
    return None


def grade_all_reduce_many(fns: list, total: float = 4, timeout: float = 60.0,
                          world_sizes=(1, 2, 3, 4), n_generated: int = 6) -> list:
    """One :class:`Report` per function of ``fns``, all run in the same launches (one per world
    size; the tests grade several wrong solutions at once). A crash stops the launch for every
    function in it. Each rule is worth :data:`ALL_REDUCE_POINTS`, scaled to ``total``; a rule that
    cannot be judged apart from another's failure is "not checked" (no points, not ✓)."""
    from minidist.launch import RankTimeoutError

    drawn = [n for n in examples(st.integers(0, 2000), n_generated) if n not in SIZES]
    sizes = list(SIZES) + drawn
    found = [{key: [] for key in ALL_REDUCE_RULES} for _ in fns]
    inter: list = [dict() for _ in fns]
    made: list = [None for _ in fns]
    p2p_bytes: list = [None for _ in fns]     # sent through minidist's p2p on more than one rank
    divisors: list = [set() for _ in fns]     # (M, L, what a wrong average was divided by)
    stop = ""
    for world in world_sizes:
        if stop:
            for f in found:
                for key in f:
                    f[key].append(f"W={world}: not run ({stop}: fix that first)")
            continue
        use, per_rank = sizes, None
        for attempt in range(2):
            try:
                per_rank = _launch(world, fns, use, OP_CASES, timeout)
                break
            except Exception as e:  # noqa: BLE001 - the learner's failure, reported per rule
                crash = _crash_of(e)
                first = getattr(e, "failures", [(0, "", "")])[0][1]
                if isinstance(e, RankTimeoutError):   # every later launch would end the same way
                    stop = f"W={world} timed out"
                elif first.startswith("NotImplementedError"):
                    stop = "NotImplementedError above"
                for f in found:
                    if crash:
                        f[crash[0]].append(f"W={world}: {crash[1]}")
                    else:
                        f["result"].append(f"W={world}: {describe_exception(e)}")
                if crash and crash[0] == "uneven" and attempt == 0:
                    use = [n for n in sizes if not _awkward(n, world)]   # the others still checked
                    continue
                for f in found:     # the rules this launch could not check
                    for key in f:
                        if not any(m.startswith(f"W={world}") for m in f[key]):
                            f[key].append(f"W={world}: not checked: the run failed (see the "
                                          "first failed check)")
                break
        if per_rank is None:
            continue
        for i in range(len(fns)):
            for rank, res in enumerate(per_rank):
                for rule, text in res[i]["fail"]:
                    found[i][rule].append(f"W={world}, {text}")
                if res[i]["made"] and made[i] is None:
                    made[i] = (rank, res[i]["made"])
                if world > 1:
                    p2p_bytes[i] = (p2p_bytes[i] or 0) + res[i]["p2p"]
                divisors[i].update(res[i]["avg"])
            for key in per_rank[0][i]["inter"]:
                inter[i][key] = ([res[i]["inter"][key][0] for res in per_rank],
                                 all(res[i]["inter"][key][1] for res in per_rank))
    reports = []
    name = "Part B: the hierarchical all-reduce against torch.distributed's, under a two-level topology"
    for i, fn in enumerate(fns):
        unchecked: dict = {}     # rule -> why it is not checked
        judged = {key for key, (_, right) in inter[i].items() if right}
        for (M, L, n), (per_rank, _) in sorted(              # plain sizes first
                ((k, v) for k, v in inter[i].items() if k in judged),
                key=lambda kv: (_awkward(kv[0][2], kv[0][0] * kv[0][1]), kv[0][0] * kv[0][1], kv[0])):
            problem = _inter_problem(per_rank, M, L, n)
            if problem:
                found[i]["inter_bytes"].append(problem)
                break
        if not found[i]["inter_bytes"]:
            problem = _not_crossed(inter[i], judged)
            if problem:
                found[i]["inter_bytes"].append(problem)
            elif not any(M > 1 and n for M, L, n in judged):
                unchecked["inter_bytes"] = ("not checked (see [result]): no result on more than one "
                                            "node was right, and bytes are judged where it is")
        summary = _avg_summary(divisors[i])
        if summary and found[i]["op"]:
            found[i]["op"].insert(0, summary)
        if made[i] is not None:
            rank, (case, calls) = made[i]
            found[i]["once"].append(f"rank {rank}, {case}: your call made {len(calls)} group"
                                    f"{'s' if len(calls) != 1 else ''} ({[list(c) for c in calls]}); "
                                    f"make them once with node_groups and pass them in ({LAZY})")
        if found[i]["result"]:       # wrong on the plain sizes too: not the sizes, not the op
            for key in ("uneven", "op"):
                real = [m for m in found[i][key] if "not checked" not in m]
                if real:
                    found[i]["result"] += real
                    found[i][key] = [m for m in found[i][key] if "not checked" in m]
                    unchecked[key] = (f"not checked (see [result]): wrong here too ({len(real)} "
                                      f"case{'s' if len(real) != 1 else ''}), listed there")
        if p2p_bytes[i] == 0:        # torch's collectives: nothing else can be credited
            for key in ALL_REDUCE_RULES:
                if key != "inter_bytes" and not found[i][key]:
                    unchecked[key] = NOT_P2P
        for key, msgs in found[i].items():   # only "the run failed" / "not run": not checked
            if msgs and all(re.match(r"W=\d+: not (checked|run)\b", m) for m in msgs):
                unchecked.setdefault(key, "\n".join(msgs))
                found[i][key] = []
        report = Report(name, total=total, rules=ALL_REDUCE_RULES, default_rule="result",
                        brief_repeats=True)
        for key, text in ALL_REDUCE_RULES.items():
            msgs = found[i][key]
            worth = ALL_REDUCE_POINTS[key]
            if key in unchecked and not msgs:
                report.add(Result(f"[{key}] {text}", False, 0.0, worth, unchecked[key], rule=key,
                                  stop="timeout" if "timed out" in stop else "", not_checked=True))
                continue
            shown = "\n".join(msgs[:3] + ([f"... and {len(msgs) - 3} more"] if len(msgs) > 3 else []))
            report.add(Result(f"[{key}] {text}", not msgs, 0.0 if msgs else worth, worth, shown,
                              stop="timeout" if "timed out" in stop else "", rule=key))
        reports.append(report)
    return reports


def grade_all_reduce(fn, total: float = 4, timeout: float = 60.0) -> Report:
    """``fn(tensor, rank, world_size, ranks_per_node, groups, op)`` on every layout of 1-4 ranks:
    see the module docstring."""
    return grade_all_reduce_many([fn], total=total, timeout=timeout)[0]
