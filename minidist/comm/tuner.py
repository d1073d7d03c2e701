"""``algorithm="auto"``: the algorithm with the lowest predicted time, as NCCL's tuner.

NCCL does not run one algorithm. At start-up its tuner (``ncclTopoTuneModel``, src/graph/tuning.cc)
fills, per collective, algorithm (Ring, Tree, ...) and protocol, a latency (a base latency plus
one hardware latency per step) and a bandwidth; each call then takes the algorithm and protocol
with the lowest ``latency + bytes / bandwidth`` for its size (``NCCL_ALGO`` restricts the choice).
minidist does the same with its own algorithms and the alpha-beta model (Hockney 1994): each
algorithm costs ``c_alpha · alpha + c_beta · n · beta`` for an n-byte buffer on W ranks, the
coefficients counted from what the implementation in :mod:`minidist.comm` sends along its longest
chain of dependent messages (:func:`coefficients`; ``tests/library/comm/test_tuner.py`` checks them against the
traffic counters), and ``alpha`` (s), ``beta`` (s/byte) fitted per algorithm, so that each
algorithm's own per-message overhead is in its alpha, like NCCL's per-algorithm base latency.
Where the table holds the medians it was fitted to (every ``bench alpha-beta`` table does), a
prediction between two measured sizes interpolates them (:meth:`Table.predict`), as Open MPI's
coll/tuned and MPICH's tuning files choose from measured size ranges; the model fills the rest.

The table of fits (the JSON of ``minidist bench alpha-beta``, format ``minidist-alpha-beta/1``):

* **the default**, shipped with the library (``alpha_beta_default.json`` beside this file: gloo
  on loopback, measured on the machine the library was developed on, its load recorded);
* **this machine's**, written by ``minidist bench alpha-beta --json`` to :func:`machine_table_path`
  (``$MINIDIST_ALPHA_BETA``, else ``$XDG_CACHE_HOME/minidist/alpha_beta.json``, else
  ``~/.cache/minidist/alpha_beta.json``). An op's fits come from it when it has every algorithm of
  that op, else from the default. ``MINIDIST_ALPHA_BETA=default`` uses the shipped table only
  (the test suite does, so that its results do not depend on a learner's measurement). Reset:
  ``minidist bench alpha-beta --reset``, or delete the file. A named table that is missing, or a
  corrupt one, falls back to the default with a warning. Tables are read once per process.

A world size the table lacks uses the fit of the nearest measured one (the formulas carry W)
and no medians.
Ranks agree on one table per process group (group rank 0's, at the group's first ``auto`` call),
so machines with different tables still choose alike. ``MINIDIST_DEBUG=1`` prints each choice.
While a two-level topology is installed (:mod:`minidist.comm.topology`), ``auto`` asks
:mod:`minidist.comm.tuner_topology` instead: each link class's emulated cost added, and
``hierarchical`` among the candidates.
"""

from __future__ import annotations

import json
import math
import os
import sys
import warnings
import weakref
from pathlib import Path

__all__ = ["CANDIDATES", "ENV", "FORMAT", "DEFAULT_TABLE", "Table", "coefficients", "predict",
           "machine_table_path", "load_table", "table", "choose", "agreed_table", "reset_cache",
           "RING_BROADCAST_SEGMENT"]

FORMAT = "minidist-alpha-beta/1"
ENV = "MINIDIST_ALPHA_BETA"
DEFAULT_TABLE = Path(__file__).with_name("alpha_beta_default.json")
RING_BROADCAST_SEGMENT = 1 << 18   # elements per segment of ring.broadcast (its default)
# the algorithms auto chooses among, per op; the first is the tie-break (and the op's default)
CANDIDATES = {"all_reduce": ("ring", "recursive_doubling", "naive"),
              "reduce_scatter": ("ring", "naive"), "all_gather": ("ring", "naive"),
              "broadcast": ("tree", "ring", "naive")}


