"""Models, data, one-process references and what the ranks run for
tests/library/sharding/test_hsdp.py.

* the awkward model of the FSDP tests (``minidist_course.references.sharding.TiedLM``: tied
  embedding and head, a frozen parameter, a buffer, no parameter size divisible by 2, 3 or 4);
* :class:`NormNet`: LayerNorms (replicated) beside linears and an embedding (sharded), as in
  Stanford CS336's assignment 2, plus two :class:`Gated` modules whose ``bonus`` is used only on
  rows whose first token is 0 — only the last rank's rows — so one rank has its gradient and the
  others have none (pytorch/pytorch#158719: parameters used differently across ranks).

``train(model, opt, batch, rank, world, ...)`` runs the same steps for every way: one process
(``world=1``, plain torch clipping and gradients) and minidist's (``fsdp_state``).
"""

from __future__ import annotations

import torch
from torch import nn

from minidist.comm import p2p
from minidist.sharding import fsdp, fsdp_state, hsdp_mesh, replicate, replicated_units
from minidist_course.references.sharding import Block, global_batch, loss_fn, make_model

V, D, H, T, BATCH = 11, 7, 13, 5, 12
STEPS = 2                                   # optimizer steps of every comparison
HYPER = {"lr": 1e-2, "weight_decay": 0.1}   # AdamW


class NormBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.fc1, self.fc2 = nn.Linear(D, H), nn.Linear(H, D)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(self.ln(x))))


class Gated(nn.Module):
    """LayerNorm, then ``+ bonus`` on the rows ``mask`` marks (not used at all if none)."""

    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.bonus = nn.Parameter(0.1 * torch.randn(D))

    def forward(self, x, mask):
        out = self.ln(x)
        if mask.any():
            out = out + self.bonus * mask[:, None, None].to(out.dtype)
        return out


class NormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(NormBlock() for _ in range(2))
        self.gate_s, self.gate_r = Gated(), Gated()     # one sharded, one replicated
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, V)

    def forward(self, idx):
        mask = idx[:, 0] == 0
        h = self.emb(idx)
        for b in self.blocks:
            h = b(h)
        h = self.gate_r(self.gate_s(h, mask), mask)
        return self.head(self.ln_f(h))


def make_norm_net(seed: int = 0) -> NormNet:
    torch.manual_seed(seed)
    return NormNet()


def norm_batch(step: int):
    """Tokens [12, 5]; the first token is 0 only in rows 9-11 (the last rank's at W = 2 or 4)."""
    g = torch.Generator().manual_seed(500 + step)
    x = torch.randint(1, V, (BATCH, T + 1), generator=g)
    x[9:, 0] = 0
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def shard_norm_net(model: NormNet, **where) -> NormNet:
    """Norms replicated (and ``gate_r``), linears sharded (blocks, ``gate_s``, the root's
    embedding and head); ``where``: ``mesh=`` or ``group=`` for both kinds."""
    rep = {k: v for k, v in where.items() if k in ("mesh", "group", "algorithm", "collectives")}
    for b in model.blocks:
        replicate(b.ln, **rep)
        fsdp.fully_shard(b, **where)
    replicate(model.gate_r, **rep)
    replicate(model.ln_f, **rep)
    fsdp.fully_shard(model.gate_s, **where)
    return fsdp.fully_shard(model, **where)


def train(model, opt, batch, rank, world, steps, clip=None, accumulate=1, start=0,
          defer=False):
    """``steps`` optimizer steps on this rank's rows of ``batch(step)``; returns
    ``(gradients after the first step's backward, before clipping, {name: tensor};
    norms clipping returned)``. ``world=1``: one process, torch's clipping. ``accumulate``
    micro-batches: all but the last without gradient sync, or (``defer``) reduce-scattered but
    not all-reduced across replicas (``set_requires_all_reduce``)."""
    grads, norms = None, []
    single = world == 1 and not fsdp.units(model)
    for step in range(start, start + steps):
        opt.zero_grad()
        x, y = batch(step)
        n = x.shape[0] // world
        x, y = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
        for k, (xk, yk) in enumerate(zip(x.chunk(accumulate), y.chunk(accumulate))):
            if not single:
                (fsdp.set_requires_all_reduce if defer else
                 fsdp.set_requires_gradient_sync)(model, k == accumulate - 1)
            (loss_fn(model(xk).float(), yk) / accumulate).backward()
        if grads is None:
            grads = ({n: p.grad.detach().clone() for n, p in model.named_parameters()
                      if p.grad is not None} if single else fsdp_state.full_gradients(model))
        if clip is not None:
            max_norm, p = clip
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, p)
                               if single else fsdp_state.clip_grad_norm_(model, max_norm, p)))
        opt.step()
    return grads, norms


def state(model) -> dict:
    """The full state: one process's ``state_dict``, or minidist's ``full_state_dict``."""
    if fsdp.units(model):
        return fsdp_state.full_state_dict(model)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def adamw(model):
    return torch.optim.AdamW(model.parameters(), **HYPER)


def tied_batch(step: int):
    return global_batch(step)


