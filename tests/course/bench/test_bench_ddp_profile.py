"""`bench_ddp(profile=True)`: the per-step breakdown is reported for every variant (no timing asserts)."""

from minidist_course.bench.data_parallel import bench_ddp


def test_profile_reports_cpu_wait_and_comm_per_variant(capsys):
    out = bench_ddp(world_size=2, steps=2, warmup=1, model="mlp", batch_size=4, bucket_cap_mb=1.0,
                    timeout=300, profile=True)
    assert len(out["profile"]) == 2  # one per rank
    for prof in out["profile"]:
        assert set(prof) == {"torch", "torch-again", "minidist", "bucketed+torch", "flat"}
        for name, p in prof.items():
            assert p["step_s"] > 0 and p["cpu_s"] >= 0 and p["minor_faults"] >= 0
            assert p["step_spread_s"][0] <= p["step_s"] <= p["step_spread_s"][1]
            assert ("wait_s" in p) == (name in ("minidist", "bucketed+torch"))
        assert prof["torch"]["ratio"] == 1.0
    text = capsys.readouterr().out
    assert "BucketedDDP, torch's ring" in text and "CPU ms" in text and "wait ms" in text
    assert "faults" in text


def test_minor_faults_count_memory_touched_for_the_first_time():
    import platform

    import torch

    from minidist_course.bench.data_parallel import _minor_faults
    if platform.system() not in ("Linux", "Darwin"):
        assert _minor_faults() == 0
        return
    before = _minor_faults()
    fresh = torch.empty(64 * 2**20, dtype=torch.uint8)   # above glibc's mmap threshold: new pages
    fresh.fill_(1)
    assert _minor_faults() > before
