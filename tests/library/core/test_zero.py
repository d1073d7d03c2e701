"""minidist.core.zero against minidist.sharding.ShardedOptimizer (zero.py, zero_backward.py), gloo CPU.

Both pack the trainable parameters in backward's order into one flat buffer padded to a multiple
of W and step rank r's slice with the same inner optimizer; the library's stage 1 runs with
``grads="local"`` (it reduce-scatters the local gradients; the core all-reduces them), its stage 2
reduce-scatters from hooks, as the core does. Both sum, then divide by W; on W = 2 a sum of two
numbers is the same in either order, so the loss and every parameter after every step must be
bit-identical (``torch.equal``), and so must this rank's slice and its optimizer state (momentum,
AdamW's moments): the same layout, not only the same result. Each rank trains on its own data. All cases run in one launch.
"""

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import nn

import minidist
from _drawn import drawn
from minidist import sharding as lib
from minidist.core import zero as core

W = 2
OPTIMIZERS = {"sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
              "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1})}
CASES = st.fixed_dictionaries({
    "optimizer": st.sampled_from(sorted(OPTIMIZERS)),
    "widths": st.lists(st.integers(1, 7), min_size=2, max_size=4),   # depth 1-3, any sizes
    "bias": st.booleans(),
    "frozen": st.integers(-1, 5),   # the parameter frozen, if it exists and is not the only one
    "batch": st.integers(1, 5),
    "steps": st.integers(1, 3),
    "seed": st.integers(0, 2**16),
})



def _model(case):
    torch.manual_seed(case["seed"])
    w = case["widths"]
    layers = [m for a, b in zip(w, w[1:]) for m in (nn.Linear(a, b, bias=case["bias"]), nn.Tanh())]
    model = nn.Sequential(*layers[:-1])
    params = list(model.parameters())
    if 0 <= case["frozen"] < len(params) > 1:
        params[case["frozen"]].requires_grad_(False)
    return model


def _trainable_numel(case):
    return sum(p.numel() for p in _model(case).parameters() if p.requires_grad)


def _my_slice(impl, opt):
    """This rank's slice of the flat buffer and its optimizer state: the layout, not only the result."""
    if impl is core:
        mine = opt.master
    else:
        assert len(opt.buckets) == 1        # the models here are far below one 25 MiB bucket
        mine = opt.buckets[0].shard
    state = opt.optim.state[mine]
    return {"slice": mine.clone(), **{k: v.clone() for k, v in state.items() if torch.is_tensor(v)}}


def _train(impl, case, stage, rank):
    """Loss, parameters, my slice and its optimizer state after every step; each rank draws its
    own batches."""
    model = _model(case)
    cls, kwargs = OPTIMIZERS[case["optimizer"]]
    if impl is core:
        opt = core.ZeroOptimizer(model.parameters(), cls, stage=stage, **kwargs)
    else:
        opt = lib.ShardedOptimizer(model.parameters(), cls, stage=stage, grads="local",
                                   **kwargs)
    g = torch.Generator().manual_seed(case["seed"] + 1 + rank)
    out = {}
    for s in range(case["steps"]):
        x = torch.randn(case["batch"], case["widths"][0], generator=g)
        y = torch.randn(case["batch"], case["widths"][-1], generator=g)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        out[f"step {s} loss"] = loss.detach()
        out.update({f"step {s} {n}": p.detach().clone() for n, p in model.named_parameters()})
        out.update({f"step {s} {k}": v for k, v in _my_slice(impl, opt).items()})
    if hasattr(opt, "close"):
        opt.close()
    return out


def _compare(rank, world_size, cases):
    mismatches = []
    for i, case in enumerate(cases):
        for stage in (1, 2):
            got, want = _train(core, case, stage, rank), _train(lib, case, stage, rank)
            if got.keys() != want.keys():
                mismatches.append((i, stage, "names", sorted(got), sorted(want)))
                continue
            mismatches += [(i, stage, k) for k in want if not torch.equal(got[k], want[k])]
    return mismatches


def test_core_zero_equals_the_library_sharded_optimizer():
    cases = drawn(CASES, 24)
    assert any(_trainable_numel(c) % W for c in cases)   # padding is exercised
    assert {c["optimizer"] for c in cases} == set(OPTIMIZERS)
    assert any(not p.requires_grad for c in cases for p in _model(c).parameters())
    for rank, mismatches in enumerate(minidist.run(_compare, W, cases, timeout=120)):
        assert not mismatches, f"rank {rank}: {[(cases[m[0]], *m[1:]) for m in mismatches]}"