def coefficients(op: str, algorithm: str, world: int, nbytes: float = 0,
                 itemsize: int = 4) -> tuple[float, float]:
    """(c_alpha, c_beta) of ``time = c_alpha·alpha + c_beta·n·beta`` for ``op`` by ``algorithm``
    on ``world`` ranks and an ``nbytes`` buffer (the whole buffer: reduce-scatter's input,
    all-gather's output). Counted from the code (p = floor(log2 W), P = ceil(log2 W)):

    =====================================  ======================  ==========================
    op / algorithm                         c_alpha                 c_beta
    =====================================  ======================  ==========================
    all_reduce / ring                      2(W-1)                  2(W-1)/W
    all_reduce / recursive_doubling        p (+2 if W != 2^p)      same as c_alpha
    all_reduce / naive (via rank 0)        2(W-1)                  2(W-1)
    reduce_scatter, all_gather / ring      W-1                     (W-1)/W
    reduce_scatter, all_gather / naive     1 (all posted at once)  (W-1)/W
    broadcast / tree (binomial)            P                       P
    broadcast / naive                      1 (all posted at once)  W-1
    broadcast / ring (chain, S segments)   W-2+S                   (W-2+S)/S
    =====================================  ======================  ==========================

    Recursive doubling off a power of two adds the fold (an even rank hands its data to the odd
    one above) and the hand-back; naive all-reduce's rank 0 receives W-1 whole buffers, then
    sends W-1. ValueError for an unknown pair.
    """
    if (w := world) <= 1:
        return 0.0, 0.0
    if (op, algorithm) == ("all_reduce", "ring"):
        return 2.0 * (w - 1), 2 * (w - 1) / w
    if (op, algorithm) == ("all_reduce", "recursive_doubling"):
        p = w.bit_length() - 1
        k = p + (2 if w != 1 << p else 0)
        return float(k), float(k)
    if (op, algorithm) == ("all_reduce", "naive"):
        return 2.0 * (w - 1), 2.0 * (w - 1)
    if op in ("reduce_scatter", "all_gather") and algorithm == "ring":
        return float(w - 1), (w - 1) / w
    if op in ("reduce_scatter", "all_gather") and algorithm == "naive":
        return 1.0, (w - 1) / w
    if (op, algorithm) == ("broadcast", "tree"):
        k = (w - 1).bit_length()
        return float(k), float(k)
    if (op, algorithm) == ("broadcast", "naive"):
        return 1.0, float(w - 1)
    if (op, algorithm) == ("broadcast", "ring"):
        s = max(1, math.ceil(nbytes / (RING_BROADCAST_SEGMENT * itemsize)))
        return float(w - 2 + s), (w - 2 + s) / s
    raise ValueError(f"tuner: no alpha-beta model for {op}/{algorithm}; models exist for "
                     + ", ".join(f"{o}/{a}" for o, algs in CANDIDATES.items() for a in algs))


def predict(op: str, algorithm: str, world: int, nbytes: float, alpha: float, beta: float,
            itemsize: int = 4) -> float:
    """Predicted seconds of ``op`` by ``algorithm`` for ``nbytes`` on ``world`` ranks."""
    ca, cb = coefficients(op, algorithm, world, nbytes, itemsize)
    return ca * alpha + cb * nbytes * beta


