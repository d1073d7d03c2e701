"""Checkpoint generations: a new save never touches the last good one (shared by every checkpoint kind).

A location holds numbered generations ``path/gen-000007/``: every rank's parts, then
``manifest.json`` written last and atomically (sizes, SHA-256, shapes). A save that fails on any
rank fails on every rank and leaves the previous generation untouched; loading takes the newest
generation with a manifest and verifies each file (the protocol of ``torch.distributed.checkpoint``
and Megatron-LM).

Design notes: docs/design/ground.md"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import re
import shutil
import logging
import warnings

import torch
import torch.distributed as dist

from .comm.p2p import group_rank_world
from .resume_rule import choose_generation, generations_to_retire

__all__ = ["save_generation", "open_generation", "list_generations", "verify", "read_part",
           "check_tensors", "agree", "newest", "generations", "rank_name", "signature",
           "tensor_shapes", "flatten", "MANIFEST", "FORMAT"]

FORMAT = "minidist-checkpoint/2"
logger = logging.getLogger("minidist.checkpoint")
logger.addHandler(logging.NullHandler())      # a library logs; the application decides where to
MANIFEST = "manifest.json"
_GEN = re.compile(r"^gen-(\d{6,})$")


# ----------------------------------------------------------------------------- structure
def tensor_shapes(state: dict) -> dict:
    """``{name: [shape list, dtype name]}`` of the tensors in a (flat) state dict."""
    return {k: [list(v.shape), str(v.dtype).replace("torch.", "")]
            for k, v in state.items() if torch.is_tensor(v)}


def flatten(state: dict, prefix: str = "") -> dict:
    """Nested dicts of tensors as one flat dict: ``{0: {"w": t}}`` -> ``{"0.w": t}``."""
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        elif torch.is_tensor(v):
            out[f"{prefix}{k}"] = v
    return out


def signature(state: dict) -> str:
    """SHA-256 (16 hex digits) of the sorted names, shapes and dtypes: the model's structure."""
    text = json.dumps(sorted(tensor_shapes(state).items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------- listing
def rank_name(rank: int) -> str:
    """The name of rank ``rank``'s own file inside a generation folder."""
    return f"rank{rank:05d}.pt"


def generations(path) -> list[tuple[int, str, bool]]:
    """``(number, folder, complete)`` of every generation under ``path``, oldest first."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        return []
    out = []
    for name in os.listdir(path):
        m = _GEN.match(name)
        if m:
            folder = os.path.join(path, name)
            out.append((int(m.group(1)), folder, os.path.exists(os.path.join(folder, MANIFEST))))
    return sorted(out)


def newest(path) -> str | None:
    """The folder of the newest complete generation under ``path`` (None if there is none)."""
    done = [folder for _, folder, complete in generations(path) if complete]
    return done[-1] if done else None


# ----------------------------------------------------------------------------- writing
def _disk_full(e: OSError, where: str, file: str, size: int) -> OSError:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        try:
            free = shutil.disk_usage(os.path.dirname(file)).free
        except OSError:
            free = "?"
        return OSError(e.errno, f"{where}: the disk is full (no space left on device) while "
                       f"writing {file} ({size} bytes; {free} bytes free there); free space or "
                       "save elsewhere — the previous checkpoint is kept", file)
    return OSError(e.errno, f"{where}: could not write {file}: {e.strerror or e}", file)


def _write_bytes(file: str, data: bytes, where: str) -> None:
    try:
        with open(file, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise _disk_full(e, where, file, len(data)) from e


def _fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_part(folder: str, name: str, obj, model_key: str | None, where: str) -> dict:
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    _write_bytes(os.path.join(folder, name), data, where)
    record = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    model = obj.get(model_key) if model_key and isinstance(obj, dict) else None
    if isinstance(model, dict):
        flat = flatten(model)
        record.update(signature=signature(flat), shapes=tensor_shapes(flat))
    return record


def _gather(obj, group) -> list:
    rank, world = group_rank_world(group)
    if world == 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


def _from_rank0(obj, group):
    rank, world = group_rank_world(group)
    if world == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group else 0,
                               group=group)
    return box[0]


def _raise_agreed(where: str, mine: Exception | None, outcomes: list) -> None:
    bad = [(r, msg) for r, (ok, msg) in enumerate(outcomes) if not ok]
    if mine is not None:
        raise mine
    if bad:
        detail = "; ".join(f"rank {r}: {msg}" for r, msg in bad)
        raise RuntimeError(f"{where}: rank(s) {[r for r, _ in bad]} failed ({detail})")


def save_generation(path, parts: dict, *, where: str, kind: str, meta: dict | None = None,
                    group=None, keep: int = 1, model_key: str | None = "model") -> str:
    """Write this rank's ``parts`` (``{file name: object}``) as a new generation under ``path``;
    collective over ``group``; returns its folder. ``meta`` goes into the manifest, ``model_key`` names
    the model's part. Raises on every rank if any failed; the previous generation is kept.
    """
    if keep < 1:
        raise ValueError(f"{where}: keep must be >= 1 (the newest generation), got {keep!r}")
    path = os.fspath(path)
    rank, world = group_rank_world(group)
    number = None
    if rank == 0:
        try:
            if os.path.exists(path) and not os.path.isdir(path):
                raise FileExistsError(f"{where}: {path!r} is a file; a checkpoint location is a "
                                      "folder of generations (choose another path)")
            os.makedirs(path, exist_ok=True)
            gens = generations(path)
            for _, folder, complete in gens:
                if not complete:                  # a save that was killed half-way
                    shutil.rmtree(folder, ignore_errors=True)
            number = (gens[-1][0] + 1) if gens else 1
            os.makedirs(os.path.join(path, f"gen-{number:06d}"))
        except Exception as e:                    # noqa: BLE001 (every rank must hear of it)
            number = f"{type(e).__name__}: {e}"
    number = _from_rank0(number, group)
    if isinstance(number, str):
        raise OSError(f"{where}: rank 0 could not create a new generation under {path!r}: "
                      f"{number}")
    folder = os.path.join(path, f"gen-{number:06d}")
    records, mine = {}, None
    try:
        for name, obj in parts.items():
            records[name] = {"rank": rank, **_write_part(folder, name, obj, model_key, where)}
    except Exception as e:                        # noqa: BLE001 (agreed below, then re-raised)
        mine = e
    outcomes = _gather((mine is None, f"{type(mine).__name__}: {mine}" if mine else records),
                       group)
    failed = any(not ok for ok, _ in outcomes)
    status, manifest_error = None, None
    if rank == 0:
        if failed:
            shutil.rmtree(folder, ignore_errors=True)
        else:
            files = {k: v for _, recs in outcomes for k, v in recs.items()}
            manifest = {"format": FORMAT, "kind": kind, "generation": number,
                        "world_size": world, "meta": meta or {}, "files": files}
            try:
                _write_manifest(folder, manifest, where)
            except Exception as e:                # noqa: BLE001 (every rank must hear of it)
                manifest_error, status = e, f"{type(e).__name__}: {e}"
                shutil.rmtree(folder, ignore_errors=True)
    if not failed:                                # the commit's outcome, on every rank
        status = _from_rank0(status, group)
    _raise_agreed(where, mine, outcomes)
    if manifest_error is not None:
        raise manifest_error
    if status is not None:
        raise RuntimeError(f"{where}: rank 0 could not write {MANIFEST}, so nothing was saved "
                           f"({status})")
    if rank == 0:
        _retire(path, folder, keep)
    return folder


def _retire(path: str, new: str, keep: int) -> None:
    """Remove what :func:`~minidist.resume_rule.generations_to_retire` says."""
    gens = generations(path)
    folder_of = {n: f for n, f, _ in gens}
    number = next(n for n, f, _ in gens if f == new)
    for n in generations_to_retire([(n, c) for n, _, c in gens], number, keep,
                                   lambda n: _problem(folder_of[n], "save") is None):
        shutil.rmtree(folder_of[n], ignore_errors=True)


def _write_manifest(folder: str, manifest: dict, where: str) -> None:
    final = os.path.join(folder, MANIFEST)
    tmp = final + ".tmp"
    _write_bytes(tmp, json.dumps(manifest, indent=1, sort_keys=True).encode(), where)
    os.rename(tmp, final)                         # atomic on POSIX
    _fsync_dir(folder)                            # the rename itself reaches the disk


# ----------------------------------------------------------------------------- reading
def _read_manifest(folder: str, where: str) -> dict:
    file = os.path.join(folder, MANIFEST)
    try:
        with open(file, "rb") as f:
            return json.loads(f.read())
    except (OSError, ValueError) as e:
        raise ValueError(f"{where}: {file} is unreadable ({e})") from e


def verify(folder: str, manifest: dict) -> str | None:
    """None if every file has its manifest's size and SHA-256, else what is wrong with the first."""
    for name, record in sorted(manifest.get("files", {}).items()):
        file = os.path.join(folder, name)
        try:
            with open(file, "rb") as f:
                data = f.read()
        except OSError as e:
            return f"{name}: cannot read ({e.strerror or e})"
        if len(data) != record["bytes"]:
            return f"{name}: {len(data)} bytes, the manifest says {record['bytes']} (truncated)"
        if hashlib.sha256(data).hexdigest() != record["sha256"]:
            return f"{name}: SHA-256 differs from the manifest's (corrupted)"
    return None


def _problem(folder: str, where: str) -> str | None:
    """None if a complete generation's manifest reads and every file verifies, else what is wrong."""
    try:
        return verify(folder, _read_manifest(folder, where))
    except ValueError as e:
        return str(e)


def list_generations(path, check: bool = True) -> list[dict]:
    """Every generation under ``path``, oldest first: ``{"generation", "folder", "status", "detail",
    "step"}``, status ``"unfinished"`` (no manifest), ``"corrupt"`` (only with ``check``; ``detail``
    says why), ``"verified"`` or ``"complete"`` (``check=False``: files not read)."""
    out = []
    for number, folder, complete in generations(path):
        row = {"generation": number, "folder": folder, "status": "unfinished", "detail": "",
               "step": None}
        if complete:
            try:
                manifest = _read_manifest(folder, "list_generations")
                row["step"] = manifest.get("meta", {}).get("step")
                bad = verify(folder, manifest) if check else None
                row["status"] = "corrupt" if bad else ("verified" if check else "complete")
                row["detail"] = bad or ""
            except ValueError as e:
                row.update(status="corrupt", detail=str(e))
        out.append(row)
    return out


def _pick(path: str, where: str, generation, fallback: bool) -> str:
    """The folder to load (see :func:`open_generation`)."""
    if _GEN.match(os.path.basename(os.path.normpath(path))):     # a generation's own folder
        if not os.path.exists(os.path.join(path, MANIFEST)):
            raise FileNotFoundError(f"{where}: {path!r} has no {MANIFEST}: a save that did not "
                                    "finish; it cannot be loaded")
        return path
    gens = generations(path)
    folder_of = {n: f for n, f, _ in gens}
    done = [n for n, _, c in gens if c]
    problems: dict = {}

    def verifies(n: int) -> bool:
        problems[n] = _problem(folder_of[n], where)
        if problems[n] is not None:
            message = (f"{where}: generation {n} ({folder_of[n]}) is corrupt — {problems[n]}; "
                       "falling back to the next older generation (fallback=True)")
            logger.warning(message)
            warnings.warn(message, stacklevel=5)
        return problems[n] is None

    try:
        number = choose_generation([(n, c) for n, _, c in gens], generation, fallback, verifies)
    except FileNotFoundError:
        if generation is not None:
            raise FileNotFoundError(f"{where}: no complete generation {generation} under "
                                    f"{path!r} (complete: {done})") from None
        unfinished = f" ({len(gens)} unfinished save(s) without {MANIFEST})" if gens else ""
        raise FileNotFoundError(f"{where}: no complete checkpoint under {path!r}{unfinished}") \
            from None
    except ValueError:
        raise ValueError(f"{where}: every complete generation under {path!r} is corrupt "
                         f"({done}); nothing to fall back to") from None
    skipped = [os.path.basename(f) for n, f, c in gens if n > number and not c]
    if skipped and generation is None:
        warnings.warn(f"{where}: skipped {skipped} (no {MANIFEST}: a save that did not finish); "
                      f"loading {os.path.basename(folder_of[number])}", stacklevel=4)
    return folder_of[number]


def open_generation(path, where: str, kind: str, world_size: int | None = None,
                    generation: int | None = None, fallback: bool = False) -> tuple[str, dict]:
    """``(folder, manifest)`` of the generation to load (newest complete, or ``generation=n``; with
    ``fallback`` the newest that verifies), checked for ``kind`` and ``world_size``. ``path``: a
    location or one generation's folder. FileNotFoundError: none complete; ValueError: a bad manifest,
    another kind or world size, or (``fallback``) every generation corrupt.
    """
    path = os.fspath(path)
    folder = _pick(path, where, generation, fallback)
    manifest = _read_manifest(folder, where)
    file = os.path.join(folder, MANIFEST)
    if manifest.get("format") != FORMAT or manifest.get("kind") != kind:
        raise ValueError(f"{where}: {file} describes a {manifest.get('kind')!r} checkpoint "
                         f"(format {manifest.get('format')!r}), expected {kind!r} ({FORMAT})")
    if world_size is not None and manifest["world_size"] != world_size:
        raise ValueError(f"{where}: {folder} was written by {manifest['world_size']} ranks, this "
                         f"run has {world_size}")
    return folder, manifest


def read_part(folder: str, manifest: dict, name: str, where: str, map_location="cpu"):
    """``torch.load`` one file of a generation after checking its size and SHA-256."""
    file = os.path.join(folder, name)
    record = manifest["files"].get(name)
    if record is None:
        raise FileNotFoundError(f"{where}: {MANIFEST} of {folder} lists no {name}")
    try:
        with open(file, "rb") as f:
            data = f.read()
    except OSError as e:
        raise OSError(e.errno, f"{where}: cannot read {file}: {e.strerror or e}", file) from e
    if len(data) != record["bytes"]:
        raise ValueError(f"{where}: {file} is truncated or was changed: {len(data)} bytes, the "
                         f"manifest says {record['bytes']}{_older(folder)}")
    if hashlib.sha256(data).hexdigest() != record["sha256"]:
        raise ValueError(f"{where}: {file} is corrupted: its SHA-256 differs from the manifest's "
                         f"(same size, {len(data)} bytes, different content){_older(folder)}")
    return torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)


def _older(folder: str) -> str:
    """A hint naming the older complete generations next to ``folder``, if any."""
    older = [n for n, _, c in generations(os.path.dirname(os.path.normpath(folder)))
             if c and f"gen-{n:06d}" != os.path.basename(os.path.normpath(folder))]
    return (f"; older generations {older} are kept: list_generations(path) checks them, "
            "generation=n or fallback=True loads one" if older else "")


def check_tensors(where: str, file: str, found: dict, expected: dict, strict: bool = True) -> None:
    """ValueError naming the file and the first parameters whose name, shape or dtype differ."""
    lines = []
    for k, v in expected.items():
        if not torch.is_tensor(v):
            continue
        if k not in found:
            if strict:
                lines.append(f"{k}: missing (expected shape {tuple(v.shape)})")
        elif torch.is_tensor(found[k]) and (found[k].shape != v.shape or
                                             found[k].dtype != v.dtype):
            lines.append(f"{k}: expected shape {tuple(v.shape)} {v.dtype}, found "
                         f"{tuple(found[k].shape)} {found[k].dtype}")
    if strict:
        lines += [f"{k}: unexpected (shape {tuple(found[k].shape)}) — not in this model"
                  for k in found if k not in expected and torch.is_tensor(found[k])]
    if lines:
        more = f" (and {len(lines) - 5} more)" if len(lines) > 5 else ""
        raise ValueError(f"{where}: {file} does not fit this model: " + "; ".join(lines[:5]) + more)


def agree(where: str, error: Exception | None, group=None) -> None:
    """Collective: if any rank of ``group`` has an ``error``, it raises its own, the others a RuntimeError."""
    outcomes = _gather((error is None, f"{type(error).__name__}: {error}" if error else None),
                       group)
    bad = [r for r, (ok, _) in enumerate(outcomes) if not ok]
    if error is not None:
        raise error
    if bad:
        detail = "; ".join(f"rank {r}: {outcomes[r][1]}" for r in bad)
        raise RuntimeError(f"{where}: rank(s) {bad} could not load their part of the checkpoint "
                           f"({detail}); no rank resumes")
