"""``algorithm="auto"``: the algorithm with the lowest predicted time, as NCCL's tuner.

Each algorithm costs ``c_alpha · alpha + c_beta · n · beta`` (Hockney 1994; :func:`coefficients`
counted from the code, alpha and beta fitted per algorithm), measured medians interpolated where
the table has them. The table is the shipped default or this machine's (``minidist bench
alpha-beta --json``; ``MINIDIST_ALPHA_BETA``); the ranks of a group agree on rank 0's.

Design notes: docs/design/ground.md"""

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
    all-gather's output); the table is in docs/design/ground.md. ValueError for an unknown pair."""
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
    """Fits ``{(op, algorithm, world_size): (alpha s, beta s/byte)}``, their ``sources`` (op -> file)
    and the measured medians ``points`` (``{key: ((bytes, median s), ...)}``, ascending; may be empty)."""

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
        """Predicted seconds: measured medians interpolated in log-log between two measured sizes;
        beyond them :meth:`model` scaled to the nearest median; without measurements, :meth:`model`."""
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
        """The candidate with the lowest predicted time (ties: the first, the op's default)."""
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
    """(fits, points) of a ``minidist-alpha-beta/1`` file; ValueError if it is not a valid one."""
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
    """The shipped default, each op taken from ``path`` (default :func:`machine_table_path`) where
    it measured every candidate; warns and keeps the default if that table is corrupt or missing."""
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
    """The table every rank of ``group`` uses: group rank 0's, broadcast once per group."""
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
    ``debug`` prints the choice and each candidate's predicted time. Cached per group and size
    (:func:`reset_cache`)."""
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
