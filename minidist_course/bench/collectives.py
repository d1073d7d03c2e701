"""nccl-tests-style benchmark of minidist's collectives against torch's, measured in the same run.

Definitions (nccl-tests, doc/PERFORMANCE.md):

* ``size`` is the total buffer in bytes (for reduce-scatter the input, for all-gather the output;
  each rank's piece is size / W);
* ``algbw = size / time`` (GB/s, 1 GB = 1e9 bytes);
* ``busbw = algbw × factor``: factor = 2(W-1)/W for all-reduce, (W-1)/W for reduce-scatter and
  all-gather, 1 for broadcast and reduce. busbw is comparable across W: it is the bandwidth each
  link must sustain, so an optimal algorithm's busbw approaches the link bandwidth.

Each measurement: the input is refilled, ranks meet at a barrier, then k calls run back to back and
are timed together (time = total / k, as nccl-tests times a loop of iterations); ``time_s`` is the
median over iterations of the slowest rank's time. k is chosen once per size, the same for every
algorithm: enough calls for a measurement of at least ``SAMPLE_S`` (2 ms), at most 32 (k = 1 from
about 1 MiB here). Why: a single call timed right after a barrier also pays for waking every
thread of the rank, the gloo threads' as well; that start-up is most of a 1 KiB call and varies
with the scheduler, while a training step issues its collectives back to back (DDP's buckets).
Algorithms alternate iteration by iteration, in a balanced order (:func:`balanced_order`: each
in every position and after every other equally often), so the ratio to torch is measured under
the same conditions, and a size's iterations are spread over ``ROUNDS`` (4) passes through all sizes:
on two cores shared by the ranks and their gloo threads there are slow spells of some hundred
milliseconds in which a hand-built collective's calls take several times longer while torch's,
alternating with them, do not (measured at 16 KiB: runs of 20 iterations at up to 6x the run's
median; a rank's threads all pinned to one core made its calls about 10x slower). A spell is
longer than all of a small size's measurements together; spread out, it takes a share of
several sizes' iterations instead of one size's whole median (``minidist bench alpha-beta``
spreads its repetitions the same way). The price: every size's buffers are alive at once (for
all-reduce up to 64 MiB with every algorithm at W=4, about 0.7 GB per rank). Every result is
also checked after the timing (one call on a fresh input; the ``wrong`` column, as nccl-tests'
``#wrong``).

The **control** row, ``torch-again``, is torch's own collective timed a second time as if it
were another algorithm (an A/A test). Its "vs torch" would be 1.00 on a quiet machine; what it
is instead is this run's noise: a ratio inside the control's spread does not tell the two
apart. The table's footer prints that spread per world size.

The **point-to-point ceiling** is timed in the same alternation: one ``isend`` to the right
neighbour and one ``irecv`` from the left per rank, of the elements a ring moves per rank
(:func:`ceiling_elements`: busbw factor × N, e.g. 2(W-1)/W · N for all-reduce), as ONE message —
no steps, no reductions, no Python between chunks. ``of_ceiling`` = ceiling time / the
algorithm's time: the fraction of what the transport itself delivers to this traffic that the
algorithm achieves (1.0 = nothing lost to steps, additions, copies or scheduling). The latency-bandwidth (alpha-beta) model
``time = alpha + beta · bytes`` is fitted by least squares (Hockney 1994; Thakur et al. 2005).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from minidist import collectives as C
from minidist.comm import tuner
from minidist.launch import run

__all__ = ["run_bench", "busbw_factor", "ALGORITHMS", "OPS", "parse_size", "ceiling_elements",
           "CEILING", "CONTROL", "balanced_order"]

CEILING = "p2p"  # the name of the point-to-point ceiling's timings (not an algorithm of any op)
# torch's own collective timed a second time as if it were another algorithm (an A/A control):
# its ratio to torch would be 1.00 on a quiet machine, so its spread is the run's noise floor
CONTROL = "torch-again"

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
# per op: torch's built-in (the reference), the control, every hand-built algorithm the library
# offers, and "auto" (the tuner's choice per size: minidist.comm.tuner; its row names what it ran)
ALGORITHMS = {op: ("torch", CONTROL, *C.ALGORITHMS[op],
                   *((C.AUTO,) if op in tuner.CANDIDATES else ())) for op in OPS}


def busbw_factor(op: str, world_size: int) -> float:
    """nccl-tests' bus-bandwidth factor for ``op`` at ``world_size`` ranks."""
    w = world_size
    return {"all_reduce": 2 * (w - 1) / w, "reduce_scatter": (w - 1) / w,
            "all_gather": (w - 1) / w, "broadcast": 1.0, "reduce": 1.0}[op]


