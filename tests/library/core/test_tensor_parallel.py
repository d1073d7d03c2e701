"""minidist.core.tensor_parallel against minidist.tensor_parallel (regions.py, layers.py), gloo CPU.

Both build their shards from the same seeded ``nn.Linear``; on W = 2 an all-reduce adds two
numbers, whose sum is the same in either order, so weights, outputs and every gradient must be
bit-identical (``torch.equal``). All hypothesis cases run inside one launch.
"""

import torch
from hypothesis import strategies as st

import minidist
from _drawn import drawn
from minidist import tensor_parallel as lib
from minidist.core import tensor_parallel as core

W = 2
CASES = st.fixed_dictionaries({
    "layer": st.sampled_from(["column", "row", "mlp"]),
    "lead": st.lists(st.integers(1, 5), min_size=1, max_size=2),   # batch dims, any size
    "free": st.integers(1, 7),           # the unsplit dimension: any size, not only multiples of W
    "split": st.integers(1, 4).map(lambda k: k * W),   # the split dimension: a multiple of W
    "bias": st.booleans(),
    "seed": st.integers(0, 2**16),
})



def _build(impl, case):
    torch.manual_seed(case["seed"])
    free, split, bias = case["free"], case["split"], case["bias"]
    if case["layer"] == "column":
        return impl.ColumnParallelLinear(free, split, bias=bias)
    if case["layer"] == "row":
        return impl.RowParallelLinear(split, free, bias=bias)
    return torch.nn.Sequential(impl.ColumnParallelLinear(free, split, bias=bias), torch.nn.Tanh(),
                               impl.RowParallelLinear(split, free, bias=bias))


def _run(model, case, rank):
    g = torch.Generator().manual_seed(case["seed"] + 1)   # the same draws on every rank
    width = case["split"] if case["layer"] == "row" else case["free"]
    x = torch.randn(*case["lead"], width, generator=g)
    if case["layer"] == "row":      # a row layer takes this rank's slice of the input features
        x = x.chunk(W, -1)[rank].contiguous()
    x.requires_grad_()
    y = model(x)
    y.backward(torch.randn(y.shape, generator=g))
    return {"y": y.detach(), "dx": x.grad, **{n: p.detach().clone() for n, p in model.named_parameters()},
            **{"grad " + n: p.grad for n, p in model.named_parameters()}}


def _compare(rank, world_size, cases):
    mismatches = []
    for i, case in enumerate(cases):
        got, want = _run(_build(core, case), case, rank), _run(_build(lib, case), case, rank)
        if got.keys() != want.keys():
            mismatches.append((i, "names", sorted(got), sorted(want)))
            continue
        mismatches += [(i, k) for k in want if not torch.equal(got[k], want[k])]
    return mismatches


def test_core_layers_equal_the_library_layers():
    cases = drawn(CASES, 24)
    for rank, mismatches in enumerate(minidist.run(_compare, W, cases, timeout=120)):
        assert not mismatches, f"rank {rank}: {[(cases[m[0]], *m[1:]) for m in mismatches]}"
