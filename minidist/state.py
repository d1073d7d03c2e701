"""The state protocol: every object that carries training state is saved and restored one way.

An object is stateful when it has ``state_dict()`` and ``load_state_dict(state)`` (as
``torch.optim.Optimizer``, ``nn.Module``: ``torch.distributed.checkpoint``'s ``Stateful``) and its
state is plain (tensors, numbers, strings, None, lists/tuples/dicts of them), so that
``torch.load(weights_only=True)`` reads it. Its class attribute ``checkpoint_scope`` says where
the state lives: ``"replicated"`` (the same on every rank, saved once, every rank's digest compared
first) or ``"per_rank"`` (the default; saved in that rank's file, restored on the same world size).
An object whose state holds each rank's model replica says so with ``holds_replica``.

Design notes: docs/design/ground.md"""

from __future__ import annotations

import hashlib
import io
import numbers

import torch
import torch.distributed as dist

from .comm.p2p import group_rank_world

__all__ = ["SCOPES", "scope_of", "check_plain", "digest", "collect", "require", "restore",
           "replica_digest", "holds_replica", "numpy_rng_state", "load_numpy_rng_state"]

SCOPES = ("replicated", "per_rank")


def scope_of(obj, name: str, where: str) -> str:
    """``obj``'s ``checkpoint_scope`` (default "per_rank"). TypeError naming ``name`` if ``obj`` is
    not stateful; ValueError for an unknown scope."""
    if not (callable(getattr(obj, "state_dict", None))
            and callable(getattr(obj, "load_state_dict", None))):
        raise TypeError(f"{where}: states[{name!r}] is a {type(obj).__name__}, which has no "
                        "state_dict()/load_state_dict(): it cannot be saved and restored")
    scope = getattr(obj, "checkpoint_scope", "per_rank")
    if scope not in SCOPES:
        raise ValueError(f"{where}: states[{name!r}].checkpoint_scope is {scope!r}, expected one "
                         f"of {SCOPES}")
    return scope


_PLAIN = (str, bytes, bool, int, float, complex)   # exactly these: numpy's scalars are Numbers
#                                                    that weights_only=True refuses to load


def check_plain(value, path: str, where: str) -> None:
    """TypeError naming ``path`` unless ``value`` is plain data (what ``weights_only=True`` loads)."""
    if value is None or type(value) in _PLAIN or isinstance(value, (torch.Tensor, torch.dtype,
                                                                     torch.device)):
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, (str, int)):
                raise TypeError(f"{where}: {path} has a key of type {type(k).__name__}; a "
                                "checkpoint's keys are str or int")
            check_plain(v, f"{path}[{k!r}]", where)
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_plain(v, f"{path}[{i}]", where)
        return
    hint = (" (a numpy scalar: convert it with float() or int())"
            if isinstance(value, numbers.Number) else "")
    raise TypeError(f"{where}: {path} is a {type(value).__name__}{hint}; a checkpoint holds only "
                    "tensors, numbers, strings and lists/dicts of them (loadable with "
                    "weights_only=True)")


def check_extra(extra, where: str) -> None:
    """TypeError unless ``extra`` is None or a dict of plain data (objects go in ``states=``)."""
    if extra is None:
        return
    if not isinstance(extra, dict):
        raise TypeError(f"{where}: extra must be a dict of plain data (epoch, step, losses), got "
                        f"{type(extra).__name__}")
    try:
        check_plain(extra, "extra", where)
    except TypeError as e:
        raise TypeError(f"{e}. extra holds plain data only; to save and resume an object with "
                        "state (a PowerSGD hook, a sampler, an optimizer), pass it as states="
                        "{name: obj}: its state_dict() is saved and load_state_dict() resumes "
                        "it exactly") from None
    buffer = io.BytesIO()                          # what load will do, before anything is written
    torch.save(extra, buffer)
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
    except Exception as e:  # noqa: BLE001 - weights_only's refusal, whatever it raises
        raise TypeError(f"{where}: extra cannot be loaded back with weights_only=True ({e}); "
                        "pass objects with state as states={name: obj}") from None


