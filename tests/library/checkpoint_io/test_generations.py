"""Named generations: list them with their status, load a chosen one verified, and fall back
from a corrupt newest one only when asked (logged and warned, never silently).

The field report: with ``keep=2`` and the newest generation corrupted, the error named the file
but the older generation could only be loaded as a plain file, unchecked. One process (the
protocol's collective steps are exercised at W > 1 in test_checkpoint_faults and
test_state_protocol).
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

from minidist.checkpoint_io import list_generations, newest
from minidist.data_parallel.checkpoint import FILE, load_checkpoint, save_checkpoint


def _saved(tmp_path, n=3, keep=2):
    model = torch.nn.Linear(3, 2)
    for step in range(1, n + 1):
        with torch.no_grad():
            model.weight.fill_(float(step))
        save_checkpoint(tmp_path, model, extra={"step": step}, keep=keep)
    return model


def _corrupt(folder, name=FILE):
    file = os.path.join(folder, name)
    data = bytearray(open(file, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(file, "wb").write(bytes(data))


def test_list_generations_reports_status_and_step(tmp_path):
    _saved(tmp_path)
    rows = list_generations(tmp_path)
    assert [(r["generation"], r["status"], r["step"]) for r in rows] == [
        (2, "verified", 2), (3, "verified", 3)]
    _corrupt(rows[-1]["folder"])
    os.makedirs(tmp_path / "gen-000004")                  # a save killed before its manifest
    rows = list_generations(tmp_path)
    assert [r["status"] for r in rows] == ["verified", "corrupt", "unfinished"]
    assert "checkpoint.pt: SHA-256 differs" in rows[1]["detail"]
    assert [r["status"] for r in list_generations(tmp_path, check=False)] == [
        "complete", "complete", "unfinished"]


def test_corrupt_newest_fails_naming_the_file_and_the_older_generation(tmp_path):
    _saved(tmp_path)
    _corrupt(newest(tmp_path))
    with pytest.raises(ValueError, match=r"gen-000003.checkpoint.pt is corrupted.*older "
                                         r"generations \[2\] are kept.*fallback=True"):
        load_checkpoint(tmp_path, torch.nn.Linear(3, 2))


@pytest.mark.parametrize("how", ["generation", "folder", "fallback"])
def test_the_older_generation_loads_verified(tmp_path, how, caplog):
    _saved(tmp_path)
    _corrupt(newest(tmp_path))
    model = torch.nn.Linear(3, 2)
    if how == "generation":
        extra = load_checkpoint(tmp_path, model, generation=2)
    elif how == "folder":
        extra = load_checkpoint(tmp_path / "gen-000002", model)
    else:
        with caplog.at_level(logging.WARNING, logger="minidist.checkpoint"), \
                pytest.warns(UserWarning, match="generation 3 .* is corrupt"):
            extra = load_checkpoint(tmp_path, model, fallback=True)
        assert "falling back" in caplog.text
    assert extra == {"step": 2} and model.weight.eq(2.0).all()


def test_a_chosen_generation_is_verified_too(tmp_path):
    _saved(tmp_path)
    _corrupt(tmp_path / "gen-000002")
    with pytest.raises(ValueError, match="gen-000002.checkpoint.pt is corrupted"):
        load_checkpoint(tmp_path, torch.nn.Linear(3, 2), generation=2)
    with pytest.raises(FileNotFoundError, match=r"no complete generation 1 .*complete: \[2, 3\]"):
        load_checkpoint(tmp_path, torch.nn.Linear(3, 2), generation=1)


def test_fallback_with_every_generation_corrupt_says_so(tmp_path):
    _saved(tmp_path)
    for row in list_generations(tmp_path):
        _corrupt(row["folder"])
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="every complete generation"):
        load_checkpoint(tmp_path, torch.nn.Linear(3, 2), fallback=True)


def test_an_unfinished_generation_folder_cannot_be_loaded(tmp_path):
    _saved(tmp_path)
    os.makedirs(tmp_path / "gen-000009")
    with pytest.raises(FileNotFoundError, match="no manifest.json: a save that did not finish"):
        load_checkpoint(tmp_path / "gen-000009", torch.nn.Linear(3, 2))


def test_the_loss_scaler_resumes_its_scale_and_counter(tmp_path):
    """MixedPrecision (fp16: dynamic loss scaling) is a replicated stateful object: after an
    overflow halves the scale, a save and a load into a fresh one continue with the same scale."""
    from minidist.data_parallel import MixedPrecision
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mp = MixedPrecision(device="cpu", dtype=torch.float16, init_scale=2.0**10)
    mp.backward(model(torch.ones(1, 3)).sum() * float("inf"))   # an overflow: step skipped
    assert not mp.step(opt) and mp.scale == 2.0**9
    save_checkpoint(tmp_path, model, states={"amp": mp})
    fresh = MixedPrecision(device="cpu", dtype=torch.float16)
    assert fresh.scale == 2.0**16
    load_checkpoint(tmp_path, model, states={"amp": fresh})
    assert fresh.scale == 2.0**9
    assert fresh.scaler.state_dict() == mp.scaler.state_dict()
    with pytest.raises(ValueError, match="saved with dtype torch.float16"):
        load_checkpoint(tmp_path, model, states={"amp": MixedPrecision(device="cpu",
                                                                        dtype=torch.bfloat16)})


def test_a_corrupt_generation_never_pushes_out_the_last_good_one(tmp_path):
    """A learner's report: with keep=2, a fallback resume and a new save deleted the only other
    good generation and kept the corrupt one. The corrupt one is not counted now."""
    model = _saved(tmp_path)                                  # generations 2 and 3, keep=2
    _corrupt(newest(tmp_path))
    load_checkpoint(tmp_path, model, generation=2)
    save_checkpoint(tmp_path, model, extra={"step": 3}, keep=2)             # generation 4
    assert [(r["generation"], r["status"]) for r in list_generations(tmp_path)] == [
        (2, "verified"), (3, "corrupt"), (4, "verified")]
    save_checkpoint(tmp_path, model, extra={"step": 4}, keep=2)             # generation 5
    assert [(r["generation"], r["status"]) for r in list_generations(tmp_path)] == [
        (4, "verified"), (5, "verified")]