class Table:
    """Fits ``{(op, algorithm, world_size): (alpha s, beta s/byte)}``, where they came from
    (``sources``: op -> file) and the measured medians the fits were made from (``points``:
    ``{(op, algorithm, world_size): ((bytes, median s), ...)}`` ascending; may be empty).
    :meth:`predict` and :meth:`choose` answer for any world size."""

    def __init__(self, fits: dict, sources: dict | None = None, points: dict | None = None):
        self.fits = dict(fits)
        self.sources = dict(sources or {})
        self.points = {k: tuple(sorted((float(n), float(t)) for n, t in v))
                       for k, v in (points or {}).items() if v}
        self._choices: dict = {}

    def alpha_beta(self, op: str, algorithm: str, world: int) -> tuple[float, float]:
        """The fit at ``world``, else at the nearest measured world size (ties: the smaller)."""
        sizes = [w for (o, a, w) in self.fits if (o, a) == (op, algorithm)]
        if not sizes:
            raise KeyError(f"tuner: the table has no fit of {op}/{algorithm}")
        best = min(sizes, key=lambda w: (abs(w - world), w))
        return self.fits[(op, algorithm, best)]

    def model(self, op: str, algorithm: str, world: int, nbytes: float, itemsize: int = 4) -> float:
        """The alpha-beta model's seconds (see :func:`predict`) with this table's alpha and beta."""
        return predict(op, algorithm, world, nbytes, *self.alpha_beta(op, algorithm, world), itemsize)

    def predict(self, op: str, algorithm: str, world: int, nbytes: float, itemsize: int = 4) -> float:
        """Predicted seconds: between two measured sizes at this world size, the measured medians
        interpolated in log-log; beyond them, :meth:`model` scaled to meet the nearest median; a
        world size without measurements, :meth:`model` alone.

        Why not the model alone: a straight line fitted to an algorithm's whole range of sizes is
        off by a few percent at a given size, which swaps two algorithms whose lines nearly cross
        there (chapter 03, section 5 lists the measured sizes where the table in use chooses
        differently by lines and by medians). Open MPI's coll/tuned and MPICH's tuning files
        likewise choose from measured size ranges, not from a formula.
        """
        m = self.model(op, algorithm, world, nbytes, itemsize)
        pts = self.points.get((op, algorithm, world))
        if not pts or world <= 1:
            return m
        if nbytes <= pts[0][0] or nbytes >= pts[-1][0]:
            n0, t0 = pts[0] if nbytes <= pts[0][0] else pts[-1]
            at = self.model(op, algorithm, world, n0, itemsize)
            return m * t0 / at if at > 0 else t0
        i = next(i for i in range(1, len(pts)) if nbytes <= pts[i][0])
        (n0, t0), (n1, t1) = pts[i - 1], pts[i]
        f = math.log(nbytes / n0) / math.log(n1 / n0)
        return math.exp(math.log(t0) + f * (math.log(t1) - math.log(t0)))

    def choose(self, op: str, world: int, nbytes: int, itemsize: int = 4) -> str:
        """The candidate (:data:`CANDIDATES`) with the lowest predicted time; ties (W = 1, or an
        empty buffer on a table without latency) go to the first, the op's default."""
        key = (op, world, nbytes, itemsize)
        hit = self._choices.get(key)
        if hit is None:
            times = {a: self.predict(op, a, world, nbytes, itemsize) for a in CANDIDATES[op]}
            hit = min(CANDIDATES[op], key=lambda a: times[a])   # min keeps the first of equals
            self._choices[key] = hit
        return hit

    def to_json(self) -> dict:
        return {"fits": [[o, a, w, al, be] for (o, a, w), (al, be) in sorted(self.fits.items())],
                "sources": self.sources,
                "points": [[o, a, w, [list(p) for p in v]] for (o, a, w), v in sorted(self.points.items())]}

    @classmethod
    def from_json(cls, d: dict) -> "Table":
        return cls({(o, a, int(w)): (float(al), float(be)) for o, a, w, al, be in d["fits"]},
                   d.get("sources"), {(o, a, int(w)): v for o, a, w, v in d.get("points", [])})


def machine_table_path() -> Path:
    """Where ``minidist bench alpha-beta --json`` writes this machine's table, and auto reads it."""
    env = os.environ.get(ENV)
    if env and env != "default":
        return Path(env).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "minidist" / "alpha_beta.json"


def _read(path: Path) -> tuple[dict, dict]:
    """({(op, algorithm, W): (alpha, beta)}, {(op, algorithm, W): [(bytes, median s), ...]}) of a
    ``minidist-alpha-beta/1`` file; ValueError if it is not one (unreadable JSON, another format,
    a fit without finite non-negative values, a measured point that is not positive, two of one
    size)."""
    try:
        with open(path) as f:
            doc = json.load(f)
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ValueError(f"format {doc.get('format') if isinstance(doc, dict) else None!r}, "
                             f"expected {FORMAT!r}")
        fits, points = {}, {}
        for fit in doc["fits"]:
            alpha, beta = float(fit["alpha"]), float(fit["beta"])
            name = f"{fit['op']}/{fit['algorithm']}"
            if not (math.isfinite(alpha) and math.isfinite(beta) and alpha >= 0 and beta >= 0):
                raise ValueError(f"fit {name} has alpha={alpha}, beta={beta}")
            key = (str(fit["op"]), str(fit["algorithm"]), int(fit["world_size"]))
            fits[key] = (alpha, beta)
            pts = [(float(p["bytes"]), float(p["median_s"])) for p in fit.get("points", [])]
            if any(not (0 < v < math.inf) for p in pts for v in p):
                raise ValueError(f"fit {name} has a measured point that is not positive: {pts}")
            if len({n for n, _ in pts}) < len(pts):
                raise ValueError(f"fit {name} has two measured points of one size: {pts}")
            points[key] = pts
        return fits, points
    except (OSError, KeyError, TypeError, ValueError) as e:   # JSONDecodeError is a ValueError
        raise ValueError(f"{path}: not a usable alpha-beta table ({type(e).__name__}: {e})") from e


