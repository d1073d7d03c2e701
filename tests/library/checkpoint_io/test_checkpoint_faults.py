"""Fault injection for every checkpoint kind: the last good checkpoint always survives.

Kinds (tests/_ckpt_kinds.py): DDP, ZeRO-1 full (``save_checkpoint`` with a ``ShardedOptimizer``,
which deadlocked before: a collective only rank 0 reached), ZeRO-2 sharded, ZeRO-3 full and
sharded, and the 3-D checkpoint. Faults:

* a rank killed (SIGKILL) half-way through writing its file of the second save: the run fails
  naming that rank first; a new run loads the *first* save (and warns that it skipped the
  unfinished one), and its next step equals the next step of a run that never stopped — so the
  optimizer state came back too;
* a full disk (a small tmpfs the test mounts, root only): every rank raises, the writing rank an
  ``OSError(ENOSPC)`` naming the file and saying the disk is full, the others quoting it; the
  previous checkpoint still loads (before the fix: a normal return, or torch's
  ``unexpected pos`` with nothing about the disk, and the previous checkpoint gone);
* a truncated file, a flipped byte, a model of another shape: every rank raises, naming the file,
  and for a shape the parameter, expected against found (before: ``[Errno 22] Invalid argument``
  with no file name; no parameter name);
* unsupported combinations: a ``TypeError`` on every rank at once, no hang.
"""

from __future__ import annotations

import errno
import os
import re
import signal
import subprocess
import time
import warnings

import pytest
import torch

import minidist
from minidist import checkpoint_io
from _ckpt_kinds import KINDS, WRITER, close

W = 2


