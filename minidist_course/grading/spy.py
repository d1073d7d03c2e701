"""Watch a learner's torch.distributed calls inside a rank: which collectives, how many bytes, async
or blocking, and whether each work handle was waited — so a grader checks the communication
*pattern* an exercise teaches, not only the numbers it produces.

    with CollectiveSpy(learner_object, world_size) as spy:
        spy.phase = "backward"; loss.backward()
        spy.phase = "step"; opt.step()
    spy.calls          # [Call(name="reduce_scatter_tensor", nbytes=..., async_op=True, ...)]
    spy.bytes_per_rank("step")   # ring bytes each rank sends, by the nccl-tests formulas

Learners bind collectives to short names in their notebook (``all_gather = dist.all_gather_single``),
so patching ``torch.distributed`` alone would miss them: the spy also replaces, in the globals of
every method of the learner's class (and of the functions given), each name that points to a
torch.distributed function. Only the outermost call is counted (torch's ``*_single`` call
``*_tensor`` internally). Meant for forked rank processes: everything is restored on exit.

Bytes per rank (what a bandwidth-optimal ring sends from each rank, nccl-tests' conventions, for
``n`` bytes): all-reduce ``2(W-1)/W·n``; reduce-scatter ``(W-1)/W·n`` of the *input*; all-gather
``(W-1)/W·n`` of the *output*; broadcast/reduce ``(W-1)/W·n``; send/isend ``n``.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

__all__ = ["CollectiveSpy", "Call", "ring_bytes"]

# name: which tensor argument sets the size ("in": the last tensor argument, "out": the first)
_WATCHED = {"all_reduce": "out", "reduce_scatter_tensor": "in", "reduce_scatter_single": "in",
            "reduce_scatter": "in", "all_gather_into_tensor": "out", "all_gather_single": "out",
            "all_gather": "out", "broadcast": "out", "reduce": "out", "all_to_all_single": "out",
            "send": "out", "isend": "out", "recv": "out", "irecv": "out"}


def _nbytes(x) -> int:
    if torch.is_tensor(x):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


def ring_bytes(name: str, nbytes: int, world: int) -> float:
    """Bytes one rank sends for collective ``name`` on a tensor of ``nbytes`` (see module doc)."""
    if world <= 1:
        return 0.0
    f = (world - 1) / world
    if name == "all_reduce":
        return 2 * f * nbytes
    if name in ("send", "isend"):
        return float(nbytes)
    if name in ("recv", "irecv"):
        return 0.0
    return f * nbytes


@dataclass
class Call:
    name: str
    nbytes: int        # size of the tensor that sets the traffic (see _WATCHED)
    async_op: bool
    phase: str         # the spy's phase when the call was made ("backward", "step", ...)
    waited: str = ""   # the phase in which .wait() was called on its work ("" = never)


class _Work:
    """A work handle that remembers when it was waited."""

    def __init__(self, work, call: Call, spy: "CollectiveSpy"):
        self._work, self._call, self._spy = work, call, spy

    def wait(self, *args, **kwargs):
        self._call.waited = self._call.waited or self._spy.phase
        return self._work.wait(*args, **kwargs)

    def is_completed(self):
        return self._work.is_completed()

    def __getattr__(self, name):
        return getattr(self._work, name)


class CollectiveSpy:
    def __init__(self, *watched, world: int | None = None):
        self.watched, self.world = watched, world
        self.calls: list[Call] = []
        self.phase = "setup"
        self._depth = 0
        self._undo = []

    # ---------------------------------------------------------------- patching
    def _wrap(self, name, fn):
        spy, which = self, _WATCHED[name]

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if spy._depth:
                return fn(*args, **kwargs)
            tensors = [a for a in list(args) + list(kwargs.values())
                       if torch.is_tensor(a) or (isinstance(a, (list, tuple)) and a
                                                 and torch.is_tensor(a[0]))]
            size = _nbytes(tensors[-1] if which == "in" else tensors[0]) if tensors else 0
            async_op = bool(kwargs.get("async_op", False)) or name in ("isend", "irecv")
            call = Call(name, size, async_op, spy.phase)
            spy.calls.append(call)
            spy._depth += 1
            try:
                out = fn(*args, **kwargs)
            finally:
                spy._depth -= 1
            if out is None or not hasattr(out, "wait"):
                call.waited = spy.phase  # blocking: complete when it returns
                return out
            return _Work(out, call, spy)
        wrapper._spy_original = fn
        return wrapper

    def _patch(self, namespace: dict, key: str, value):
        self._undo.append((namespace, key, namespace[key]))
        namespace[key] = value

    def __enter__(self):
        originals = {}
        for name in _WATCHED:
            fn = getattr(c10d, name, None)
            if fn is not None:
                originals[fn] = self._wrap(name, fn)
        by_id = {id(k): v for k, v in originals.items()}
        for mod in (dist, c10d):
            for name in _WATCHED:
                fn = getattr(mod, name, None)
                if id(fn) in by_id:
                    self._patch(vars(mod), name, by_id[id(fn)])
        for g in self._globals():
            for key, value in list(g.items()):
                if id(value) in by_id and g is not vars(dist) and g is not vars(c10d):
                    self._patch(g, key, by_id[id(value)])
        return self

    def __exit__(self, *exc):
        for namespace, key, value in reversed(self._undo):
            namespace[key] = value
        self._undo.clear()
        return False

    def _globals(self):
        seen, out = set(), []
        for obj in self.watched:
            klasses = type(obj).__mro__ if not (inspect.isfunction(obj) or inspect.isclass(obj)) \
                else (obj.__mro__ if inspect.isclass(obj) else ())
            fns = [obj] if inspect.isfunction(obj) else []
            for k in klasses:
                if k is object or k.__module__.startswith(("torch", "builtins")):
                    continue
                for v in vars(k).values():
                    v = v.fget if isinstance(v, property) else getattr(v, "__func__", v)
                    if inspect.isfunction(v):
                        fns.append(v)
            for f in fns:
                if id(f.__globals__) not in seen:
                    seen.add(id(f.__globals__))
                    out.append(f.__globals__)
        return out

    # ---------------------------------------------------------------- reading
    def in_phase(self, phase: str) -> list[Call]:
        return [c for c in self.calls if c.phase == phase]

    def bytes_per_rank(self, phase: str | None = None) -> float:
        world = self.world if self.world is not None else dist.get_world_size()
        return sum(ring_bytes(c.name, c.nbytes, world) for c in self.calls
                   if phase is None or c.phase == phase)

    def summary(self, phase: str | None = None) -> str:
        world = self.world if self.world is not None else dist.get_world_size()
        parts = [f"{c.name}({c.nbytes} B{', async' if c.async_op else ''}) → "
                 f"{ring_bytes(c.name, c.nbytes, world):.0f} B"
                 for c in self.calls if phase is None or c.phase == phase]
        return ", ".join(parts) or "no collective"

    def clear(self):
        self.calls.clear()