def ceiling_elements(op: str, numel: int, world_size: int) -> int:
    """Elements each rank sends to its right neighbour (and receives from its left) in the
    point-to-point ceiling of ``op`` on ``numel`` elements: what a ring moves per rank.

    all-reduce 2(W-1)/W · N (reduce-scatter then all-gather), reduce-scatter and all-gather
    (W-1)/W · N, broadcast N (a pipelined chain forwards the whole buffer once); computed from the
    ring's W pieces of ``tensor_split`` so that it is exact when W does not divide N. Raises
    ValueError for an unknown op or world_size < 1.
    """
    if world_size < 1:
        raise ValueError(f"ceiling_elements: world_size must be >= 1, got {world_size}")
    if op not in ("all_reduce", "reduce_scatter", "all_gather", "broadcast"):
        raise ValueError(f"ceiling_elements: unknown op {op!r}")
    if op == "broadcast":
        return numel if world_size > 1 else 0
    pieces = [numel // world_size + (i < numel % world_size) for i in range(world_size)]
    per_phase = numel - min(pieces)  # W-1 steps; the rank skips one piece (the smallest bound)
    return 2 * per_phase if op == "all_reduce" else per_phase


def _ceiling_op(op: str, nbytes: int, rank: int, world: int):
    """(prepare, call, check) of the point-to-point ceiling for one (op, size): one isend to the
    right, one irecv from the left, of ceiling_elements(...) float32 elements."""
    n = max(nbytes // 4 // world * world, world)
    m = ceiling_elements(op, n, world)
    send, recv = torch.full((m,), float(rank)), torch.empty(m)
    right, left = (rank + 1) % world, (rank - 1) % world

    def call():
        if m:
            works = [dist.irecv(recv, left), dist.isend(send, right)]
            for w in works:
                w.wait()

    check = lambda: (recv - left).abs().max().item() if m else 0.0  # noqa: E731
    return (lambda: None), call, check


def parse_size(text: str) -> int:
    """``"64M"`` -> 67108864; accepts K, M, G (binary) and plain integers (bytes)."""
    text = text.strip().upper().rstrip("B").rstrip("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if mult > 1 else text) * mult)


def _one_op(op: str, algorithm: str, nbytes: int, rank: int, world: int):
    """Return (prepare, call, check) closures for one measurement (float32 buffers)."""
    algorithm = "torch" if algorithm == CONTROL else algorithm
    n = max(nbytes // 4 // world * world, world)  # elements, divisible by W
    piece = n // world
    if op == "all_reduce":
        t = torch.empty(n)
        prep = lambda: t.fill_(rank + 1)  # noqa: E731
        call = (lambda: dist.all_reduce(t)) if algorithm == "torch" else \
            (lambda: C.all_reduce(t, algorithm=algorithm))
        check = lambda: (t - world * (world + 1) / 2).abs().max().item()  # noqa: E731
    elif op == "reduce_scatter":
        inp, out = torch.empty(n), torch.empty(piece)
        src = torch.arange(n, dtype=torch.float32).remainder_(1000).add_(rank)
        prep = lambda: inp.copy_(src)  # noqa: E731
        if algorithm == "torch":
            call = lambda: dist.reduce_scatter(out, list(inp.split(piece)))  # noqa: E731
        else:
            call = lambda: C.reduce_scatter(out, inp, algorithm=algorithm)  # noqa: E731
        want = (torch.arange(n, dtype=torch.float32).remainder_(1000) * world
                + world * (world - 1) / 2).split(piece)[rank]
        check = lambda: (out - want).abs().max().item()  # noqa: E731
    elif op == "all_gather":
        inp, out = torch.full((piece,), float(rank)), torch.empty(n)
        prep = lambda: out.zero_()  # noqa: E731
        if algorithm == "torch":
            call = lambda: dist.all_gather(list(out.split(piece)), inp)  # noqa: E731
        else:
            call = lambda: C.all_gather(out, inp, algorithm=algorithm)  # noqa: E731
        want = torch.arange(world, dtype=torch.float32).repeat_interleave(piece)
        check = lambda: (out - want).abs().max().item()  # noqa: E731
    elif op == "broadcast":
        t = torch.empty(n)
        prep = lambda: t.fill_(7.0 if rank == 0 else -1.0)  # noqa: E731
        call = (lambda: dist.broadcast(t, 0)) if algorithm == "torch" else \
            (lambda: C.broadcast(t, 0, algorithm=algorithm))
        check = lambda: (t - 7.0).abs().max().item()  # noqa: E731
    else:
        raise ValueError(f"unknown op {op!r}; choose from {OPS}")
    return prep, call, check


SAMPLE_S = 2e-3      # a measurement lasts at least this long: k calls back to back ...
MAX_BACK_TO_BACK = 32   # ... but at most this many (a sum all-reduce grows W-fold per call)


def _calls_per_sample(single_s: float) -> int:
    """k, the calls timed together in one measurement, from the time of one call (seconds)."""
    return max(1, min(MAX_BACK_TO_BACK, int(SAMPLE_S / max(single_s, 1e-9)) + 1))


def _bench_rank(rank, world, plan, iters, warmup, rounds=1):
    """Time every algorithm of one (op, size) in alternation, iteration by iteration in the rows
    of :func:`balanced_order`, so that a load spike on a shared machine hits all of them alike
    and the ratio stays fair.
    Each measurement: refill, barrier, then k calls back to back timed together (k from the
    fastest algorithm's single call in the warm-up, the same for every algorithm and rank).
    The ``iters`` measurements of a size are spread over ``rounds`` passes through all sizes, so
    that a slow spell of the scheduler (which lasts longer than a small size's measurements)
    lands on several sizes in part instead of on one size whole."""
    groups: dict = {}
    for op, algorithm, nbytes in plan:
        groups.setdefault((op, nbytes), []).append(algorithm)
    state = {}
    for (op, nbytes), algorithms in groups.items():   # warm-up: its single calls choose k
        closures = {a: _one_op(op, a, nbytes, rank, world) for a in algorithms}
        if world > 1:  # the point-to-point ceiling, timed in the same alternation
            closures[CEILING] = _ceiling_op(op, nbytes, rank, world)
        single = [_measure(prep, call, 1) for _ in range(max(1, warmup))
                  for prep, call, _ in closures.values()]
        agreed = torch.tensor([_calls_per_sample(min(single))])
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)   # every rank takes the largest k
        state[(op, nbytes)] = (closures, {a: [] for a in closures}, int(agreed.item()))
    rounds = max(1, min(rounds, iters))
    done = {key: 0 for key in state}   # a size's iterations so far: its row of the design
    for r in range(rounds):
        for key, (closures, times, k) in state.items():
            for _ in range(iters // rounds + (r < iters % rounds)):
                for a in balanced_order(list(closures), done[key]):
                    prep, call, _ = closures[a]
                    times[a].append(_measure(prep, call, k))
                done[key] += 1
    rows = []
    for (op, nbytes), (closures, times, k) in state.items():
        for a, (prep, call, check) in closures.items():
            prep()          # the check looks at one call's result
            call()
            t = torch.tensor(times[a] + [check()], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # slowest rank per iteration, worst error
            rows.append(dict(op=op, algorithm=a, world_size=world, bytes=nbytes,
                             time_s=statistics.median(t[:-1].tolist()), max_error=t[-1].item(),
                             calls_per_sample=k, rounds=rounds))
    return rows


def balanced_order(names: list, i: int) -> list:
    """The order of iteration ``i``: row ``i`` of a Williams design (a Latin square balanced for
    carry-over; E. J. Williams, Aust. J. Sci. Res. A 2 (1949) 149-168), the same on every rank.
    Over one cycle — len(names) iterations, twice that for an odd count — every algorithm runs
    equally often in every position, and right after every other algorithm equally often.

    Why both: neither the position nor the predecessor is neutral. Measured here with torch timed
    twice as two algorithms (W=2, 40 iterations, fixed order): the one right after the
    point-to-point ceiling took up to 1.3-1.8x the other's median at 16-64 KiB, whichever of the
    two it was; and a plain rotation keeps who-follows-whom, so it keeps that bias. Rows: the
    sequence 0, 1, n-1, 2, n-2, ... shifted by the row, and for odd n also reversed."""
    n = len(names)
    if n == 0:
        return []
    base, lo, hi = [0], 1, n - 1
    while len(base) < n:
        base.append(lo)
        lo += 1
        if len(base) < n:
            base.append(hi)
            hi -= 1
    cycle = n if n % 2 == 0 else 2 * n
    r = i % cycle
    row = [names[(b + r) % n] for b in base]
    return row[::-1] if r >= n else row


def _measure(prep, call, k: int) -> float:
    """Refill, barrier, then ``k`` calls back to back: seconds per call."""
    prep()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(k):
        call()
    return (time.perf_counter() - t0) / k


ROUNDS = 4   # passes through all sizes that share a size's measurements (fewer if iters < 4)


def run_bench(ops=OPS, algorithms=None, world_sizes=(2, 4), sizes=None, iters: int = 5,
              warmup: int = 1, timeout: float = 600.0, progress: bool = True,
              rounds: int = ROUNDS) -> list[dict]:
    """Measure ``ops`` x ``algorithms`` x ``world_sizes`` x ``sizes`` (bytes) and return rows.

    Each row: op, algorithm (``"auto"``: the tuner's choice, named in ``chosen``), world_size,
    bytes, time_s (median of the slowest rank), algbw_GBps,
    busbw_GBps, ratio_to_torch (busbw / torch's busbw for the same op, W and size; 1.0 for torch),
    ceiling_s (the point-to-point ceiling's time, same run; NaN at W=1), of_ceiling (ceiling_s /
    time_s), max_error and wrong (max_error above 1e-3 relative, which would be a bug).
    The ceiling's own timings are not rows: they are the ``ceiling_s`` of every row.
    """
    from tqdm.auto import tqdm

    sizes = list(sizes or [1 << k for k in range(10, 27, 2)])  # 1 KiB .. 64 MiB
    jobs = [(w, op) for w in world_sizes for op in ops]
    rows = []
    for w, op in tqdm(jobs, desc="bench", disable=not progress, leave=False):
        algs = [a for a in (algorithms or ALGORITHMS[op]) if a in ALGORITHMS[op]]
        plan = [(op, a, s) for s in sizes for a in algs]
        rows += run(_bench_rank, w, plan, iters, warmup, rounds, timeout=timeout)[0]
    ceiling = {(r["op"], r["world_size"], r["bytes"]): r for r in rows if r["algorithm"] == CEILING}
    for r in ceiling.values():
        if r["max_error"] > 0:
            raise RuntimeError(f"bench: the point-to-point ceiling of {r['op']} at W="
                               f"{r['world_size']} received wrong data (error {r['max_error']})")
    rows = [r for r in rows if r["algorithm"] != CEILING]
    for r in rows:   # what auto ran: the tuner's choice for the buffer _one_op builds
        if r["algorithm"] == C.AUTO:
            w = r["world_size"]
            r["chosen"] = tuner.table().choose(r["op"], w, 4 * max(r["bytes"] // 4 // w * w, w))
    torch_time = {(r["op"], r["world_size"], r["bytes"]): r["time_s"]
                  for r in rows if r["algorithm"] == "torch"}
    for r in rows:
        c = ceiling.get((r["op"], r["world_size"], r["bytes"]))
        r["ceiling_s"] = c["time_s"] if c else float("nan")
        r["of_ceiling"] = r["ceiling_s"] / r["time_s"]
        r["algbw_GBps"] = r["bytes"] / r["time_s"] / 1e9
        r["busbw_GBps"] = r["algbw_GBps"] * busbw_factor(r["op"], r["world_size"])
        ref = torch_time.get((r["op"], r["world_size"], r["bytes"]))
        r["ratio_to_torch"] = ref / r["time_s"] if ref else float("nan")
        r["wrong"] = r["max_error"] > 1e-3 * max(1.0, r["world_size"] ** 2)
    return rows
