"""Grade exercise 04's bucketed DDP: the bucket layout, and the wrapper against torch's DDP.

Every rule the exercise text teaches has a check that fails when it is broken:

* buckets in reverse registration order, closed before overflowing, parameters never split
  (:func:`grade_bucket_layout`);
* the same parameters as ``torch.nn.parallel.DistributedDataParallel`` after 3 SGD steps on 1-4
  ranks (a missing division by W, a slot at the wrong offset, state not reset between steps);
* buckets launched **in bucket order** during backward: on the MLP (gradients become ready in
  bucket order) and on :class:`HeadFirst`, a model whose modules are registered head before body,
  so the head's buckets (2, 3) become ready before the body's (0, 1) — a wrapper that launches
  each bucket as soon as it is full (readiness order) launches ``[2, 3, 0, 1]`` there, an order
  that on real models can differ between ranks and deadlock or mix buckets up.

When parameters differ, the grader compares one step's gradients with torch's and names the first
parameter and bucket that differ and the ratio yours/torch's (≈ W: the average is missing).

Conventions: ``MyDDP(module, bucket_cap_mb=...)`` has ``buckets`` (lists of parameters),
``launch_log`` (``(bucket index, gradients ready so far, counting the one that completed the
bucket)``) and ``sync_gradients()``, called after ``backward()`` — as in ``exercises/04``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..references.ddp import global_batch, make_model, max_abs_diff, shard, torch_ddp
from ..references.ddp import train_ddp, train_single
from ..models import MLP
from .core import Report, check_on_ranks

__all__ = ["grade_bucket_layout", "grade_ddp", "HeadFirst", "TOL"]

TOL = 1e-6  # fp32, sums in a different order than torch's


class HeadFirst(nn.Module):
    """``head`` is registered before ``body`` but used after it: gradients become ready head first.

    Parameters in registration order: head.weight [5, 8], head.bias [5], body.weight [8, 12],
    body.bias [8]; with one parameter per bucket, buckets 0..3 are body.bias, body.weight,
    head.bias, head.weight, and backward makes buckets 3 and 2 ready before 1 and 0.
    """

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(8, 5)
        self.body = nn.Linear(12, 8)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))


# --------------------------------------------------------------------------- Part A
_LAYOUT_CASES = [
    ("cap 600: reverse order, closed before overflowing", 600, [[20, 160, 32], [512, 64], [768]]),
    ("cap 1 byte: every parameter alone (no parameter is split)", 1,
     [[20], [160], [32], [512], [64], [768]]),
    ("cap 1 MiB: one bucket", 2**20, [[20, 160, 32, 512, 64, 768]]),
]


def _check_layout(build_buckets, cap, expected):
    model = MLP(12, (16, 8), 5)  # fp32 bytes per parameter: 768, 64, 512, 32, 160, 20
    got = build_buckets(list(model.parameters()), cap)
    if not isinstance(got, list) or not all(isinstance(b, list) for b in got):
        return f"build_buckets should return a list of lists, got {type(got).__name__}"
    sizes = [[4 * p.numel() for p in b] for b in got]
    if sizes != expected:
        return f"cap {cap} bytes: bucket sizes {sizes}, expected {expected}"
    return None


def grade_bucket_layout(build_buckets, total: float = 3) -> Report:
    """``build_buckets(params, cap_bytes)`` on the MLP's parameters (768, 64, 512, 32, 160, 20
    bytes) with caps 600, 1 and 1 MiB."""
    report = Report("Part A: bucket layout", total=total)
    for name, cap, expected in _LAYOUT_CASES:
        report.check(name, lambda c=cap, e=expected: _check_layout(build_buckets, c, e))
    return report


# --------------------------------------------------------------------------- Part B
def _grads_after_one_step(rank, world, wrap, model_fn):
    model = model_fn(rank)
    ddp = wrap(model)
    x, y = global_batch(0, 12)
    F.cross_entropy(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()
    if hasattr(ddp, "sync_gradients"):
        ddp.sync_gradients()
    names = [n for n, _ in model.named_parameters()]
    grads = [p.grad.detach().clone() for p in model.parameters()]
    buckets = getattr(ddp, "buckets", None)
    where = {}
    if buckets:
        ids = {id(p): n for n, p in model.named_parameters()}
        where = {ids.get(id(p)): i for i, b in enumerate(buckets) for p in b}
    if hasattr(ddp, "close"):
        ddp.close()
    return names, grads, where


def _explain_gradients(rank, world, my_ddp, cap_mb, model_fn) -> str:
    """The first parameter whose one-step gradient differs from torch DDP's, its bucket, the ratio."""
    names, mine, where = _grads_after_one_step(
        rank, world, lambda m: my_ddp(m, bucket_cap_mb=cap_mb), model_fn)
    _, ref, _ = _grads_after_one_step(rank, world, torch_ddp, model_fn)
    for name, g, r in zip(names, mine, ref):
        if (g - r).abs().max().item() <= TOL:
            continue
        ratio = float((g * r).sum() / (r * r).sum()) if float((r * r).sum()) else float("nan")
        why = ""
        if world > 1 and abs(ratio - world) < 0.01 * world:
            why = f" (= W: the sum is not divided by the world size {world})"
        elif world > 1 and abs(ratio - 1 / world) < 0.01:
            why = " (= 1/W: divided twice?)"
        elif abs(ratio) < 0.01:
            why = " (the average never reached p.grad?)"
        bucket = f" (bucket {where[name]})" if name in where else ""
        return (f"first gradient that differs after one backward: {name}{bucket}: yours / torch "
                f"DDP's ≈ {ratio:.3f}{why}")
    return "one step's gradients match torch DDP's: the difference comes from a later step " \
           "(is the per-step state reset in sync_gradients?)"


