"""A two-level cluster on one machine: ranks grouped into nodes, two classes of link, and a
software shaper that makes the slow class slow.

A :class:`Topology` puts ``nodes × ranks_per_node`` ranks on nodes and gives the ``"intra"`` and
``"inter"`` links an alpha-beta cost. Install it (``install("2x2:inter=1e-4,2e8")``, ``use(...)``
or ``MINIDIST_TOPOLOGY``) before :func:`minidist.run`; :func:`pace` then delays each of minidist's
own sends until its link is free (after NCCL's ``src/graph/topo.cc``, ``tuning.cc``).

Design notes: docs/design/ground.md"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
import weakref
from dataclasses import dataclass, field

import torch.distributed as dist

__all__ = ["ENV", "Link", "Topology", "install", "uninstall", "use", "current", "reload", "link",
           "pace", "global_rank", "state"]

ENV = "MINIDIST_TOPOLOGY"
CLASSES = ("intra", "inter")


@dataclass(frozen=True)
class Link:
    """One class of link: ``alpha`` s per message, ``bandwidth`` B/s (``Link()``: unshaped)."""

    alpha: float = 0.0
    bandwidth: float = math.inf

    def __post_init__(self):
        if not (math.isfinite(self.alpha) and self.alpha >= 0):
            raise ValueError(f"Link: alpha must be a finite number of seconds >= 0, got {self.alpha!r}")
        if not self.bandwidth > 0:
            raise ValueError(f"Link: bandwidth must be > 0 bytes/s (math.inf: unlimited), got "
                             f"{self.bandwidth!r}")

    @property
    def beta(self) -> float:
        """Seconds per byte: ``1 / bandwidth`` (0 when unlimited)."""
        return 0.0 if math.isinf(self.bandwidth) else 1.0 / self.bandwidth

    @property
    def shaped(self) -> bool:
        return self.alpha > 0 or not math.isinf(self.bandwidth)

    def seconds(self, nbytes: int) -> float:
        """What one message of ``nbytes`` costs on this link: ``alpha + nbytes · beta``."""
        return self.alpha + nbytes * self.beta


@dataclass(frozen=True)
class Topology:
    """``nodes × ranks_per_node`` ranks; global rank ``r`` is on node ``r // ranks_per_node``.
    ``intra``: the link between two ranks of one node; ``inter``: between nodes (both unshaped
    unless given). ValueError for a count below 1."""

    nodes: int
    ranks_per_node: int
    inter: Link = field(default_factory=Link)
    intra: Link = field(default_factory=Link)

    def __post_init__(self):
        for name in ("nodes", "ranks_per_node"):
            v = getattr(self, name)
            if type(v) is not int or v < 1:
                raise ValueError(f"Topology: {name} must be an int >= 1, got {v!r}")

    @property
    def size(self) -> int:
        """The world size this topology describes."""
        return self.nodes * self.ranks_per_node

    def node(self, rank: int) -> int:
        """The node of global rank ``rank`` (ValueError outside ``0 .. size - 1``)."""
        if not 0 <= rank < self.size:
            raise ValueError(f"topology {self.spec()}: global rank {rank} is not in 0..{self.size - 1}")
        return rank // self.ranks_per_node

    def link(self, a: int, b: int) -> str:
        """``"intra"`` if global ranks ``a`` and ``b`` share a node, else ``"inter"``."""
        return "intra" if self.node(a) == self.node(b) else "inter"

    def cost(self, kind: str) -> Link:
        return self.intra if kind == "intra" else self.inter

    def spec(self) -> str:
        """The ``$MINIDIST_TOPOLOGY`` form of this topology (:meth:`parse` reads it back)."""
        out = f"{self.nodes}x{self.ranks_per_node}"
        for kind in ("inter", "intra"):
            ln = self.cost(kind)
            if ln.shaped:
                out += f":{kind}={ln.alpha!r},{ln.bandwidth!r}"
        return out

    @classmethod
    def parse(cls, spec: str) -> "Topology":
        """``"2x2"``, ``"2x2:inter=1e-4,2e8"``, ``"2x4:inter=5e-5,1e9:intra=0,inf"``; else ValueError."""
        form = ("expected NODESxRANKS_PER_NODE[:inter=ALPHA_S,BYTES_PER_S][:intra=ALPHA_S,"
                "BYTES_PER_S], e.g. '2x2:inter=1e-4,2e8'")
        head, *links = str(spec).strip().split(":")
        try:
            nodes, per = (int(x) for x in head.lower().split("x"))
        except ValueError:
            raise ValueError(f"{ENV}={spec!r}: {head!r} is not NODESxRANKS_PER_NODE; {form}") from None
        given: dict = {}
        for part in links:
            kind, _, value = part.partition("=")
            kind = kind.strip()
            if kind not in CLASSES or kind in given:
                raise ValueError(f"{ENV}={spec!r}: {part!r}: link class must be 'inter' or "
                                 f"'intra', each at most once; {form}")
            try:
                alpha, bandwidth = (float(x) for x in value.split(","))
                given[kind] = Link(alpha, bandwidth)
            except ValueError as e:
                raise ValueError(f"{ENV}={spec!r}: {part!r}: {e}; {form}") from None
        return cls(nodes, per, **given)


class _State:
    """``maybe``: p2p's hot-path flag, False once no topology is known to be installed."""

    __slots__ = ("maybe", "loaded", "topo", "free_at", "lock", "globals", "checked")

    def __init__(self):
        self.maybe = True            # unknown until the environment has been read
        self.loaded = False
        self.topo: Topology | None = None
        self.free_at = {k: 0.0 for k in CLASSES}   # when this rank's link of each class is free
        self.lock = threading.Lock()               # a DDP comm thread sends beside the main thread
        self.globals: dict = {}      # id(group) -> (weakref to the group, its global ranks)
        self.checked = None          # the topology whose size was checked against the world


