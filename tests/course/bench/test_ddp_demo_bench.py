"""The `minidist demo` DDP rows and `minidist bench ddp` (smoke: they run and report sane numbers)."""

import torch._dynamo  # noqa: F401  (forked ranks build optimizers, which import it: 5-10 s each)

from minidist_course.bench.data_parallel import bench_ddp
from minidist_course.lessons.data_parallel_demo import demo_rows


def test_demo_rows_world_size_2():
    rows = demo_rows(world_sizes=(2,))
    assert [r["check"] for r in rows] == ["digits accuracy: DDP vs one process (MLP)",
                                          "parameters equal one process on the global batch",
                                          "replicas bit-identical across ranks"]
    for r in rows:
        assert r["section"] == "DDP" and r["world_size"] == 2 and r["ok"], r
        assert set(r) == {"section", "check", "world_size", "max_error", "ok", "detail"}
    assert "one process" in rows[0]["detail"] and "the error column is the gap" in rows[0]["detail"]


def test_bench_ddp_small_mlp(capsys):
    out = bench_ddp(world_size=2, steps=2, warmup=1, model="mlp", batch_size=4,
                    bucket_cap_mb=1.0)
    assert out["n_buckets"] > 1 and out["minidist_s"] > 0 and out["torch_s"] > 0
    assert 0 < out["ratio"] < 100
    assert 0.0 <= out["hidden_share"] <= 1.0
    text = capsys.readouterr().out
    assert "torch DDP" in text and "minidist BucketedDDP" in text and "hidden behind backward" in text
    assert 0 < out["control_ratio"] < 100 and "torch DDP again (control)" in text
    assert "noise: torch DDP against itself" in text


def test_bench_ddp_control_can_be_left_out(capsys):
    out = bench_ddp(world_size=2, steps=3, warmup=0, model="mlp", batch_size=4, bucket_cap_mb=1.0,
                    with_flat=False, control=False)
    assert "control_ratio" not in out and "control" not in capsys.readouterr().out
