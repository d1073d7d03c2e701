"""A small training setup described by a dict (a *case*), run one way or another, for the
sharding differential tests (tests/library/sharding/test_sharding_real_use.py, tests/library/sharding/test_sharding_differential.py).

A case: ``hidden`` (block widths), ``d`` (model width), ``tie`` (the head reuses the input
projection's weight), ``tiny`` (a [1]-shaped gain per block: fewer rows than ranks), ``buffer``
(a constant buffer per block), ``frozen`` (parameter names frozen before wrapping), ``changes``
([(step, name, requires_grad)] applied before that step), ``groups`` ("one" or "decay": weight
decay on ``p.dim() >= 2`` only), ``opt`` ("sgd"/"adamw"), ``accum`` (micro-batches per step),
``eval`` (a no_grad eval forward between steps), ``recompute`` (blocks run under
``minidist.sharding.checkpoint``), ``units`` ("blocks+root", "root", "blocks"), ``mp`` (None or
"bf16"), ``clip`` (None or (max_norm, norm_type)), ``steps``.

``run_case(case, how, rank, world)`` trains and returns ``{name: full tensor}``, or the text of the
error it raised (``"error: ..."``). ``how``: "single" (one process, global batch: run it with
world 1), "fsdp", "fsdp-flat", "zero1", "zero2", "torch-fsdp2", "torch-ddp", "torch-zero".
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from minidist.sharding import ShardedOptimizer, checkpoint, fsdp, fsdp_state

BATCH, D_IN = 24, 5

BASE = dict(hidden=[3, 5], d=6, tie=True, tiny=True, buffer=True, frozen=[], changes=[],
            groups="one", opt="adamw", accum=1, eval=False, recompute=False,
            units="blocks+root", mp=None, clip=None, steps=4)


def case(**kw) -> dict:
    out = dict(BASE)
    out.update(kw)
    return out


class Block(nn.Module):
    def __init__(self, d, h, tiny, buffer):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, h), nn.Linear(h, d)
        self.gain = nn.Parameter(torch.ones(1) + 0.1 * torch.randn(1)) if tiny else None
        if buffer:
            self.register_buffer("shift", 0.1 * torch.randn(d))
        else:
            self.shift = None
        self.recompute = False

    def _f(self, x):
        y = self.fc2(torch.tanh(self.fc1(x)))
        if self.gain is not None:
            y = y * self.gain
        return x + y + (self.shift if self.shift is not None else 0)

    def forward(self, x):
        if self.recompute and torch.is_grad_enabled():
            return checkpoint(self._f, x)
        return self._f(x)


class Net(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.inp = nn.Linear(D_IN, c["d"])
        self.blocks = nn.ModuleList(Block(c["d"], h, c["tiny"], c["buffer"]) for h in c["hidden"])
        self.head_bias = nn.Parameter(torch.zeros(D_IN))
        self.head = None if c["tie"] else nn.Linear(c["d"], D_IN, bias=False)
        for b in self.blocks:
            b.recompute = c["recompute"]

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        out = h @ self.inp.weight if self.head is None else self.head(h)   # tied: [B, d_in]
        return out + self.head_bias


def make(c, seed=0) -> Net:
    torch.manual_seed(seed)
    m = Net(c)
    names = dict(m.named_parameters())
    for n in c["frozen"]:
        names[n].requires_grad_(False)
    return m


def batch(step: int, micro: int = 0):
    g = torch.Generator().manual_seed(100 * step + micro)
    return torch.randn(BATCH, D_IN, generator=g), torch.randn(BATCH, D_IN, generator=g)


def groups(c, named):
    named = list(named)
    if c["groups"] == "decay":
        wd = 0.1 if c["opt"] == "adamw" else 0.01
        return [{"params": [p for n, p in named if p.dim() >= 2], "weight_decay": wd},
                {"params": [p for n, p in named if p.dim() < 2], "weight_decay": 0.0}]
    return [{"params": [p for _, p in named]}]


def optimizer(c, named, zero: int = 0, group=None):
    cls, hyper = ((torch.optim.AdamW, {"lr": 0.02, "weight_decay": 0.05}) if c["opt"] == "adamw"
                  else (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}))
    if zero:
        return ShardedOptimizer(groups(c, named), cls, group, stage=zero,
                                grads="local", **hyper)
    return cls(groups(c, named), **hyper)


def _params_by_name(model):
    """Original parameter names → parameter objects (minidist units keep the objects)."""
    return dict(model.named_parameters(remove_duplicate=False))


def run_case(c, how: str, rank: int = 0, world: int = 1):
    try:
        return _run(c, how, rank, world)
    except (RuntimeError, ValueError, NotImplementedError, AssertionError, KeyError,
            TypeError) as e:
        return f"error: {type(e).__name__}: {e}"


def _wrap(c, how, model, world):
    if how in ("fsdp", "fsdp-flat"):
        mp = fsdp.MixedPrecisionPolicy(torch.bfloat16, torch.float32) if c["mp"] == "bf16" else None
        opts = dict(mp_policy=mp) if how == "fsdp" else dict(mp_policy=mp, per_parameter=False)
        if c["units"] in ("blocks+root", "blocks"):
            for b in model.blocks:
                fsdp.fully_shard(b, **opts)
        if c["units"] in ("blocks+root", "root"):
            fsdp.fully_shard(model, **opts)
        return model
    if how == "torch-fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mesh = init_device_mesh("cpu", (world,))
        mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if c["mp"] == "bf16" else MixedPrecisionPolicy())
        if c["units"] in ("blocks+root", "blocks"):
            for b in model.blocks:
                fully_shard(b, mesh=mesh, mp_policy=mp)
        if c["units"] in ("blocks+root", "root"):
            fully_shard(model, mesh=mesh, mp_policy=mp)
        return model
    if how in ("torch-ddp", "torch-zero"):
        from torch.nn.parallel import DistributedDataParallel
        return DistributedDataParallel(model)
    return model


# Setups a way of running refuses or cannot express, and why: compared with nothing.
def skip_reason(c, how: str) -> str | None:
    if how in ("zero1", "zero2", "torch-zero", "torch-ddp") and c["mp"] is not None:
        return "mixed precision is a fully_shard policy here"
    if how in ("zero1", "zero2") and c["clip"] is not None:
        return "ShardedOptimizer has no clipping of its own (hybrid's ZeRO1Optimizer has)"
    if how == "torch-fsdp2" and c["clip"] is not None and c["clip"][1] == float("inf"):
        # torch 2.14, gloo: clip_grad_norm_(norm_type=inf) on FSDP2's DTensor gradients kills
        # the ranks (gloo 'Received data size doesn't match expected size')
        return "torch's FSDP2 crashes (SIGABRT) on inf-norm clipping with gloo"
    if how in ("torch-ddp", "torch-zero") and c["changes"]:
        return None   # runs, and is wrong: reported by the tests, not skipped
    return None


def _run(c, how, rank, world):
    why = skip_reason(c, how)
    if why:
        return f"skipped: {why}"
    model = make(c)
    inner = model
    model = _wrap(c, how, model, world)
    named = list(inner.named_parameters())
    group = None
    if how in ("zero1", "zero2"):
        opt = optimizer(c, named, zero=int(how[-1]), group=group)
    elif how == "torch-zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        cls = torch.optim.AdamW if c["opt"] == "adamw" else torch.optim.SGD
        hyper = {"lr": 0.02, "weight_decay": 0.05} if c["opt"] == "adamw" else \
            {"lr": 0.05, "momentum": 0.9}
        gs = groups(c, named)
        opt = ZeroRedundancyOptimizer(gs[0]["params"], cls, **{**hyper, **{
            k: v for k, v in gs[0].items() if k != "params"}})
        for g in gs[1:]:
            opt.add_param_group(g)
    else:
        opt = optimizer(c, named)
    n = BATCH // (world * c["accum"])
    for step in range(c["steps"]):
        for s, name, flag in c["changes"]:
            if s == step:
                _params_by_name(inner)[name].requires_grad_(flag)
        opt.zero_grad()
        for k in range(c["accum"]):
            x, y = batch(step, k)
            lo = rank * n if how != "single" else 0
            hi = lo + (n if how != "single" else BATCH // c["accum"])
            last = k == c["accum"] - 1
            if how in ("fsdp", "fsdp-flat"):
                fsdp.set_requires_gradient_sync(model, last)
            elif how == "torch-fsdp2" and hasattr(model, "set_requires_gradient_sync"):
                model.set_requires_gradient_sync(last)
            out = model(x[lo:hi])
            loss = F.mse_loss(out.float(), y[lo:hi]) / c["accum"]
            if how in ("torch-ddp", "torch-zero") and not last:
                with model.no_sync():
                    loss.backward()
            else:
                loss.backward()
        if c["clip"] is not None:
            max_norm, p = c["clip"]
            if how in ("fsdp", "fsdp-flat"):
                fsdp_state.clip_grad_norm_(model, max_norm, norm_type=p)
            else:
                torch.nn.utils.clip_grad_norm_(inner.parameters(), max_norm, norm_type=p)
        opt.step()
        if c["eval"]:
            model.eval()
            with torch.no_grad():
                model(batch(999)[0][:3])
            model.train()
    if how in ("fsdp", "fsdp-flat"):
        sd = fsdp_state.full_state_dict(model)
    else:
        sd = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
              for k, v in inner.state_dict().items()}
    if how in ("zero1", "zero2"):
        opt.close()
    return {k: v.float() for k, v in sd.items()}


def max_diff(a: dict, b: dict) -> float:
    if isinstance(a, str) or isinstance(b, str):
        return math.inf
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return max((a[k] - b[k]).abs().max().item() if a[k].numel() else 0.0 for k in a)
