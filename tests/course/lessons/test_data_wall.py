"""The input-pipeline lesson (minidist_course.lessons.data_wall): PNG digits decoded per sample, the
offline variant, and the per-rank timeline's ``data`` lane, on 2 ranks with and without loader
workers. Timings vary; what is checked is what was recorded (lanes, counts, sums) and what the
loader did (pinned or not, its warning)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

import minidist
from minidist_course.data import load_digits
from minidist_course.lessons.data_wall import (OfflineDigits, PNGDigits, augment_batch,
    preprocess_offline, train_input_pipeline, write_digit_pngs)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("digits")
    assert write_digit_pngs(path, size=16, limit=160) == 160
    preprocess_offline(path, out_size=16)
    return str(path)


def test_pngs_decode_to_the_digits(folder):
    x, y = load_digits()[0].tensors
    plain = PNGDigits(folder, augment=False, out_size=16)
    assert len(plain) == 160 and plain.labels.tolist() == y[:160].tolist()
    for i in (0, 7, 159):
        want = Image.fromarray((x[i].view(8, 8) * 255).round().to(torch.uint8).numpy(), mode="L")
        want = np.asarray(want.resize((16, 16), Image.BICUBIC), dtype=np.float32) / 255
        got, label = plain[i]
        assert got.shape == (1, 16, 16) and got.dtype == torch.float32 and int(label) == int(y[i])
        assert torch.equal(got[0], torch.from_numpy(want))          # PNG is lossless
    aug = PNGDigits(folder, augment=True, out_size=16)[0][0]
    assert aug.shape == (1, 16, 16) and 0 <= aug.min() and aug.max() <= 1
    offline = OfflineDigits(f"{folder}/decoded.pt")
    assert torch.equal(offline[7][0].float() / 255, (plain[7][0] * 255).round() / 255)


def test_augment_batch_shape_range_and_seed():
    x = (torch.rand(5, 1, 16, 16) * 255).to(torch.uint8)
    a = augment_batch(x, torch.Generator().manual_seed(1))
    b = augment_batch(x, torch.Generator().manual_seed(1))
    assert a.shape == (5, 1, 16, 16) and a.dtype == torch.float32 and torch.equal(a, b)
    assert 0 <= a.min() and a.max() <= 1 and not torch.equal(a, x.float() / 255)


def test_missing_folder_and_bad_option(tmp_path, folder):
    with pytest.raises(FileNotFoundError, match="write the images first with write_digit_pngs"):
        PNGDigits(tmp_path)
    with pytest.raises(ValueError, match=r"rank 0\): unknown loader option\(s\) \['workers'\]"):
        train_input_pipeline(0, 1, folder, workers=2)


CONFIGS = [{}, {"num_workers": 1, "persistent_workers": True, "prefetch_factor": 3},
           {"pin_memory": True}, {"offline": True}]


def _pipelines(rank, world, folder):
    return [train_input_pipeline(rank, world, folder, epochs=2, batch_size=16, **cfg)
            for cfg in CONFIGS]


@pytest.mark.timeout(150)
def test_data_lane_on_two_ranks(folder):
    results = minidist.run(_pipelines, 2, folder, timeout=120)
    steps = 2 * (160 // 2 // 16)                       # epochs x (shard / batch)
    for rank, per_cfg in enumerate(results):
        for cfg, r in zip(CONFIGS, per_cfg):
            ev = r["events"]
            assert {e.lane for e in ev} == {"data", "main", "comm"}, (rank, cfg)
            assert {e.rank for e in ev} == {rank}
            assert r["steps"] == steps
            waits = [e for e in ev if e.name == "data wait"]
            assert len(waits) == steps + 2                 # + the empty next() ending each epoch
            assert sum(e.name == "loader start" for e in ev) == 2
            assert r["data_s"] == pytest.approx(sum(e.duration for e in ev if e.lane == "data"))
            assert sum(e.name == "backward" for e in ev) == steps
            assert r["comm_s"] > 0 and 0 < r["compute_s"] < r["wall_s"]
            assert all(e.name.startswith("all-reduce b") for e in ev if e.lane == "comm")
            assert np.isfinite(r["loss"])
        pin = per_cfg[2]
        if not torch.cuda.is_available():               # nothing to pin for: torch says so
            assert pin["pinned"] is False
            assert any("no accelerator is found" in w for w in pin["warnings"])
        assert per_cfg[0]["warnings"] == [] and per_cfg[0]["pinned"] is False
