"""Exercise 09: the learner's ZeRO-1 step and ZeRO-2 gradient reduce-scatter, rule by rule.

The learner's class is built as ``cls(model.parameters(), optimizer_class, **hyper)`` on every
rank and trained for 3 steps on the rank's shard of a global batch, in lockstep with torch's
``ZeroRedundancyOptimizer`` (gradients averaged by an all-reduce, as DDP does), on 1–4 ranks, with
SGD+momentum and with AdamW. The model is the chapter's toy model (tied weights, a frozen
parameter, a buffer) at ``dim=6``: 427 trainable elements, divisible by none of 2, 3, 4, so the
flat buffers always carry padding. One launch per world size checks every rule of
:data:`ZERO1_RULES` / :data:`ZERO2_RULES`; each broken rule fails with the step, the optimizer
and the measured number:

* the parameters are compared after **every** step (tolerance 1e-6); when they differ the grader
  retrains the reference with the gradient summed (x W) and divided twice (/ W) and says which it
  matches, and whether a later step differs after the first matched (state kept between steps);
* traffic: every torch.distributed call of the learner's code is watched (:mod:`.spy`) and its
  ring bytes per rank summed against ZeRO-1's ``2(W-1)·S·4`` per step;
* optimizer state: counted over every optimizer reachable from the object (:mod:`.state`), not
  one attribute, against ``k·S`` elements (k = 1 for SGD+momentum, 2 for AdamW);
* ZeRO-2: no ``p.grad`` after backward, the reduce-scatter launched during backward with
  ``async_op=True`` and waited in ``step()``.
"""

from __future__ import annotations

import re

import torch

from ..references.sharding import make_model
from .core import Report, _merge_rank_messages, check_rules
from .generated import examples, st
from .spy import CollectiveSpy
from .state import optimizer_state, state_elements_per_element

__all__ = ["grade_zero1", "grade_zero2", "ZERO1_RULES", "ZERO2_RULES", "MODEL"]

STEPS, TOL = 3, 1e-6
MODEL = {"dim": 6}   # 427 trainable elements: padding at W = 2, 3 and 4
OPTIMIZERS = {"SGD+momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
              "AdamW": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1})}

ZERO1_RULES = {
    "pad": "the flat gradient is W·S elements, zero-padded (427 elements divide by no W = 2, 3, 4)",
    "average": "the reduce-scattered sum is divided by W (an average, as DDP's)",
    "gather": "after step() every rank holds every updated slice (all-gather after the step)",
    "equal": "the same parameters as torch's ZeroRedundancyOptimizer after every step "
             "(SGD+momentum and AdamW, 1-4 ranks)",
    "traffic": "one reduce-scatter + one all-gather per step: 2(W-1)·S·4 bytes per rank, "
               "not an all-reduce (1.5x that)",
    "state": "optimizer state for this rank's slice only, measured over every optimizer the object "
             "holds",
}
ZERO2_RULES = {
    **{k: v for k, v in ZERO1_RULES.items() if k != "pad"},
    "free": "no full gradient survives backward (p.grad is None after it)",
    "async": "the reduce-scatter is launched during backward, with async_op=True, and not waited "
             "there",
    "wait": "step() waits for the reduce-scatter's work before it uses the result",
    "reset": "per-backward state is reset: every backward launches its own reduce-scatter",
}


_SIZE_ERROR = re.compile(r"size|shape|numel|Check failed|must match|divisible", re.I)


def _clean(text: str) -> str:
    """An exception's text without gloo's log prefixes (``[rank0]:[F1201 ...] file.cpp:1583]``)."""
    text = re.sub(r"\[rank\d+\]:\[[A-Z]\d{4} [^\]]*\] ", "", text)
    return " ".join(text.split())


def _model(dim: int = MODEL["dim"]):
    from ..references.sharding import make_model
    return make_model(dim=dim)