def _save_then_die(rank, world, kind, path, victim):
    setup, save, _, _ = KINDS[kind]
    model, opt, more = setup(rank, world, 0, 2)
    save(path, model, opt)                        # generation 1: the last good one
    more(1)
    if rank == victim:
        def dying(file, data, where):             # half the bytes reach the disk, then SIGKILL
            with open(file, "wb") as f:
                f.write(data[: len(data) // 2])
                f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        checkpoint_io._write_bytes = dying
    save(path, model, opt)


def _resume_and_compare(rank, world, kind, path, width=8):
    """Load into a differently initialised model; one more step must equal the straight run's."""
    setup, _, load, params = KINDS[kind]
    ref, ref_opt, ref_more = setup(rank, world, 0, 2)
    ref_more(1)
    expected = params(ref)
    close(ref, ref_opt)
    model, opt, more = setup(rank, world, 1, 0, width)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            load(path, model, opt)
    except Exception as e:                        # noqa: BLE001 (returned for the test to read)
        return type(e).__name__, str(e)
    more(1, 2)                                    # the step after the checkpoint (step 2)
    got = params(model)
    close(model, opt)
    return ({k: torch.equal(expected[k], got[k]) for k in expected},
            [str(w.message) for w in caught])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_rank_killed_mid_save_leaves_the_last_good_checkpoint(tmp_path, kind):
    path = str(tmp_path / "ckpt")
    victim = WRITER[kind]
    t0 = time.monotonic()
    with pytest.raises(minidist.RankError, match=rf"^rank {victim} failed: rank {victim} killed "
                                                 "by SIGKILL"):
        minidist.run(_save_then_die, W, kind, path, victim, timeout=60)
    detect = time.monotonic() - t0
    assert detect < 30, f"the killed rank took {detect:.1f} s to be reported"
    gens = checkpoint_io.generations(path)
    assert [(n, done) for n, _, done in gens] == [(1, True), (2, False)], gens
    for rank, (same, warned) in enumerate(minidist.run(_resume_and_compare, W, kind, path,
                                                       timeout=60)):
        assert same and all(same.values()), (rank, same)
        assert any("skipped ['gen-000002']" in m and "loading gen-000001" in m
                   for m in warned), warned
    # the next save clears the unfinished generation and retires the old one
    minidist.run(_save_only, W, kind, path, timeout=60)
    assert [(n, done) for n, _, done in checkpoint_io.generations(path)] == [(3, True)]


def _save_only(rank, world, kind, path):
    setup, save, _, _ = KINDS[kind]
    model, opt, _ = setup(rank, world, 0, 2)
    save(path, model, opt)
    close(model, opt)


def _save_reporting(rank, world, kind, path):
    setup, save, _, _ = KINDS[kind]
    model, opt, _ = setup(rank, world, 0, 2)
    try:
        save(path, model, opt)
    except Exception as e:                        # noqa: BLE001
        return type(e).__name__, getattr(e, "errno", None), str(e)
    finally:
        close(model, opt)
    return None


def _mounted_tmpfs(folder, size):
    os.makedirs(folder)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", folder],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}): needs root")


@pytest.mark.timeout(180)
@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs (a full disk) needs root")
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_full_disk_fails_the_save_on_every_rank_and_keeps_the_last_good_one(tmp_path, kind):
    disk = str(tmp_path / "disk")
    _mounted_tmpfs(disk, "1m")
    try:
        path = os.path.join(disk, "ckpt")
        minidist.run(_save_only, W, kind, path, timeout=60)       # fits
        used = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
        free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
        with open(os.path.join(disk, "filler"), "wb") as f:        # leave half a checkpoint free
            f.write(b"\0" * max(0, free - used // 2))
        outcomes = minidist.run(_save_reporting, W, kind, path, timeout=60)
        assert all(out is not None for out in outcomes), f"a failed save returned: {outcomes}"
        full = [out for out in outcomes if out[0] == "OSError" and out[1] == errno.ENOSPC]
        assert full, outcomes                     # whichever writer found the disk full first
        for _, _, msg in full:
            assert "the disk is full" in msg and os.path.join(path, "gen-000002") in msg, msg
        for out in outcomes:                      # the others quote it
            assert out in full or (out[0] == "RuntimeError" and "the disk is full" in out[2]), out
        assert [(n, c) for n, _, c in checkpoint_io.generations(path)] == [(1, True)]
        os.remove(os.path.join(disk, "filler"))
        for rank, (same, _) in enumerate(minidist.run(_resume_and_compare_saved, W, kind, path,
                                                      timeout=60)):
            assert same and all(same.values()), (rank, same)
    finally:
        subprocess.run(["umount", "-l", disk], check=False)


def _resume_and_compare_saved(rank, world, kind, path):
    """The checkpoint holds the state after 2 steps: load it and compare parameters."""
    setup, _, load, params = KINDS[kind]
    ref, ref_opt, _ = setup(rank, world, 0, 2)
    expected = params(ref)
    model, opt, _ = setup(rank, world, 1, 0)
    load(path, model, opt)
    got = params(model)
    return {k: torch.equal(expected[k], got[k]) for k in expected}, None


def _damage(path, kind, how):
    gen = checkpoint_io.newest(path)
    names = sorted(n for n in os.listdir(gen) if n.endswith(".pt"))
    file = os.path.join(gen, names[-1])
    data = open(file, "rb").read()
    if how == "truncated":
        data = data[: len(data) - 100]
    else:
        middle = len(data) // 2
        data = data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1:]
    open(file, "wb").write(data)
    return file


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", list(KINDS))
def test_truncated_corrupted_and_misshapen_checkpoints_are_named_on_every_rank(tmp_path, kind):
    for how, expect in [("truncated", "is truncated or was changed"),
                        ("corrupted", "is corrupted: its SHA-256 differs"),
                        ("misshapen", None)]:
        path = str(tmp_path / how)
        minidist.run(_save_only, W, kind, path, timeout=60)
        file = _damage(path, kind, how) if how != "misshapen" else None
        outcomes = minidist.run(_resume_and_compare, W, kind, path,
                                *(() if how != "misshapen" else (12,)), timeout=60)
        for rank, (name, msg) in enumerate(outcomes):
            assert name in ("ValueError", "RuntimeError"), (rank, name, msg)
            if expect:
                assert expect in msg and file in msg, (rank, msg)
            elif kind == "zero3-sharded":   # per parameter: the original names, dim-0 shards
                assert "does not fit this model" in msg and "dim-0 shards" in msg, msg
                assert re.search(r"net\.0\.weight: expected shape \(\d+, \d+\) torch.float32, "
                                 r"found", msg), msg
            elif kind == "3d":              # the grid's model config is checked first
                assert "model config differs in ['n_embd']" in msg, msg
            else:     # the first layer is 8 wide in the file, 12 in this model
                assert "does not fit this model" in msg and "expected shape (12," in msg, msg
                assert "found (8," in msg, msg


def test_a_truncated_plain_file_names_the_file(tmp_path):
    from minidist.data_parallel.checkpoint import load_checkpoint
    from minidist.models import MLP
    file = tmp_path / "plain.pt"
    torch.save(MLP(6, (8,), 3).state_dict(), file)
    file.write_bytes(file.read_bytes()[:-200])
    with pytest.raises(ValueError, match=r"plain.pt is not a readable checkpoint \(truncated"):
        load_checkpoint(file, MLP(6, (8,), 3))
    torch.save(MLP(6, (8,), 3).state_dict(), file)
    with pytest.raises(ValueError, match=r"0.weight: expected shape \(5, 6\) torch.float32, "
                                         r"found \(8, 6\)"):
        load_checkpoint(file, MLP(6, (5,), 3))


def _unsupported(rank, world, path):
    from minidist.data_parallel.checkpoint import save_checkpoint
    from minidist.sharding.checkpoints import save_sharded_checkpoint
    from _ckpt_kinds import setup_ddp, setup_zero3
    errors = []
    model, opt, _ = setup_zero3(rank, world, 0, 1)
    for fn, args in [(save_checkpoint, (path, model, opt)),
                     (save_sharded_checkpoint, (path, *setup_ddp(rank, world, 0, 0)[:2]))]:
        try:
            fn(*args)
            errors.append(None)
        except TypeError as e:
            errors.append(str(e))
    return errors


@pytest.mark.timeout(60)
def test_unsupported_combinations_are_a_clear_error_on_every_rank_at_once(tmp_path):
    for rank, (zero3, plain) in enumerate(minidist.run(_unsupported, W, str(tmp_path / "c"),
                                                       timeout=30)):
        assert zero3.startswith(f"save_checkpoint (rank {rank}): the model is sharded by "
                                "fully_shard"), zero3
        assert plain.startswith(f"save_sharded_checkpoint (rank {rank}): nothing here is "
                                "sharded"), plain
