"""The fault-tolerance chapter's measurements (minidist_course/lessons/fault_tolerant_demo.py, course/16): async
checkpoints overlap training and hold the state at the call; the two DCP traps (collectives on the
default group from the save thread and the main thread deadlock; a per-rank plain tensor under
one key is saved once); a rank SIGKILLed mid-step is named first, within seconds; PowerSGD and
DiLoCo send what their formulas say."""

import os
import time

import pytest
import torch._dynamo  # noqa: F401  (forked ranks build optimizers, which import it)

import minidist
from minidist.data_parallel.compression import ring_allreduce_bytes
from minidist_course.lessons import fault_tolerant_demo as ft_demo


@pytest.mark.timeout(120)
def test_async_save_overlaps_training_and_holds_the_state_at_the_call(tmp_path):
    res = minidist.run(ft_demo.async_save_overlap, 2, str(tmp_path), 1_000_000, 60, timeout=100)
    for r in res:
        assert r["saved_equals_state_at_call"] and r["changed_after_call"], r
        assert r["steps_during_async"] >= 1, r      # training ran while the files were written
        assert r["async_call_s"] < r["async_total_s"], r


@pytest.mark.timeout(90)
def test_async_save_on_the_training_group_deadlocks_and_its_own_group_does_not(tmp_path):
    good = minidist.run(ft_demo.async_save_trap, 2, str(tmp_path / "own"), True, timeout=60)
    assert good == [[3.0] * 4, [3.0] * 4]
    t0 = time.monotonic()
    with pytest.raises(minidist.RankTimeoutError) as info:
        minidist.run(ft_demo.async_save_trap, 2, str(tmp_path / "shared"), False, timeout=8)
    assert time.monotonic() - t0 < 40
    report = str(info.value)
    # both main threads wait in the all-reduce (their save threads in the planning gather)
    assert report.count("distributed_c10d.py") >= 2 and report.count(" all_reduce <- ") == 2, report


@pytest.mark.timeout(60)
def test_dcp_saves_a_per_rank_plain_tensor_once(tmp_path):
    assert minidist.run(ft_demo.dcp_replicated_trap, 2, str(tmp_path), timeout=40) == [[0.0] * 4] * 2


@pytest.mark.timeout(60)
def test_a_rank_killed_mid_step_is_named_first_within_seconds(tmp_path):
    stamp = str(tmp_path / "killed_at")
    with pytest.raises(minidist.RankError) as info:
        minidist.run(ft_demo.killed_mid_step, 2, 1, 3, stamp, timeout=40)
    detect = time.time() - float(open(stamp).read())
    assert str(info.value).startswith("rank 1 failed: rank 1 killed by SIGKILL"), str(info.value)
    assert detect < 15, detect
    assert os.path.exists(stamp)


@pytest.mark.timeout(120)
def test_powersgd_and_diloco_send_what_their_formulas_say():
    steps, h, start = 20, 10, 10
    res = minidist.run(ft_demo.communication_curves, 2, steps, 32, 2, start, h, timeout=100)
    n = res[0]["ddp"]["params"]
    ddp_step = ring_allreduce_bytes(n, 2)
    for method in ("ddp", "powersgd", "diloco"):
        total = sum(sum(r[method]["sent"]) for r in res) / 2
        if method == "ddp":
            assert total == steps * ddp_step
        elif method == "diloco":   # one all-reduce of the model per H steps: exactly 1/H of DDP
            assert total == steps * ddp_step / h
            assert all(s == 0 for r in res for i, s in enumerate(r[method]["sent"]) if (i + 1) % h)
        else:                      # plain steps until start_iter, then rank-2 factors
            per = [sum(r[method]["sent"][i] for r in res) / 2 for i in range(steps)]
            assert per[:start] == [ddp_step] * start
            assert all(p < ddp_step / 3 for p in per[start:]), per
    for r in res:
        for method in ("ddp", "powersgd", "diloco"):
            assert r[method]["final_loss"] < r[method]["loss"][0], (method, r[method]["final_loss"])