def _flat_params(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


class _Reference:
    """torch's ZeroRedundancyOptimizer on averaged gradients, scaled by ``scale`` (1: correct)."""

    def __init__(self, klass, hyper, scale=1.0, dim: int = MODEL["dim"]):
        from torch.distributed.optim import ZeroRedundancyOptimizer
        self.model, self.scale = _model(dim), scale
        self.opt = ZeroRedundancyOptimizer(self.model.parameters(), klass, **hyper)

    def step(self, x, y, world):
        import torch.distributed as dist

        from ..references.sharding import loss_fn
        self.opt.zero_grad()
        loss_fn(self.model(x), y).backward()
        for p in self.model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad *= self.scale / world
        self.opt.step()


def _differs(model, ref_model) -> tuple[str, float] | None:
    mine, ref = model.state_dict(), ref_model.state_dict()
    for name in ref:
        d = (mine[name] - ref[name]).abs().max().item()
        if not d <= TOL:
            return name, d
    return None


def _diagnose(rank, world, cls, klass, hyper, stage, bad_step,
              dim: int = MODEL["dim"]) -> tuple[str, str] | None:
    """Retrain the learner's class and references with the gradient x W and / W: which matches?"""
    from ..references.sharding import local_batch, loss_fn
    if world == 1:
        return None
    for scale, rule, why in ((world, "average", "summed, not averaged: divide by W"),
                             (1 / world, "average", "divided by W twice")):
        model = _model(dim)
        opt = cls(model.parameters(), klass, **hyper)
        ref = _Reference(klass, hyper, scale, dim)
        same = True
        for step in range(STEPS):
            x, y = local_batch(step, rank, world)
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
            ref.step(x, y, world)
            same = same and _differs(model, ref.model) is None
        if same:
            return rule, (f"your parameters equal torch's trained on a gradient {scale:g}x the "
                          f"average: the gradient was {why}")
    return None


def _rank_check(rank, world, cls, stage, dim: int = MODEL["dim"]):
    import torch.distributed as dist

    from ..references.sharding import local_batch, loss_fn
    broken: dict[str, str] = {}

    def fail(rule, msg):
        broken.setdefault(rule, msg)

    n = sum(p.numel() for p in _model(dim).parameters() if p.requires_grad)
    S = -(-n // world)
    sgd_wrong_by_scale = False
    for opt_name, (klass, hyper) in OPTIMIZERS.items():
        model = _model(dim)
        params = {id(p) for p in model.parameters()}
        ref = _Reference(klass, hyper, dim=dim)
        try:
            opt = cls(model.parameters(), klass, **hyper)
        except Exception as e:  # noqa: BLE001
            fail("equal", f"{opt_name}: building your class raised {type(e).__name__}: {e}")
            continue
        first_bad = None
        first_calls: list = []  # the calls of step 0 (did backward 0 launch a reduce-scatter?)
        with CollectiveSpy(opt, world=world) as spy:
            for step in range(STEPS):
                x, y = local_batch(step, rank, world)
                spy.phase = "reference"
                ref.step(x, y, world)
                spy.calls = [c for c in spy.calls if c.phase != "reference"]
                try:
                    spy.phase = "backward"
                    opt.zero_grad()
                    loss_fn(model(x), y).backward()
                    if stage == 2:
                        kept = [n_ for n_, p in model.named_parameters() if p.grad is not None]
                        if kept:
                            fail("free", f"{opt_name}, step {step}: after backward p.grad is still "
                                         f"set for {kept[:3]}: copy it into the flat buffer and "
                                         "set p.grad = None in the hook")
                    elif hasattr(opt, "flat_grad") and step == 0:
                        fg = opt.flat_grad()
                        if not torch.is_tensor(fg) or fg.numel() != world * S:
                            got = fg.numel() if torch.is_tensor(fg) else type(fg).__name__
                            fail("pad", f"flat_grad() has {got} elements; it must have W·S = "
                                        f"{world}·{S} = {world * S} ({n} gradients, then "
                                        f"{world * S - n} zeros of padding)")
                        elif fg[n:].abs().sum() != 0:
                            fail("pad", "the padding after the last gradient is not zero")
                    spy.phase = "step"
                    opt.step()
                except Exception as e:  # noqa: BLE001 - the learner's bug, attributed below
                    said = _clean(str(e))
                    text = f"{opt_name}, step {step}: {type(e).__name__}: {said[:300]}"
                    if n % world and stage == 1 and _SIZE_ERROR.search(said):
                        fail("pad", text + f" (the {n} elements do not divide by W={world}: "
                                           f"are all flat buffers W·S = {world * S} elements?)")
                    fail("equal", text)
                    break
                calls = [c for c in spy.calls if c.phase in ("backward", "step")]
                # ------------------------------------------------ pattern: async, wait, traffic
                if stage == 2 and world > 1:
                    rs = [c for c in calls if c.name.startswith("reduce_scatter")]
                    in_bwd = [c for c in rs if c.phase == "backward"]
                    if step > 0 and not in_bwd and any(
                            c.phase == "backward" for c in first_calls):
                        fail("reset", f"{opt_name}: backward {step} launched no reduce-scatter "
                                      "(backward 0 did): reset the per-backward state (buffer, "
                                      "count, work) at the end of step()")
                    elif not in_bwd:
                        fail("async", f"{opt_name}, step {step}: no reduce-scatter during backward"
                                      f" ({spy.summary('step')} in step()): launch it from the "
                                      "hook when the last gradient arrives")
                    for c in in_bwd:
                        if not c.async_op:
                            fail("async", f"{opt_name}, step {step}: the reduce-scatter in the "
                                          "hook is blocking: backward stops until it is done; "
                                          "pass async_op=True and wait in step()")
                        elif c.waited == "backward":
                            fail("async", f"{opt_name}, step {step}: the reduce-scatter's work "
                                          "was waited during backward (that blocks autograd): "
                                          "wait in step()")
                        elif not c.waited:
                            fail("wait", f"{opt_name}, step {step}: step() used the "
                                         "reduce-scatter's output without work.wait() (the "
                                         "result may not have arrived yet)")
                if step == 0:
                    first_calls = list(calls)
                if world > 1:
                    moved = spy.bytes_per_rank("backward") + spy.bytes_per_rank("step")
                    want = 2 * (world - 1) * S * 4
                    if moved > want * 1.001 + 64:
                        fail("traffic", f"{opt_name}, step {step}: your step moves {moved:.0f} "
                                        f"bytes per rank ({moved / want:.2f}x): during backward "
                                        f"{spy.summary('backward')}; in step() "
                                        f"{spy.summary('step')}. "
                                        f"ZeRO-1 moves 2(W-1)·S·4 = {want} (reduce-scatter the "
                                        "gradient, all-gather the parameters); an all-reduce "
                                        "then a slice moves 1.5x")
                spy.calls = []
                # ------------------------------------------------ every rank the same parameters
                flat = _flat_params(model)
                everyone = [torch.empty_like(flat) for _ in range(world)]
                spy.phase = "grader"
                dist.all_gather(everyone, flat)
                spy.calls = []
                if any(not torch.equal(t, flat) for t in everyone):
                    fail("gather", f"{opt_name}, step {step}: ranks hold different parameters "
                                   "after step(): all-gather the updated slice *after* "
                                   "self.optimizer.step(), into self.flat")
                if first_bad is None and (d := _differs(model, ref.model)) is not None:
                    first_bad = (step, *d)
        if first_bad is not None:
            step, name, d = first_bad
            msg = (f"{opt_name}: after step {step} parameter {name} differs from torch's by "
                   f"{d:.2e}")
            diag = _diagnose(rank, world, cls, klass, hyper, stage, step, dim)
            if diag:
                fail(diag[0], f"{opt_name}: {diag[1]}")
                msg += f" — {diag[1]}"
                sgd_wrong_by_scale |= opt_name == "SGD+momentum" and diag[0] == "average"
            elif step > 0:
                msg += (" (step 0 matched: something from the previous step is reused — reset "
                        "the per-step state; was the work waited?)")
                if stage == 2:
                    fail("reset", f"{opt_name}: step 0 matched torch's, step {step} does not: "
                                  "state from the previous backward was reused")
            fail("equal", msg)
        # ------------------------------------------------ optimizer state per rank
        k = state_elements_per_element(klass, **hyper)
        held = optimizer_state(opt)
        total = sum(e for _, e in held)
        if total > k * S:
            where = ", ".join(f"{p}: {e}" for p, e in held if e)
            fail("state", f"{opt_name}: the optimizers your object holds keep {total} elements of "
                          f"state on this rank ({where}); ZeRO keeps {k}·S = {k * S} "
                          f"(this rank's slice, S = {S} of {n})")
        del params
    if sgd_wrong_by_scale and "average" in broken:
        broken["average"] += (" (AdamW passes anyway: Adam divides by the gradient's RMS, so a "
                              "gradient W times too large moves it almost the same — SGD sees it)")
    return broken


def _rank_check_widths(rank, world, cls, stage, widths):
    """:func:`_rank_check` on the model at each width of ``widths``."""
    return [_rank_check(rank, world, cls, stage, dim) for dim in widths]


def _generated_widths(cls, stage, timeout):
    """Models of widths hypothesis draws (other element counts, other padding), one launch per
    world size; ``(rule, message)`` for the first width that breaks a rule, or None."""
    from minidist.launch import run
    widths = examples(st.integers(2, 9), 3)
    rules = ZERO1_RULES if stage == 1 else ZERO2_RULES
    for world in (2, 3, 4):
        per_rank = run(_rank_check_widths, world, cls, stage, widths, timeout=3 * timeout)
        for i, dim in enumerate(widths):
            for key in rules:
                merged = _merge_rank_messages([(d[i] or {}).get(key) for d in per_rank])
                if merged:
                    n = sum(p.numel() for p in make_model(dim=dim).parameters() if p.requires_grad)
                    return key, f"W={world}, model width {dim} ({n} elements, generated): {merged}"
    return None


def _grade(cls, stage, total, timeout) -> Report:
    report = Report(f"ZeRO-{stage} ({cls.__name__})", total=total)
    rules = ZERO1_RULES if stage == 1 else ZERO2_RULES
    check_rules(report, rules, _rank_check, (1, 2, 3, 4), cls, stage, timeout=timeout)
    if not report.failed:   # the rules hold on the named model: other widths, W = 2-4
        report.check("3 generated model widths at W = 2, 3, 4",
                     lambda: _generated_widths(cls, stage, timeout))
    return report


def grade_zero1(cls, total: float = 5, timeout: float = 60.0) -> Report:
    """ZeRO-1: ``cls(params, optimizer_class, **defaults)`` with ``step()``/``zero_grad()``."""
    return _grade(cls, 1, total, timeout)


def grade_zero2(cls, total: float = 5, timeout: float = 60.0) -> Report:
    """ZeRO-2: as :func:`grade_zero1`, and ``p.grad`` is ``None`` after every backward."""
    return _grade(cls, 2, total, timeout)
