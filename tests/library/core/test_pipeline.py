"""minidist.core.pipeline against minidist.pipeline_parallel (schedules.py, engine.py), gloo CPU.

The schedules must list the same ops in the same order on every stage. In one launch of P = 3
ranks, both engines run the same stages on the same batches: the loss and every gradient must be
bit-identical (``torch.equal``): the same micro-batches, loss weights and order of accumulation.
"""

import copy

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import nn

import minidist
from _drawn import drawn
from minidist import pipeline_parallel as lib
from minidist.core import pipeline as core

P = 3
CASES = st.fixed_dictionaries({
    "M": st.integers(1, 5),
    "extra": st.integers(0, 6),                               # N = M + extra: ragged micro-batches
    "widths": st.lists(st.integers(1, 6), min_size=P + 1, max_size=P + 1),
    "seed": st.integers(0, 2**16),
})



def test_one_f_one_b_lists_the_library_ops_in_the_same_order():
    for stages in range(1, 9):
        for M in range(1, 13):
            want = lib.one_f_one_b(stages, M)
            for r in range(stages):
                assert core.one_f_one_b(stages, M, r) == [(op.kind, op.mb) for op in want[r]], (stages, M, r)


def _stage_and_batch(case, rank):
    torch.manual_seed(case["seed"])
    w = case["widths"]
    stages = [nn.Sequential(nn.Linear(w[s], w[s + 1]), nn.Tanh()) for s in range(P)]
    g = torch.Generator().manual_seed(case["seed"] + 1)
    N = case["M"] + case["extra"]
    return stages[rank], torch.randn(N, w[0], generator=g), torch.randn(N, w[-1], generator=g)


def _compare(rank, world_size, cases, core_step, schedule):
    mismatches = []
    for i, case in enumerate(cases):
        stage, x, y = _stage_and_batch(case, rank)
        mine = copy.deepcopy(stage)
        want = lib.pipeline_step(schedule(P, case["M"]), {rank: stage}, x, y, F.mse_loss).loss
        got = core_step(mine, x, y, F.mse_loss, case["M"])
        if got != want:
            mismatches.append((i, "loss", got, want))
        mismatches += [(i, n) for (n, p), q in zip(stage.named_parameters(), mine.parameters())
                       if not torch.equal(p.grad, q.grad)]
    return mismatches


def check_against_library(core_step, schedule, n_cases=16):
    cases = drawn(CASES, n_cases)
    results = minidist.run(_compare, P, cases, core_step, schedule, timeout=120)
    for rank, mismatches in enumerate(results):
        assert not mismatches, f"rank {rank}: {[(cases[m[0]], *m[1:]) for m in mismatches]}"


def test_core_1f1b_step_equals_the_library_engine():
    check_against_library(core.pipeline_step, lib.one_f_one_b)