def _feed(h, value) -> None:
    if torch.is_tensor(value):
        t = value.detach().reshape(-1).contiguous().cpu()
        h.update(f"T{t.dtype}{tuple(value.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(value, dict):
        for k in sorted(value, key=repr):
            h.update(repr(k).encode())
            _feed(h, value[k])
    elif isinstance(value, (list, tuple)):
        h.update(f"L{len(value)}".encode())
        for v in value:
            _feed(h, v)
    else:
        h.update(repr(value).encode())


def digest(state) -> str:
    """SHA-256 of a plain state (tensors by their bytes, dtype and shape): equal iff bitwise equal."""
    h = hashlib.sha256()
    _feed(h, state)
    return h.hexdigest()


def replica_digest(module) -> str:
    """:func:`digest` of a module's parameters and buffers (its replica)."""
    return digest(dict(module.state_dict()))


def holds_replica(states: dict | None) -> bool:
    """Whether some object in ``states`` saves each rank's model replica (DiLoCo mid-round)."""
    return any(getattr(obj, "holds_replica", False) for obj in (states or {}).values())


def _gather(obj, group) -> list:
    _, world = group_rank_world(group)
    if world == 1 or not dist.is_initialized():
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


_HINTS = {
    "the model": " (DiLoCo between synchronisations, a replica that was never synchronised, or "
                 "a model whose ranks hold different parts, as expert parallelism's): pass the "
                 "object that keeps the replicas apart in states=, or save right after a "
                 "synchronisation",
    "the optimizer": " (an optimizer local to each rank, as DiLoCo's inner one): pass it in "
                     "states= instead, which saves it per rank",
}


def collect(states: dict | None, where: str, group=None, replicas: dict | None = None,
            check_replicated: bool = True, extra: dict | None = None) -> tuple[dict, dict]:
    """``(replicated, per_rank)`` state dicts of ``states`` (``{name: stateful}``), checked plain;
    collective over ``group``. With ``check_replicated`` replicated state and ``replicas`` are compared
    across ranks; any difference or error is raised on every rank, before anything is written.
    """
    replicated, per_rank, error = {}, {}, None
    digests: dict = {}
    try:
        check_extra(extra, where)
        for name, obj in (states or {}).items():
            scope = scope_of(obj, name, where)
            sd = obj.state_dict()            # every rank: a ZeRO state_dict is collective
            check_plain(sd, f"states[{name!r}].state_dict()", where)
            (replicated if scope == "replicated" else per_rank)[name] = sd
            if scope == "replicated" and check_replicated:
                digests[repr(name)] = digest(sd)
        if check_replicated:
            for name, sd in (replicas or {}).items():
                if not (name == "the model" and holds_replica(states)):
                    digests[name] = digest(sd)
    except (TypeError, ValueError) as e:
        error = e
    outcomes = _gather((None if error is None else f"{type(error).__name__}: {error}", digests),
                       group)
    if error is not None:
        raise error
    failed = [(r, msg) for r, (msg, _) in enumerate(outcomes) if msg]
    if failed:
        raise RuntimeError(f"{where}: rank(s) {[r for r, _ in failed]} cannot save their state "
                           f"({'; '.join(f'rank {r}: {m}' for r, m in failed)}); nothing written")
    for name in digests:
        differ = [r for r, (_, d) in enumerate(outcomes) if d.get(name) != outcomes[0][1].get(name)]
        if differ:
            hint = _HINTS.get(name, ": a replicated object must be equal on every rank; set its "
                                    "checkpoint_scope to 'per_rank' if it is not")
            raise ValueError(f"{where}: {name} differs between ranks — rank(s) {differ} hold "
                             "other values than rank 0, whose copy alone would be saved, so the "
                             f"resume would not continue every rank{hint}; nothing written")
    return replicated, per_rank


def require(states: dict | None, saved: dict, where: str, file: str,
            saved_world: int | None = None, world: int | None = None) -> None:
    """Check that ``saved`` (``{name: state dict}``) holds every object of ``states``: ValueError
    when missing per-rank ones come from another world size, else KeyError naming them and ``file``."""
    missing = [name for name in (states or {}) if name not in saved]
    if missing and saved_world is not None and saved_world != world:
        raise ValueError(f"{where}: states {missing} are per rank, saved by {saved_world} ranks; "
                         f"this run has {world}, so they cannot be restored (each rank's own "
                         "state has no owner here)")
    if missing:
        raise KeyError(f"{where}: {file} holds no state for {missing} (it holds "
                       f"{sorted(saved)}); save them with save_*(..., states={{...}})")


def restore(states: dict | None, saved: dict) -> None:
    """Load each object of ``states`` from ``saved`` (checked by :func:`require` first)."""
    for name, obj in (states or {}).items():
        obj.load_state_dict(saved[name])


def numpy_rng_state(rng) -> dict:
    """A NumPy ``RandomState`` (or the ``numpy.random`` module's global one) as plain data."""
    kind, keys, pos, has_gauss, gauss = rng.get_state()
    return {"kind": kind, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
            "has_gauss": int(has_gauss), "gauss": float(gauss)}


def load_numpy_rng_state(rng, state: dict) -> None:
    """Undo :func:`numpy_rng_state` on ``rng``."""
    import numpy as np
    rng.set_state((state["kind"], state["keys"].numpy().astype(np.uint32), state["pos"],
                   state["has_gauss"], state["gauss"]))