def _check_against_torch(rank, world, my_ddp, cap_mb):
    ours = train_ddp(rank, world, lambda m: my_ddp(m, bucket_cap_mb=cap_mb))
    ref = train_ddp(rank, world, torch_ddp)
    if (d := max_abs_diff(ours, ref)) > TOL:
        return (f"parameters differ from torch DDP's by {d:.2e} after 3 steps (cap {cap_mb} MiB); "
                + _explain_gradients(rank, world, my_ddp, cap_mb, make_model))
    if (d := max_abs_diff(ours, train_single())) > TOL:
        return f"parameters differ from one process on the global batch by {d:.2e}"
    return None


def _launch_problem(log, n_buckets, what) -> str | None:
    order = [i for i, _ in log]
    if order != list(range(n_buckets)):
        return (f"{what}: buckets launched in order {order}, expected {list(range(n_buckets))}: "
                "launch strictly in bucket order (every rank must issue the same all-reduces in "
                "the same order), not in the order buckets fill up")
    return None


def _check_overlap(rank, world, my_ddp):
    torch.manual_seed(0)
    ddp = my_ddp(MLP(12, (16, 8), 5), bucket_cap_mb=1e-9)  # one parameter per bucket
    F.cross_entropy(ddp(torch.randn(4, 12)), torch.arange(4)).backward()
    ddp.sync_gradients()
    log = list(ddp.launch_log)
    if problem := _launch_problem(log, 6, "MLP"):
        return problem
    if log[0][1] != 1:
        return (f"bucket 0 launched after {log[0][1]} gradients were ready (counting the one that "
                "completed it): launch it as soon as it is full, during backward")
    return None


def _head_first(rank):
    torch.manual_seed(rank)
    return HeadFirst()


def _check_head_first(rank, world, my_ddp):
    ddp = my_ddp(_head_first(rank), bucket_cap_mb=1e-9)  # buckets: body.b, body.w, head.b, head.w
    x, y = global_batch(0, 12)
    F.cross_entropy(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()
    ddp.sync_gradients()
    if problem := _launch_problem(list(ddp.launch_log), 4, "model registered head before body"):
        return problem
    explain = _explain_gradients(rank, world, my_ddp, 1e-9, _head_first)
    if not explain.startswith("one step's gradients match"):
        return f"model registered head before body: {explain}"
    return None


def grade_ddp(my_ddp, total: float = 7, timeout: float = 60.0, only=None) -> Report:
    """Grade ``MyDDP`` (see the module docstring). ``only``: names of checks to run (tests)."""
    report = Report("Part B: MyDDP against torch's DDP", total=total)
    checks = [
        ("same parameters as torch DDP, 4 buckets", _check_against_torch, (1, 2, 3, 4), (0.0005,)),
        ("same parameters as torch DDP, 1 bucket", _check_against_torch, (2, 3), (25.0,)),
        ("buckets launched in bucket order, during backward", _check_overlap, (2,), ()),
        ("bucket order on a model registered head before body", _check_head_first, (2,), ()),
    ]
    for name, fn, worlds, extra in checks:
        if only is None or name in only:
            check_on_ranks(name, fn, worlds, my_ddp, *extra, timeout=timeout, report=report)
    return report