state = _State()


def _set(topo: Topology | None) -> None:
    state.topo, state.loaded, state.maybe = topo, True, topo is not None
    state.free_at = {k: 0.0 for k in CLASSES}
    state.checked = None


def current() -> Topology | None:
    """The topology installed in this process (read from ``$MINIDIST_TOPOLOGY`` at first use)."""
    if not state.loaded:
        spec = os.environ.get(ENV, "").strip()
        _set(Topology.parse(spec) if spec else None)
    return state.topo


def install(topo: Topology | str) -> Topology:
    """Install ``topo`` (a :class:`Topology` or spec) here and in ``$MINIDIST_TOPOLOGY``."""
    if isinstance(topo, str):
        topo = Topology.parse(topo)
    if not isinstance(topo, Topology):
        raise TypeError(f"install: expected a Topology or its spec string, got {type(topo).__name__}")
    os.environ[ENV] = topo.spec()
    _set(topo)
    return topo


def uninstall() -> None:
    """No topology: every link unshaped, ``algorithm="hierarchical"`` refused."""
    os.environ.pop(ENV, None)
    _set(None)


@contextlib.contextmanager
def use(topo: Topology | str | None):
    """``with use("2x2:inter=1e-4,2e8"): ...``; None: no topology inside; restored afterwards."""
    before = os.environ.get(ENV)
    try:
        if topo is None:
            uninstall()
            yield None
        else:
            yield install(topo)
    finally:
        if before is None:
            uninstall()
        else:
            install(before)


def reload() -> Topology | None:
    """Read ``$MINIDIST_TOPOLOGY`` again; ValueError on every rank if malformed or not the world."""
    state.loaded = False
    state.globals.clear()
    topo = current()
    if topo is not None and dist.is_initialized():
        _check_world(topo)
    return topo


def _check_world(topo: Topology) -> None:
    world = dist.get_world_size()
    if world != topo.size:
        raise ValueError(f"topology {topo.spec()} (from {ENV} or topology.install) describes "
                         f"{topo.nodes} x {topo.ranks_per_node} = {topo.size} ranks, but the world "
                         f"has {world} (rank {dist.get_rank()}); install one with nodes x "
                         f"ranks_per_node = {world}")
    state.checked = topo


def global_rank(peer: int, group=None) -> int:
    """The global rank of group rank ``peer`` (remembered per group: asked on every message)."""
    if group is None or group is dist.GroupMember.WORLD:
        return peer
    hit = state.globals.get(id(group))
    if hit is None or hit[0]() is not group:
        if len(state.globals) > 64:
            state.globals.clear()
        # held weakly: a group dropped by its owner can go (its gloo threads with it)
        hit = state.globals[id(group)] = (weakref.ref(group), dist.get_process_group_ranks(group))
    return hit[1][peer]


def link(a: int, b: int) -> str:
    """``"intra"`` or ``"inter"`` between global ranks ``a`` and ``b`` (RuntimeError: no topology)."""
    topo = current()
    if topo is None:
        raise RuntimeError(f"topology.link: no topology is installed (topology.install(...) or {ENV})")
    return topo.link(a, b)


def pace(nbytes: int, peer: int, group=None) -> str | None:
    """Called for each message this rank sends to group rank ``peer``: wait until this rank's link
    to it is free and ``alpha + nbytes · beta`` has passed on it, then return its class (None, at
    once, when no topology is installed)."""
    topo = current()
    if topo is None:
        return None
    if state.checked is not topo:
        _check_world(topo)
    kind = topo.link(dist.get_rank(), global_rank(peer, group))
    cost = topo.cost(kind)
    if cost.shaped:
        now = time.perf_counter()
        with state.lock:
            done = max(now, state.free_at[kind]) + cost.seconds(nbytes)
            state.free_at[kind] = done
        while (left := done - time.perf_counter()) > 0:
            time.sleep(left)
    return kind
