"""minidist.core.fsdp against minidist.sharding.fully_shard (per-parameter, reshard after forward), gloo CPU.

Both shard each block of the same seeded MLP, then the root, and train a few steps on per-rank
data. The layouts are the same (dim 0 padded to W·c rows, rank r keeps rows r·c ..), an all-gather
only moves data, and on W = 2 the reduce-scatter adds two numbers, whose sum is the same in either
order, then both divide by W: each rank's shards, their last gradients and the losses of every step
must be bit-identical (``torch.equal``). All hypothesis cases run inside one launch.
"""

import torch
from hypothesis import strategies as st
from torch import nn

import minidist
from _drawn import drawn
from minidist.core import fsdp as core
from minidist.sharding import fsdp as lib

W = 2
CASES = st.fixed_dictionaries({
    "widths": st.lists(st.integers(1, 7), min_size=2, max_size=4),   # the input, then each block's
    "head": st.booleans(),               # the root owns a Linear head, or no parameter at all
    "bias": st.booleans(),
    "frozen": st.one_of(st.none(), st.integers(0, 15)),   # which parameter (mod count) is frozen
    "batch": st.integers(1, 4),
    "steps": st.integers(1, 3),
    "optimizer": st.sampled_from(["sgd", "adamw"]),
    "seed": st.integers(0, 2**16),
})


class Block(nn.Module):
    def __init__(self, n_in, n_out, bias):
        super().__init__()
        self.linear = nn.Linear(n_in, n_out, bias=bias)

    def forward(self, x):
        return torch.tanh(self.linear(x))



def _build(case, shard):
    torch.manual_seed(case["seed"])
    w = case["widths"]
    blocks = [Block(a, b, case["bias"]) for a, b in zip(w, w[1:])]
    model = nn.Sequential(*blocks, *([nn.Linear(w[-1], 3, bias=case["bias"])] if case["head"] else []))
    params = list(model.parameters())
    if case["frozen"] is not None and len(params) > 1:   # something is left to train
        params[case["frozen"] % len(params)].requires_grad_(False)
    for b in blocks:
        shard(b)
    return shard(model)


def _train(shard, case, rank):
    model = _build(case, shard)
    params = list(model.parameters())
    opt = (torch.optim.SGD(params, lr=0.1, momentum=0.9) if case["optimizer"] == "sgd"
           else torch.optim.AdamW(params, lr=0.01))
    g = torch.Generator().manual_seed(case["seed"] + 1 + rank)   # each rank its own data
    out_width = 3 if case["head"] else case["widths"][-1]
    losses = []
    for _ in range(case["steps"]):
        x = torch.randn(case["batch"], case["widths"][0], generator=g)
        y = torch.randn(case["batch"], out_width, generator=g)
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    result = {"losses": torch.stack(losses),
              **{n: p.detach().clone() for n, p in model.named_parameters()},
              **{"grad " + n: p.grad for n, p in model.named_parameters() if p.grad is not None}}
    if shard is lib.fully_shard:
        lib.close_units(model)
    return result


def _compare(rank, world_size, cases):
    mismatches = []
    for i, case in enumerate(cases):
        got, want = _train(core.shard, case, rank), _train(lib.fully_shard, case, rank)
        if got.keys() != want.keys():
            mismatches.append((i, "names", sorted(got), sorted(want)))
            continue
        mismatches += [(i, k) for k in want if not torch.equal(got[k], want[k])]
    return mismatches


def test_core_units_equal_the_library_units():
    cases = drawn(CASES, 24)
    for rank, mismatches in enumerate(minidist.run(_compare, W, cases, timeout=120)):
        assert not mismatches, f"rank {rank}: {[(cases[m[0]], *m[1:]) for m in mismatches]}"