def tied_batch24(step: int):
    """24 rows: 6 per rank at W = 4, two micro-batches of 3 (equal means: accumulation)."""
    return global_batch(step, size=24)


def tied_batch48(step: int):
    """48 rows: two equal micro-batches per rank at W = 4, 6 and 8."""
    return global_batch(step, size=48)


def rel(a: dict, b: dict) -> float:
    """max over b's names of max|a - b| / max|b| (a must have every name of b)."""
    missing = sorted(set(b) - set(a))
    assert not missing, f"missing {missing}"
    out = 0.0
    for k, v in b.items():
        if v.numel():
            out = max(out, (a[k].float() - v.float()).abs().max().item()
                      / max(v.float().abs().max().item(), 1e-12))
    return out


# ------------------------------------------------------------------ what ranks run (test_hsdp)
def torch_hsdp(rank, world, R=2, S=2, bf16=False, batch=tied_batch):
    """torch's FSDP2 on a (replicate=R, shard=S) DeviceMesh: gradients of step 1 and the state."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh("cpu", (R, S), mesh_dim_names=("replicate", "shard"))
    mp = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if bf16 else MixedPrecisionPolicy()
    model = make_model()
    for b in model.blocks:
        fully_shard(b, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt, grads = adamw(model), None
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step)
        n = x.shape[0] // world
        loss_fn(model(x[rank * n:(rank + 1) * n]).float(), y[rank * n:(rank + 1) * n]).backward()
        if grads is None:
            grads = {k: p.grad.full_tensor().clone() for k, p in model.named_parameters()
                     if p.grad is not None}
        opt.step()
    return grads, {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                   for k, v in model.state_dict().items()}


def traffic_of_a_step(rank, world, mesh):
    """Bytes this rank sends in one step's gradient reductions (ring), by collective, and the
    sizes to check them against."""
    model = fsdp.fully_shard(make_model(), auto_wrap=(Block,), mesh=mesh, algorithm="ring")
    opt = adamw(model)
    train(model, opt, tied_batch, rank, world, 1)                 # step 1 records the order
    before = p2p.traffic()
    train(model, opt, tied_batch, rank, world, 1, start=1)
    after = p2p.traffic()
    sent = {k: v.bytes_sent - before.get(k, p2p.Traffic()).bytes_sent for k, v in after.items()}
    us = [u for u in fsdp.units(model) if u.layout is not None]
    return {"sent": sent, "shard": [u.layout.shard_numel for u in us],
            "padded": [u.layout.padded for u in us], "params": [len(u.params) for u in us]}


def reduction_bytes(model, rank, world):
    """Bytes sent by reduce-scatters and all-reduces in a backward without sync, then deferring
    the all-reduce, then synced; and the sizes they come from."""
    x, y = norm_batch(0)
    n = x.shape[0] // world
    out = {}
    for mode in ("no sync", "deferred", "sync"):
        fsdp.set_requires_gradient_sync(model, mode != "no sync")
        fsdp.set_requires_all_reduce(model, mode != "deferred")
        before = p2p.traffic()
        loss_fn(model(x[rank * n:(rank + 1) * n]), y[rank * n:(rank + 1) * n]).backward()
        after = p2p.traffic()
        out[mode] = {op: sum(v.bytes_sent - before.get(k, p2p.Traffic()).bytes_sent
                             for k, v in after.items() if k.split("/")[0] == op)
                     for op in ("reduce_scatter", "all_reduce")}
    us = [u for u in fsdp.units(model) if u.layout is not None]
    out["units"] = [(u.layout.shard_numel, len(u.params)) for u in us]
    out["replicated"] = [(sum(p.numel() for p in r.params), len(r.params))
                         for r in replicated_units(model)]
    return out


def bad_inputs(rank, world, mesh):
    """Bad input, each caught on this rank: the error's text."""
    import torch.distributed as dist
    out = {}
    crossed = [dist.new_group(r) for r in ([0, 3], [1, 2])]      # every rank makes both
    cross = crossed[0] if rank in (0, 3) else crossed[1]

    def attempt(what, fn):
        try:
            fn()
            out[what] = "no error"
        except (ValueError, NotImplementedError) as e:
            out[what] = str(e)

    attempt("product", lambda: hsdp_mesh(3, 2))
    attempt("overlap", lambda: fsdp.fully_shard(make_model(), group=mesh.shard,
                                                replicate_group=mesh.shard))
    attempt("crossed", lambda: fsdp.fully_shard(make_model(), group=mesh.shard,
                                                replicate_group=cross))
    attempt("flat", lambda: fsdp.fully_shard(make_model(), mesh=mesh, per_parameter=False))
    model = make_model()
    fsdp.fully_shard(model.blocks[0], mesh=mesh)
    attempt("mixed", lambda: fsdp.fully_shard(model))             # root without the mesh
    norm = make_norm_net()
    fsdp.fully_shard(norm)
    attempt("late replicate", lambda: replicate(norm.ln_f))
    from minidist.sharding.dcp import dcp_state_dict
    hybrid = fsdp.fully_shard(make_model(), mesh=mesh)
    attempt("dcp", lambda: dcp_state_dict(hybrid))
    return out
