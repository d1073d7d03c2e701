"""The user-loop matrix (``minidist matrix --user-loop``): the library's wrappers in a user's own
loop against one process on the global batch, torch's own wrappers beside them.

Default tier: the judge rejects each plausible wrong result; every case the matrix ever found is
a plain cell here (one launch); hypothesis draws user modules at a fixed budget (one launch
each). Integration tier: the whole matrix, every module x wrapper x event, and the command.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from minidist_course.matrix import main
from minidist_course.matrix.user_loop import EVENTS, STEPS, TORCH, WRAPPERS, cells, run_cells
from minidist_course.matrix.user_models import MODELS
from minidist_course.matrix.user_verdicts import TOL, format_table, judge, torch_fails


def _result(scale=0.0):
    w = {"w": torch.ones(3)}
    return {"final": {"w": w["w"] + scale}, "evals": [torch.zeros(2) + scale],
            "mids": [{"w": torch.ones(3)}]}


def test_the_judge_rejects_a_wrong_value_an_unknown_error_and_a_missing_output():
    want = _result()
    assert judge(_result(), want)[0] == "✓"
    assert judge(_result(10 * TOL), want)[0] == "✗"                  # off by 1e-4
    short = _result()
    short["evals"] = []                                             # an evaluation went missing
    assert judge(short, want)[0] == "✗"
    assert judge("error: RuntimeError: something else", want)[0] == "✗"
    status, detail = judge("error: UnusedParametersError: NaiveDDP (rank 1): 2 parameter(s) "
                           "received no gradient in this backward on some rank", want)
    assert status == "refused" and "Expected to have finished reduction" in detail
    # torch's own words count for torch's rows (its DDP refuses a reentrant checkpoint's reuse)
    assert judge("error: RuntimeError: Expected to mark a variable ready only once. ...",
                 want)[0] == "refused"


# Every case the matrix found, as a plain cell: (module, wrapper, event) -> the status it must
# have. What each was before its fix is on its line.
FOUND = {
    # a hang (naive, flat: mismatched collectives) or an error on one rank only (bucketed)
    ("unused on a rank", "naive", "plain"): "refused",
    ("unused on a rank", "flat", "accumulate"): "refused",
    ("unused on a rank", "bucketed", "eval before step"): "refused",
    # ZeRO-1/2: one rank raised while the other reduce-scattered (a hang): now a zero share
    ("unused on a rank", "zero1", "plain"): "✓",
    ("unused on a rank", "zero2", "accumulate"): "✓",
    ("unused on a rank", "fsdp", "two optimizers"): "✓",
    ("unused on a rank", "hsdp", "accumulate"): "✓",
    # a prefetch left by a no-grad forward was used after the step (3.1e-2)
    ("reused block", "fsdp", "eval before step"): "✓",
    ("reused block", "fsdp", "inference_mode eval"): "✓",
    # a unit reduced twice in one backward raced on its record of who got a gradient (9.3e-2)
    ("torch reentrant checkpoint", "fsdp", "two forwards"): "✓",
    ("torch reentrant checkpoint", "fsdp-keep", "two forwards"): "✓",
    # ZeRO-2 ended the backward when a reentrant checkpoint's nested one ended
    ("torch reentrant checkpoint", "zero2", "two optimizers"): "✓",
    ("torch reentrant checkpoint", "zero2", "two forwards"): "refused",
    ("torch reentrant checkpoint", "bucketed", "plain"): "✓",
    ("torch reentrant checkpoint", "bucketed-unused", "accumulate"): "✓",
    # a parameter frozen after wrapping was "unused on one rank" for every DDP
    ("plain", "naive", "freeze mid-run"): "✓",
    ("plain", "bucketed", "freeze mid-run"): "✓",
    ("tied+frozen+buffer", "fsdp-keep", "eval before step"): "✓",
    ("tied+frozen+buffer", "bucketed", "save and load"): "✓",
    ("minidist checkpoint", "zero2", "save and load"): "✓",
    # torch's own: DDP refuses the reentrant checkpoint's reuse (static_graph needed)
    ("torch reentrant checkpoint", "torch-ddp", "plain"): "refused",
}


@pytest.mark.timeout(200)
def test_every_case_the_matrix_found_stays_fixed():
    todo = list(FOUND) + [("plain", "torch-fsdp2-keep", "eval before step")]
    rows = run_cells(todo, world=2, timeout=180)
    got = {(r["model"], r["wrapper"], r["event"]): r for r in rows}
    wrong = {k: (got[k]["status"], got[k]["detail"]) for k, want in FOUND.items()
             if got[k]["status"] != want}
    assert not wrong, wrong
    # torch's FSDP2 keeps a stale gathered copy after a no-grad forward between backward and
    # step (seen here: 2.07e-1 on 2.14.1; related: pytorch/pytorch#149029); if a later torch fixes it, fine
    torch_row = got["plain", "torch-fsdp2-keep", "eval before step"]
    assert torch_row["status"] == "✓" or float(torch_row["detail"].split()[-1]) > 1e-3, torch_row


modules = st.fixed_dictionaries(dict(
    tie=st.booleans(), frozen=st.booleans(), buffer=st.booleans(), reuse=st.booleans(),
    unused=st.booleans(), recompute=st.sampled_from([None, "torch", "torch-reentrant",
                                                     "minidist"])))


@pytest.mark.timeout(300)
@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(spec=modules, events=st.lists(st.sampled_from(list(EVENTS)), min_size=2, max_size=2,
                                     unique=True))
def test_drawn_modules_are_right_or_refused_by_name_in_every_wrapper(spec, events):
    todo = [("drawn", how, event) for how in WRAPPERS for event in events]
    rows = run_cells(todo, world=2, specs={"drawn": spec}, timeout=120)
    wrong = [r for r in rows if r["status"] == "✗"]
    assert not wrong, (spec, format_table(wrong))


@pytest.mark.exhaustive
@pytest.mark.serial        # one launch of 2 ranks for 76 s: 945 cells
@pytest.mark.timeout(900)
def test_the_whole_matrix_has_no_wrong_cell_of_minidist(capsys):
    todo = cells()
    assert len(todo) == len(MODELS) * (len(WRAPPERS) + len(TORCH)) * len(EVENTS)
    rows = run_cells(todo, world=2, timeout=800)
    mine = [r for r in rows if not r["wrapper"].startswith("torch")]
    assert not [r for r in mine if r["status"] == "✗"], format_table(mine)
    assert sum(r["status"] == "✓" for r in mine) > 0.8 * len(mine)
    # the references really ran, and where torch fails the row says why
    theirs = [r for r in rows if r["wrapper"].startswith("torch")]
    assert all(r["status"] != "✗" or r["detail"].startswith("not run")
               or r["event"] in ("eval before step", "inference_mode eval") for r in theirs)
    assert all(torch_fails(MODELS[r["model"]], r["wrapper"]) for r in theirs
               if r["detail"].startswith("not run"))
    print(format_table(rows), f"\n{STEPS} steps per cell")


@pytest.mark.exhaustive
@pytest.mark.timeout(600)
def test_the_command_prints_the_table_and_exits_0(capsys):
    assert main(["--user-loop", "--quick"]) == 0
    out = capsys.readouterr().out
    assert "user-loop matrix:" in out and "cells:" in out and "0 ✗" not in out.split("\n")[0]
    assert "minidist: " in out and "right or refused by name" in out
