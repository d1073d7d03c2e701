"""minidist.core.ddp against minidist.data_parallel.BucketedDDP, gloo CPU, W = 2.

Both wrap the same seeded MLP (built from a different seed on each rank, so the broadcast from
rank 0 matters), get the same batches (each rank its own) and take a few optimizer steps. Both
average as sum then divide by W, and on W = 2 a sum of two numbers is the same in either order,
so losses, gradients and parameters after every step must be bit-identical (``torch.equal``).
Bucketing changes no value, so the bucket layouts are compared too. All cases run in one launch.
"""

import torch
from hypothesis import strategies as st

import minidist
from _drawn import drawn
from minidist.core import ddp as core
from minidist.data_parallel import BucketedDDP

W = 2
CASES = st.fixed_dictionaries({
    "widths": st.lists(st.integers(1, 9), min_size=3, max_size=5),   # in, hidden..., out: any size
    "bias": st.booleans(),
    "frozen": st.one_of(st.none(), st.integers(0, 9)),   # a frozen parameter (index mod count)
    "cap": st.tuples(st.sampled_from(["shift", "prefix"]), st.integers(0, 9)),   # see _cap_mb
    "batch": st.integers(1, 5),
    "steps": st.integers(1, 3),
    "optimizer": st.sampled_from(["sgd", "adamw"]),
    "seed": st.integers(0, 2**16),
})



def _model(case, rank):
    torch.manual_seed(case["seed"] + rank)    # different on each rank: the wrapper broadcasts
    w = case["widths"]
    layers = []
    for i, (a, b) in enumerate(zip(w, w[1:])):
        layers += [torch.nn.Linear(a, b, bias=case["bias"])] + ([torch.nn.Tanh()] if i < len(w) - 2 else [])
    model = torch.nn.Sequential(*layers)
    params = list(model.parameters())
    if case["frozen"] is not None and len(params) > 1:
        params[case["frozen"] % len(params)].requires_grad_(False)
    return model


def _cap_mb(model, case):
    """``("shift", k)``: the model's bytes / 2**k (0: one bucket, 9: mostly one per parameter);
    ``("prefix", k)``: exactly the bytes of the first k+1 gradients (a bucket that meets its cap)."""
    sizes = [p.numel() * 4 for p in reversed(list(model.parameters())) if p.requires_grad]
    rule, k = case["cap"]
    cap = sum(sizes[: k % len(sizes) + 1]) if rule == "prefix" else max(1, sum(sizes) >> k)
    return cap / 2**20


def _train(wrap, case, rank):
    """Per step: the loss, the averaged gradients, the parameters after the step; and the buckets."""
    model = _model(case, rank)
    ddp, layout = wrap(model, _cap_mb(model, case))
    opt = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if case["optimizer"] == "sgd"
           else torch.optim.AdamW(model.parameters(), lr=0.01))
    g = torch.Generator().manual_seed(case["seed"] * W + rank)   # this rank's batches
    out = {"buckets": layout}
    for step in range(case["steps"]):
        x = torch.randn(case["batch"], case["widths"][0], generator=g)
        y = torch.randn(case["batch"], case["widths"][-1], generator=g)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        out[f"loss {step}"] = loss.detach()
        for n, p in model.named_parameters():
            out[f"grad {n} {step}"] = None if p.grad is None else p.grad.clone()
        opt.step()
        out.update({f"{n} {step}": p.detach().clone() for n, p in model.named_parameters()})
    return out, ddp


def _core(model, cap_mb):
    ddp, names = core.DDP(model, bucket_cap_mb=cap_mb), {p: n for n, p in model.named_parameters()}
    return ddp, [[names[p] for p in b.params] for b in ddp.buckets]


def _lib(model, cap_mb):
    ddp = BucketedDDP(model, bucket_cap_mb=cap_mb)
    return ddp, [row["params"] for row in ddp.bucket_layout()]


def _same(a, b):
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return torch.equal(a, b)
    return a == b


def _compare(rank, world_size, cases):
    mismatches = []
    for i, case in enumerate(cases):
        got, _ = _train(_core, case, rank)
        want, lib = _train(_lib, case, rank)
        lib.close()
        if got.keys() != want.keys():
            mismatches.append((i, "names", sorted(got), sorted(want)))
            continue
        mismatches += [(i, k) for k in want if not _same(got[k], want[k])]
    return mismatches


def test_core_ddp_equals_the_library_bucketed_ddp():
    cases = drawn(CASES, 40)
    for rank, mismatches in enumerate(minidist.run(_compare, W, cases, timeout=120)):
        assert not mismatches, f"rank {rank}: {[(cases[m[0]], *m[1:]) for m in mismatches]}"
