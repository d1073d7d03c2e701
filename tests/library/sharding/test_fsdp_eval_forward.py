"""An evaluation forward in the user's own loop, under ``torch.no_grad()`` or
``torch.inference_mode()``, after the step or between backward and step, with every layout and
both reshard modes: the evaluation outputs and the trained weights equal one process on the global
batch (fp32, 1e-6: only the order of the sums differs).

With ``reshard_after_forward=False`` a no-grad forward has no backward to free its gathered
parameters: it used to leave them bound to the module, so ``full_state_dict`` raised that every
parameter "belongs to no fully_shard unit", and the next forward after an optimizer step would
have used the stale gathered copy. torch's FSDP2 (2.14) does the latter: an eval forward between
backward and step under ``reshard_after_forward=False`` makes the next training forward use the
pre-step parameters (seen here on 2.14.1; related: pytorch/pytorch#149029, the parameters left unsharded after such a forward); the same launch measures that and this library is
right where it is not.
"""
import itertools

import pytest
import torch
import torch.nn.functional as F

import minidist
import _sharding_cases as S
from minidist.sharding import fsdp, fsdp_state

TOL = 1e-6
VARIANTS = [(where, mode, per_param, reshard) for where, mode, per_param, reshard in
            itertools.product(("before-step", "after-step"), ("no_grad", "inference_mode"),
                              (True, False), (True, False))]


def _loop(rank, world, how, reshard=True, per_param=True, where="after-step", mode="no_grad"):
    m = S.make(S.case())
    if how == "fsdp":
        for b in m.blocks:
            fsdp.fully_shard(b, reshard_after_forward=reshard, per_parameter=per_param)
        fsdp.fully_shard(m, reshard_after_forward=reshard, per_parameter=per_param)
    elif how == "torch":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (world,))
        for b in m.blocks:
            fully_shard(b, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(m, mesh=mesh, reshard_after_forward=reshard)
    opt = torch.optim.AdamW(m.parameters(), lr=0.02)
    n = S.BATCH // world
    evals, guard = [], torch.no_grad if mode == "no_grad" else torch.inference_mode
    for step in range(3):
        x, y = S.batch(step)
        opt.zero_grad()
        F.mse_loss(m(x[rank * n:(rank + 1) * n]), y[rank * n:(rank + 1) * n]).backward()
        if where == "before-step":
            with guard():
                evals.append(m(S.batch(99)[0][:3]).clone())
        opt.step()
        if where == "after-step":
            with guard():
                evals.append(m(S.batch(99)[0][:3]).clone())
    if how == "fsdp":
        return fsdp_state.full_state_dict(m), evals
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in m.state_dict().items()}, evals


def _error(a, b) -> float:
    return max([(a[0][k] - b[0][k]).abs().max().item() for k in b[0]]
               + [(p - q).abs().max().item() for p, q in zip(a[1], b[1])])


def _every_variant(rank, world):
    out = {}
    for v in VARIANTS:
        where, mode, per_param, reshard = v
        try:
            out[v] = _loop(rank, world, "fsdp", reshard, per_param, where, mode)
        except RuntimeError as e:
            out[v] = str(e)
    out["torch"] = _loop(rank, world, "torch", False, True, "before-step", "no_grad")
    return out


@pytest.mark.timeout(180)
def test_an_eval_forward_in_the_users_loop_leaves_every_layout_right():
    refs = {(where, mode): _loop(0, 1, "single", where=where, mode=mode)
            for where in ("before-step", "after-step") for mode in ("no_grad", "inference_mode")}
    out = minidist.run(_every_variant, 2, timeout=150)[0]
    wrong = {v: out[v] if isinstance(out[v], str) else _error(out[v], refs[v[:2]])
             for v in VARIANTS}
    assert all(not isinstance(e, str) and e < TOL for e in wrong.values()), wrong
    torch_error = _error(out["torch"], refs[("before-step", "no_grad")])
    # torch's FSDP2 is stale here (measured 6.3e-2 on 2.14.1); if a later torch fixes it, fine
    assert torch_error < TOL or torch_error > 1e-3, torch_error


class _Reused(torch.nn.Module):
    """Block 0 runs twice: its second use prefetches block 1 again, after block 1 ran."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))

    def forward(self, x):
        for b in (self.blocks[0], self.blocks[1], self.blocks[0]):
            x = torch.tanh(b(x))
        return x


def _reused_block_loop(rank, world):
    torch.manual_seed(0)
    m = _Reused()
    if world > 1:
        for b in m.blocks:
            fsdp.fully_shard(b)
        fsdp.fully_shard(m)
    opt = torch.optim.AdamW(m.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    x, probe = torch.randn(3, 8, 4, generator=g), torch.randn(2, 4, generator=g)
    rows = slice(rank * 8 // world, (rank + 1) * 8 // world)
    evals = []
    for step in range(3):
        opt.zero_grad()
        m(x[step, rows]).pow(2).mean().backward()
        with torch.no_grad():       # between backward and step
            evals.append(m(probe).clone())
        opt.step()
    return evals


@pytest.mark.timeout(60)
def test_a_prefetch_left_by_a_no_grad_forward_is_not_used_after_the_step():
    # the no-grad forward's dangling prefetch of block 1 (started before the step) used to be
    # what the next forward ran with: the third evaluation was off by 2.6e-2
    want = _reused_block_loop(0, 1)
    got = minidist.run(_reused_block_loop, 2, timeout=50)[0]
    assert max((a - b).abs().max().item() for a, b in zip(got, want)) < TOL
