"""Exercise 09: the learner's ZeRO-1 step and ZeRO-2 gradient reduce-scatter, against torch.

The learner's class is built as ``cls(model.parameters(), optimizer_class, **hyper)`` on every
rank and trained for 3 steps on the rank's shard of a global batch (the toy model of
:mod:`minidist.references.sharding`: tied weights, a frozen parameter, a buffer, no size
divisible by W). It must end with the parameters of torch's ``ZeroRedundancyOptimizer`` (gradients
averaged by an all-reduce, as DDP does) and of one process on the global batch, within 1e-6 (the
sums run in a different order), on 1–4 ranks, with SGD+momentum and with AdamW. Feedback names the
first parameter that differs and the ratio of the update to the expected one (≈ W: the gradient
was summed, not averaged). It also checks that the optimizer keeps state for one slice only and,
for ZeRO-2, that no full gradient survives backward.
"""

from __future__ import annotations

import torch

from .core import Report, check_on_ranks

__all__ = ["grade_zero1", "grade_zero2"]

STEPS, TOL = 3, 1e-6
OPTIMIZERS = {"SGD+momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
              "AdamW": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1})}


def _train(rank, world, make_opt, averaged: bool, after_backward=None):
    import torch.distributed as dist

    from ..references.sharding import local_batch, loss_fn, make_model, named_state
    model = make_model()
    start = named_state(model)
    opt = make_opt(model)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = local_batch(step, rank, world)
        loss_fn(model(x), y).backward()
        if after_backward is not None and (msg := after_backward(model)):
            return msg, None, None, None
        if averaged:
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= world
        opt.step()
    return None, start, named_state(model), opt


def _explain(mine, ref, start, rank) -> str | None:
    for name in ref:
        d = (mine[name] - ref[name]).abs().max().item()
        if d > TOL:
            want = (ref[name] - start[name]).abs().max().item()
            got = (mine[name] - start[name]).abs().max().item()
            ratio = f"{got / want:.3g}" if want > 0 else "inf"
            return (f"rank {rank}: parameter {name} differs from torch's ZeroRedundancyOptimizer "
                    f"by {d:.2e}; your update is {ratio}x the expected one"
                    + (" (not updated at all: was the slice all-gathered back?)"
                       if got == 0 else ""))
    return None


def _rank_check(rank, world, cls, opt_name, stage):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    klass, hyper = OPTIMIZERS[opt_name]

    def no_full_grads(model):
        kept = [n for n, p in model.named_parameters() if p.grad is not None]
        return f"rank {rank}: after backward p.grad is still set for {kept[:3]}" if kept else None

    msg, start, mine, opt = _train(rank, world, lambda m: cls(m.parameters(), klass, **hyper),
                                   False, no_full_grads if stage == 2 else None)
    if msg:
        return msg
    _, _, ref, _ = _train(rank, world, lambda m: ZeroRedundancyOptimizer(m.parameters(), klass,
                                                                         **hyper), True)
    if (why := _explain(mine, ref, start, rank)) is not None:
        return why
    n = sum(p.numel() for p in _trainable())
    shard = -(-n // world)
    sizes = {v.numel() for s in opt.optimizer.state.values() for v in s.values()
             if torch.is_tensor(v) and v.dim() > 0}
    if sizes - {shard}:
        return (f"rank {rank}: the optimizer keeps state tensors of {sorted(sizes)} elements; "
                f"ZeRO keeps state for this rank's slice only ({shard} of {n} elements)")
    return None


def _trainable():
    from ..references.sharding import make_model
    return [p for p in make_model().parameters() if p.requires_grad]


def _grade(cls, stage, total, timeout) -> Report:
    report = Report(f"ZeRO-{stage} ({cls.__name__})", total=total)
    for opt_name in OPTIMIZERS:
        check_on_ranks(f"{opt_name} equals ZeroRedundancyOptimizer", _rank_check, (1, 2, 3, 4),
                       cls, opt_name, stage, timeout=timeout, report=report)
    return report


def grade_zero1(cls, total: float = 5, timeout: float = 60.0) -> Report:
    """ZeRO-1: ``cls(params, optimizer_class, **defaults)`` with ``step()``/``zero_grad()``."""
    return _grade(cls, 1, total, timeout)


def grade_zero2(cls, total: float = 5, timeout: float = 60.0) -> Report:
    """ZeRO-2: as :func:`grade_zero1`, and ``p.grad`` is ``None`` after every backward."""
    return _grade(cls, 2, total, timeout)
