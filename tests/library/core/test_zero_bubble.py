"""minidist.core.zero_bubble against minidist.pipeline_parallel (split_backward.py, zero_bubble.py).

B and W on one module, in one process: dL/dx and every weight gradient bit-identical to the
library's graph-cutting split (the same autograd nodes compute them). ZB-H1: the same ops in the
same order on every stage; in one launch of P = 3 ranks the core's B/W engine and the library's
engine give the same loss and gradients, bit for bit (``torch.equal``).
"""

import copy

import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from minidist import pipeline_parallel as lib
from minidist.core import zero_bubble as core
from minidist.pipeline_parallel import split_backward

from test_pipeline import check_against_library


class Residual(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(width), nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(),
                                                                 nn.Linear(2 * width, width))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


def _module(kind, width):
    if kind == "linear":
        return nn.Linear(width, width + 1)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(width, 3), nn.Tanh(), nn.Linear(3, width))
    return Residual(width)


@settings(max_examples=25, deadline=None)
@given(kind=st.sampled_from(["linear", "mlp", "residual"]), width=st.integers(1, 6),
       lead=st.lists(st.integers(1, 5), min_size=1, max_size=2), micro_batches=st.integers(1, 3),
       seed=st.integers(0, 2**16))
def test_b_then_w_equals_the_library_split(kind, width, lead, micro_batches, seed):
    torch.manual_seed(seed)
    mine = _module(kind, width)
    theirs = copy.deepcopy(mine)
    for i in range(micro_batches):   # W accumulates into .grad across micro-batches
        x = torch.randn(*lead, width)
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        y1, y2 = mine(x1), theirs(x2)
        dy = torch.randn(y1.shape)
        dx = core.backward_input(y1, dy, x1)
        want_dx, pending = split_backward.backward_input(y2, dy, x2, theirs.parameters())
        if i == 0:
            assert all(p.grad is None for p in mine.parameters()), "B changed a weight gradient"
        assert torch.equal(dx, want_dx)
        core.backward_weight(y1, dy, mine.parameters())
        split_backward.backward_weight(pending)
    for (name, p), q in zip(mine.named_parameters(), theirs.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_zb_h1_lists_the_library_ops_in_the_same_order():
    for stages in range(1, 9):
        for M in range(1, 13):
            want = lib.zb_h1(stages, M)
            for r in range(stages):
                assert core.zb_h1(stages, M, r) == [(op.kind, op.mb) for op in want[r]], (stages, M, r)


def test_core_zb_h1_step_equals_the_library_engine():
    check_against_library(core.pipeline_step, lib.zb_h1)
