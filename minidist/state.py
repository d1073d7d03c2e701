"""The state protocol: every object that carries training state is saved and restored one way.

An object is **stateful** when it has ``state_dict()`` and ``load_state_dict(state)``, as
``torch.optim.Optimizer`` and ``nn.Module`` do, and its state is *plain*: tensors, numbers,
strings, ``None`` and lists/tuples/dicts of them, so that ``torch.load(weights_only=True)`` reads
it back (no pickled classes: a checkpoint is data, not code). Its class attribute
``checkpoint_scope`` says where the state lives:

* ``"replicated"`` — the same on every rank of the group; saved once (rank 0's file). Before
  anything is written, every rank's digest of it is compared, and replicas that differ are
  refused on every rank, naming the object and the ranks.
* ``"per_rank"`` (the default for an object that does not say) — each rank its own; saved in
  that rank's file and given back to the same rank. It cannot be restored on another world size.

The library's stateful objects and their scope:

====================================================  ===========  ===============================
object                                                scope        state
====================================================  ===========  ===============================
``DistributedSampler``                                per_rank     epoch, position
``PowerSGD``                                          per_rank     step, Q, error feedback, RNG
``TopK``                                              per_rank     error feedback
``DiLoCo``                                            per_rank     anchor, outer optimizer, step in
                                                                   the round; mid-round also this
                                                                   rank's replica
``MixedPrecision``                                    replicated   dtype, loss scale and its counter
``ShardedOptimizer`` (ZeRO-1/2; consolidated)         replicated   the optimizer's full state
``RNGTracker`` (TP dropout)                           per_rank     each named generator
====================================================  ===========  ===============================

Every rank's own random generators (CPU, CUDA, Python) are saved in its file without being
named. An object whose state holds each rank's *model replica* (DiLoCo mid-round) says so with a
true ``holds_replica``; otherwise a save whose model replicas differ is refused (see
:func:`replica_digest`). The two methods are ``torch.distributed.checkpoint``'s ``Stateful``
protocol (``torch/distributed/checkpoint/stateful.py``); the scope is minidist's: DCP, for
comparison, saves a plain tensor once (it takes it to be replicated) and a DTensor per shard.
"""

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
    """``obj``'s ``checkpoint_scope`` ("per_rank" when it does not say). Raises ``TypeError``
    naming ``name`` when ``obj`` has no ``state_dict``/``load_state_dict``, ``ValueError`` for an
    unknown scope."""
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
    """Raise ``TypeError`` naming ``path`` if ``value`` holds anything but tensors, numbers,
    strings, ``None`` and lists/tuples/dicts of them (what ``weights_only=True`` loads)."""
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
    """Raise ``TypeError`` unless ``extra`` (a save's small dict: epoch, step, losses) is None or a
    dict of plain data; the message names the key and points at ``states=`` for an object."""
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
    """``(replicated, per_rank)`` state dicts of ``states`` (``{name: stateful object}``), each
    checked plain, as is the save's ``extra`` (:func:`check_extra`); collective over ``group``
    (call it on every rank with the same names).

    With ``check_replicated``, every replicated object's digest, and every entry of ``replicas``
    (``{"the model": state dict, "the optimizer": state dict}``: what rank 0 alone will save), is
    compared across ranks — except the model when an object :func:`holds_replica`. A difference
    is a ``ValueError`` on every rank naming the object and the ranks that differ from rank 0.
    Any error on one rank (not stateful, not plain) is raised on every rank, before anything is
    written.
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
    """Check, before anything is loaded, that ``saved`` (``{name: state dict}``, both scopes
    merged, as read by this rank) holds every object of ``states``. Raises ``ValueError`` when
    the missing ones are per rank and ``saved_world`` ranks wrote them (this run has ``world``),
    else ``KeyError`` naming them and ``file``."""
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
