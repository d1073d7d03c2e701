"""Tensor-parallel region operators and layers against torch's single-process layers (gloo, CPU).

Tolerance: 1e-6 relative (2-norm, see minidist_course.references.tensor_parallel) in fp32 — TP only changes the order of additions.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import minidist
from minidist.tensor_parallel import regions as AG
from minidist.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                      VocabParallelEmbedding, gather_state_dict, regions as R)
from minidist_course.references.tensor_parallel import max_rel_error, rel_error

TOL = 1e-6


def _randn(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _ref_grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


# ---------------------------------------------------------------- region operators
def _regions_case(rank, world):
    out = {}
    x = torch.ones(3, 4, requires_grad=True)
    ((rank + 1) * R.copy_to_tensor_model_parallel_region(x)).sum().backward()
    out["f_fwd_is_identity"] = True
    out["f_grad"] = x.grad.clone()                   # sum of (r+1) = W(W+1)/2
    x = torch.full((2,), float(rank + 1), requires_grad=True)
    y = R.reduce_from_tensor_model_parallel_region(x)
    (y * 3).sum().backward()
    out["g_fwd"], out["g_grad"] = y.detach(), x.grad.clone()   # W(W+1)/2 and 3 (identity)
    x = torch.arange(8.0).repeat(2, 1).requires_grad_()
    s = R.scatter_to_tensor_model_parallel_region(x)
    (s * (rank + 1)).sum().backward()
    out["scatter_fwd"], out["scatter_grad"] = s.detach(), x.grad.clone()
    x = torch.full((2, 8 // world), float(rank), requires_grad=True)
    g = R.gather_from_tensor_model_parallel_region(x)
    (g * torch.arange(8.0)).sum().backward()
    out["gather_fwd"], out["gather_grad"] = g.detach(), x.grad.clone()
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_region_operators_forward_and_backward(world):
    res = minidist.run(_regions_case, world, timeout=60)
    tri = world * (world + 1) / 2
    for r, o in enumerate(res):
        assert torch.equal(o["f_grad"], torch.full((3, 4), tri)), "f's backward must all-reduce"
        assert torch.equal(o["g_fwd"], torch.full((2,), tri)), "g's forward must all-reduce"
        assert torch.equal(o["g_grad"], torch.full((2,), 3.0)), "g's backward is the identity"
        width = 8 // world
        sl = slice(r * width, (r + 1) * width)
        assert torch.equal(o["scatter_fwd"], torch.arange(8.0)[sl].repeat(2, 1))
        want = torch.cat([torch.full((2, width), float(q + 1)) for q in range(world)], dim=1)
        assert torch.equal(o["scatter_grad"], want), "scatter's backward all-gathers"
        assert torch.equal(o["gather_fwd"],
                           torch.arange(world, dtype=torch.float).repeat_interleave(width).repeat(2, 1))
        assert torch.equal(o["gather_grad"], torch.arange(8.0)[sl].repeat(2, 1)), "gather's backward splits"


def _split_error_case(rank, world):
    R.scatter_to_tensor_model_parallel_region(torch.ones(2, 5))


def test_split_not_divisible_is_a_clear_error():
    with pytest.raises(minidist.RankError, match=r"rank 0.*not divisible by the tensor-parallel size 2"):
        minidist.run(_split_error_case, 2, timeout=60)


# ---------------------------------------------------------------- column / row / embedding
def _column_case(rank, world, gather_output, bias):
    torch.manual_seed(0)
    ref = nn.Linear(6, 8, bias=bias)
    torch.manual_seed(0)
    tp = ColumnParallelLinear(6, 8, bias=bias, gather_output=gather_output)
    init = max_rel_error(gather_state_dict(tp), ref.state_dict())[0]
    x, w = _randn(3, 5, 6), _randn(3, 5, 8, seed=2)
    xr, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
    yr = ref(xr)
    (yr * w).sum().backward()
    yt = tp(xt)
    if gather_output:
        (yt * w).sum().backward()
        out_err = rel_error(yt, yr)
    else:
        (yt * R.split_along(w, -1)).sum().backward()
        out_err = rel_error(yt, R.split_along(yr, -1))
    return {"init": init, "out": out_err, "x.grad": rel_error(xt.grad, xr.grad),
            "w.grad": max_rel_error(gather_state_dict(tp, grads=True), _ref_grads(ref))[0]}


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("gather_output,bias", [(False, True), (True, False)])
def test_column_parallel_linear_matches_nn_linear(world, gather_output, bias):
    for errs in minidist.run(_column_case, world, gather_output, bias, timeout=60):
        assert errs["init"] == 0.0, "same seed must give the same full weight"
        assert max(errs.values()) < TOL, errs


def _row_case(rank, world, input_is_parallel):
    torch.manual_seed(0)
    ref = nn.Linear(8, 5)
    torch.manual_seed(0)
    tp = RowParallelLinear(8, 5, input_is_parallel=input_is_parallel)
    init = max_rel_error(gather_state_dict(tp), ref.state_dict())[0]
    x, w = _randn(4, 8), _randn(4, 5, seed=2)
    xr = x.clone().requires_grad_()
    (ref(xr) * w).sum().backward()
    xt = (R.split_along(x, -1) if input_is_parallel else x).clone().requires_grad_()
    yt = tp(xt)
    (yt * w).sum().backward()
    want_xgrad = R.split_along(xr.grad, -1) if input_is_parallel else xr.grad
    return {"init": init, "out": rel_error(yt, ref(x)), "x.grad": rel_error(xt.grad, want_xgrad),
            "w.grad": max_rel_error(gather_state_dict(tp, grads=True), _ref_grads(ref))[0]}


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("input_is_parallel", [True, False])
def test_row_parallel_linear_matches_nn_linear(world, input_is_parallel):
    for errs in minidist.run(_row_case, world, input_is_parallel, timeout=60):
        assert errs["init"] == 0.0
        assert max(errs.values()) < TOL, errs


def _embedding_case(rank, world):
    torch.manual_seed(0)
    ref = nn.Embedding(10, 6)
    torch.manual_seed(0)
    tp = VocabParallelEmbedding(10, 6)
    ids = torch.tensor([[0, 9, 3, 3], [5, 1, 9, 0]])
    w = _randn(2, 4, 6)
    (ref(ids) * w).sum().backward()
    yt = tp(ids)
    (yt * w).sum().backward()
    pad_rows = tp.weight.grad[max(0, 10 - tp.vocab_start):] if tp.vocab_end > 10 else None
    return {"init": max_rel_error(gather_state_dict(tp), ref.state_dict())[0],
            "out": rel_error(yt, ref(ids)),
            "w.grad": max_rel_error(gather_state_dict(tp, grads=True), _ref_grads(ref))[0],
            "pad_grad": 0.0 if pad_rows is None else pad_rows.abs().max().item(),
            "local_rows": tp.weight.shape[0]}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_vocab_parallel_embedding_matches_nn_embedding(world):
    res = minidist.run(_embedding_case, world, timeout=60)
    padded = -(-10 // world) * world
    for errs in res:
        assert errs.pop("local_rows") == padded // world
        assert errs["init"] == 0.0
        assert max(errs.values()) < TOL, errs


def _bad_ids_case(rank, world):
    VocabParallelEmbedding(10, 4)(torch.tensor([3, 10]))


def test_embedding_ids_out_of_range_is_a_clear_error():
    with pytest.raises(minidist.RankError, match=r"rank 0.*ids must be in \[0, 10\).*max 10"):
        minidist.run(_bad_ids_case, 2, timeout=60)


def _bad_column_case(rank, world):
    ColumnParallelLinear(4, 6)


def test_column_out_features_not_divisible_is_a_clear_error():
    with pytest.raises(minidist.RankError, match=r"ColumnParallelLinear \(rank 0\): out_features=6 "
                                                 r"is not divisible by the tensor-parallel size 4"):
        minidist.run(_bad_column_case, 4, timeout=60)


# ---------------------------------------------------------------- a missing or extra f or g
class _TPMLP(nn.Module):
    """relu(x W1) W2 with W1 column- and W2 row-parallel; ``variant`` breaks one operator."""

    def __init__(self, variant):
        super().__init__()
        self.fc1 = ColumnParallelLinear(4, 8, bias=False)
        self.fc2 = RowParallelLinear(8, 4, bias=False)
        self.variant = variant

    def forward(self, x):
        h = F.linear(x, self.fc1.weight) if self.variant == "no_f" else self.fc1(x)
        partial = F.linear(torch.relu(h), self.fc2.weight)
        if self.variant == "no_g":
            return partial
        if self.variant == "extra_backward_all_reduce":
            return AG.all_reduce(partial)          # all-reduce forward AND backward
        return R.reduce_from_tensor_model_parallel_region(partial)


def _mlp_case(rank, world, variant, steps):
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 8, bias=False), nn.ReLU(), nn.Linear(8, 4, bias=False))
    torch.manual_seed(0)
    tp = _TPMLP(variant)
    opt_r = torch.optim.Adam(ref.parameters(), lr=1e-2)
    opt_t = torch.optim.Adam(tp.parameters(), lr=1e-2)
    names = {"0.weight": "fc1.weight", "2.weight": "fc2.weight"}
    worst = {"out": 0.0, "x.grad": 0.0, "w.grad": 0.0, "weights": 0.0}
    for step in range(steps):
        x = _randn(5, 4, seed=10 + step)
        xr, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
        yr, yt = ref(xr), tp(xt)
        (yr ** 2).sum().backward()
        (yt ** 2).sum().backward()
        grads = gather_state_dict(tp, grads=True)
        errs = {"out": rel_error(yt, yr), "x.grad": rel_error(xt.grad, xr.grad),
                "w.grad": max(rel_error(grads[names[k]], p.grad) for k, p in ref.named_parameters())}
        opt_r.step(), opt_t.step(), opt_r.zero_grad(), opt_t.zero_grad()
        full = gather_state_dict(tp)
        errs["weights"] = max(rel_error(full[names[k]], p) for k, p in ref.named_parameters())
        worst = {k: max(worst[k], errs[k]) for k in worst}
    return worst


@pytest.mark.parametrize("world", [1, 2, 4])
def test_parallel_mlp_matches_and_stays_equal_over_adam_steps(world):
    for worst in minidist.run(_mlp_case, world, "correct", 3, timeout=60):
        assert max(worst.values()) < TOL, worst


@pytest.mark.parametrize("variant,broken", [("no_f", "x.grad"), ("no_g", "out"),
                                            ("extra_backward_all_reduce", "x.grad")])
def test_equality_check_catches_a_broken_f_or_g(variant, broken):
    """A missing f or g, or an extra all-reduce: each broken variant must fail the very check the correct layer passes."""
    for worst in minidist.run(_mlp_case, 2, variant, 1, timeout=60):
        assert worst[broken] > 1e-2, (variant, worst)