def load_table(path: str | os.PathLike | None = None) -> Table:
    """The shipped default, with each op whose every candidate this machine's table (``path``,
    default :func:`machine_table_path`) measured taken from it. Warns and keeps the default when
    that table is corrupt, or missing although named by ``$MINIDIST_ALPHA_BETA``."""
    fits, points = _read(DEFAULT_TABLE)
    sources = {op: "default" for op in CANDIDATES}
    if path is None and os.environ.get(ENV) == "default":
        return Table(fits, sources, points)
    named = path is not None or bool(os.environ.get(ENV))
    where = Path(path) if path is not None else machine_table_path()
    if not where.exists():
        if named:
            warnings.warn(f"minidist tuner: no alpha-beta table at {where}; using the default "
                          f"table shipped with minidist (measure this machine with `minidist "
                          f"bench alpha-beta --json`)", RuntimeWarning, stacklevel=2)
        return Table(fits, sources, points)
    try:
        mine, my_points = _read(where)
    except ValueError as e:
        warnings.warn(f"minidist tuner: {e}; using the default table shipped with minidist "
                      f"(`minidist bench alpha-beta --reset` removes it)", RuntimeWarning,
                      stacklevel=2)
        return Table(fits, sources, points)
    for op, algs in CANDIDATES.items():
        if all(any((o, a) == (op, alg) for o, a, _ in mine) for alg in algs):
            fits = {k: v for k, v in fits.items() if k[0] != op}
            fits.update({k: v for k, v in mine.items() if k[0] == op})
            points = {k: v for k, v in points.items() if k[0] != op}
            points.update({k: v for k, v in my_points.items() if k[0] == op})
            sources[op] = str(where)
    return Table(fits, sources, points)


_cache: dict = {}
_agreed: dict = {}
_printed: set = set()


def table() -> Table:
    """:func:`load_table` of the current ``$MINIDIST_ALPHA_BETA`` setting, read once per process."""
    key = os.environ.get(ENV) or str(machine_table_path())
    hit = _cache.get(key)
    if hit is None:
        hit = _cache[key] = load_table()
    return hit


def reset_cache() -> None:
    """Forget the tables read and agreed (after writing a new machine table in this process)."""
    _cache.clear()
    _agreed.clear()
    _chosen.clear()


def agreed_table(group=None) -> Table:
    """The table every rank of ``group`` uses: group rank 0's, broadcast at the first call per
    group (a pickled dict, once), so that ranks whose machines measured different tables still
    choose the same algorithm (different choices would deadlock)."""
    import torch.distributed as dist

    mine = table()
    if dist.get_world_size(group) == 1:
        return mine
    key = ((group.group_name if group is not None else "world"), id(mine))
    hit = _agreed.get(key)
    if hit is None:
        box = [mine.to_json()]
        src = 0 if group is None else dist.get_global_rank(group, 0)
        dist.broadcast_object_list(box, src=src, group=group)
        hit = _agreed[key] = mine if box[0] == mine.to_json() else Table.from_json(box[0])
    return hit


_chosen: dict = {}   # (id(group), op, W, nbytes, itemsize) -> (weakref to group, algorithm): the hot path


def choose(op: str, world: int, nbytes: int, itemsize: int = 4, group=None,
           debug: bool = False) -> str:
    """The algorithm ``auto`` runs for ``op`` on an ``nbytes`` buffer over ``group`` (W = ``world``);
    with ``debug``, prints the choice and every candidate's predicted time (once per size).
    Choices are remembered per process group and size (:func:`reset_cache` forgets them): every
    DDP bucket asks again each step, and the lookups behind a first answer (the table's file
    name from the environment, the group's agreement) cost more than a message of a few KiB."""
    import torch.distributed as dist

    pg = group if group is not None else dist.GroupMember.WORLD
    key = (id(pg), op, world, nbytes, itemsize)
    hit = _chosen.get(key)
    if hit is not None and hit[0]() is pg and not debug:
        return hit[1]
    t = agreed_table(group) if world > 1 else table()
    algorithm = t.choose(op, world, nbytes, itemsize)
    if len(_chosen) > 4096:   # many groups or sizes: start over rather than grow
        _chosen.clear()
    ref = weakref.ref(pg) if isinstance(pg, dist.ProcessGroup) else (lambda: pg)
    _chosen[key] = (ref, algorithm)   # weak: a dropped group's threads can go
    printed = (os.getpid(), id(t), op, world, nbytes, itemsize)   # this process's (a fork inherits)
    if debug and printed not in _printed:
        _printed.add(printed)
        times = ", ".join(f"{a} {t.predict(op, a, world, nbytes, itemsize) * 1e6:.0f} us"
                          for a in CANDIDATES[op])
        print(f"minidist auto: {op} of {nbytes} B on {world} ranks -> {algorithm} (predicted "
              f"{times}; fits from {t.sources.get(op, 'default')})", file=sys.stderr, flush=True)
    return algorithm
