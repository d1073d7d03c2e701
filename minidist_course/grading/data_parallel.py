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

* the communication pattern, watched call by call (:mod:`.spy`): each bucket's all-reduce is
  launched **during backward** with ``async_op=True`` and not waited there (a blocking all-reduce in
  the hook gives the same numbers and no overlap), every work is waited in ``sync_gradients``, and
  the second backward launches every bucket again (the per-step state was reset).

When parameters differ, the grader compares one step's gradients with torch's and names the first
parameter and bucket that differ and the ratio yours/torch's (≈ W: the average is missing). When
the learner's ``build_buckets`` (Part A) fails its own checks, Part B's report says so first.

Conventions: ``MyDDP(module, bucket_cap_mb=...)`` has ``buckets`` (lists of parameters),
``launch_log`` (``(bucket index, gradients ready so far, counting the one that completed the
bucket)``) and ``sync_gradients()``, called after ``backward()`` — as in ``exercises/04``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..references.data_parallel import global_batch, make_model, max_abs_diff, shard, torch_ddp
from ..references.data_parallel import train_ddp, train_single
from minidist.models import MLP
from minidist.data_parallel.buckets import pack_by_size
from .core import Report, check_rules
from .generated import examples, generated_check, st
from .spy import CollectiveSpy

__all__ = ["grade_bucket_layout", "grade_ddp", "HeadFirst", "TOL", "LAYOUT_RULES", "DDP_RULES"]

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
LAYOUT_RULES = {
    "reverse": "parameters go into buckets in reverse registration order",
    "cap": "a bucket is closed before a parameter would take it over the cap",
    "whole": "no parameter is split, dropped or repeated, and no bucket is empty (one bigger than "
             "the cap gets a bucket of its own)",
}
_SIZES = [768, 64, 512, 32, 160, 20]   # the MLP's fp32 bytes per parameter, registration order
_LAYOUT_CASES = [(600, [[20, 160, 32], [512, 64], [768]]), (1, [[s] for s in _SIZES[::-1]]),
                 (2**20, [_SIZES[::-1]])]


def _layout_problem(build_buckets, params: list, cap: int, expected: list):
    """``(rule, message)`` for the learner's buckets of ``params`` under ``cap`` bytes against the
    expected sizes (bytes per parameter, bucket by bucket), or ``None``."""
    try:
        got = build_buckets(list(params), cap)
    except Exception as e:  # noqa: BLE001
        return "whole", f"cap {cap}: build_buckets raised {type(e).__name__}: {e}"
    if not isinstance(got, list) or not all(isinstance(b, list) for b in got):
        return "whole", f"build_buckets should return a list of lists, got {type(got).__name__}"
    sizes = [[4 * p.numel() for p in b] for b in got]
    flat = [id(p) for b in got for p in b]
    if sizes == expected:
        return None
    said = f"cap {cap} bytes: bucket sizes {sizes}, expected {expected}"
    if sorted(flat) != sorted(id(p) for p in params) or any(not b for b in got):
        return "whole", said + (": an empty bucket (close a bucket only when it is not empty)"
                                if any(not b for b in got) else
                                ": every parameter exactly once, whole")
    if flat != [id(p) for p in reversed(params)]:
        return "reverse", said + (": walk the parameters in reverse (backward produces the last "
                                  "layer's gradients first)")
    if any(sum(b) > cap and len(b) > 1 for b in sizes):
        return "cap", said + (": a bucket went over the cap (close it *before* adding the "
                              "parameter that would overflow it)")
    return "cap", said + ": buckets closed too early"


def _layout_rank(build_buckets) -> dict:
    """Every rule of :data:`LAYOUT_RULES` on caps 600, 1 and 1 MiB; ``{rule: message}``."""
    broken: dict = {}
    for cap, expected in _LAYOUT_CASES:
        problem = _layout_problem(build_buckets, list(MLP(12, (16, 8), 5).parameters()), cap,
                                  expected)
        if problem is not None:
            broken.setdefault(*problem)
    return broken


def _generated_layout(build_buckets, case):
    """Parameters of ``case[0]`` elements each (fp32), cap ``case[1]`` bytes, against
    :func:`minidist.data_parallel.buckets.pack_by_size`."""
    numels, cap = case
    params = [torch.zeros(n, requires_grad=True) for n in numels]
    nbytes = [4 * n for n in reversed(numels)]
    expected = [[nbytes[i] for i in g] for g in pack_by_size(nbytes, cap)]
    return _layout_problem(build_buckets, params, cap, expected)


def grade_bucket_layout(build_buckets, total: float = 3) -> Report:
    """``build_buckets(params, cap_bytes)`` on the MLP's parameters (768, 64, 512, 32, 160, 20
    bytes) with caps 600, 1 and 1 MiB; one check per rule of :data:`LAYOUT_RULES`."""
    report = Report("Part A: bucket layout", total=total)
    found = _layout_rank(build_buckets)
    for key, text in LAYOUT_RULES.items():
        report.check(f"[{key}] {text}", lambda k=key: found.get(k), rule=key)
    generated_check(report, "1-10 parameters of 1-300 elements, caps of 1-2048 bytes",
                    st.tuples(st.lists(st.integers(1, 300), min_size=1, max_size=10),
                              st.integers(1, 2048)),
                    lambda c: _generated_layout(build_buckets, c), max_examples=60,
                    describe=lambda c: f"parameters of {c[0]} elements (fp32), cap {c[1]} bytes",
                    crash_rule="whole")
    return report


# --------------------------------------------------------------------------- Part B
DDP_RULES = {
    "average": "each bucket's sum is divided by W (an average)",
    "equal": "the same parameters as torch's DDP after 3 SGD steps (4 buckets on 1-4 ranks, one "
             "bucket on 2 and 3)",
    "order": "buckets are launched strictly in bucket order, also on a model registered head "
             "before body",
    "overlap": "each bucket is launched during backward, as soon as it is complete",
    "async": "the all-reduce is launched with async_op=True and not waited in the hook (backward "
             "goes on while it runs)",
    "wait": "sync_gradients() waits for every bucket's work before reading its buffer",
    "reset": "per-step state is reset: the next backward launches every bucket again",
}


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


def _explain_gradients(rank, world, my_ddp, cap_mb, model_fn) -> tuple[str, str]:
    """(rule, text): the first parameter whose one-step gradient differs from torch DDP's, its
    bucket and the ratio yours/torch's."""
    names, mine, where = _grads_after_one_step(
        rank, world, lambda m: my_ddp(m, bucket_cap_mb=cap_mb), model_fn)
    _, ref, _ = _grads_after_one_step(rank, world, torch_ddp, model_fn)
    for name, g, r in zip(names, mine, ref):
        if (g - r).abs().max().item() <= TOL:
            continue
        ratio = float((g * r).sum() / (r * r).sum()) if float((r * r).sum()) else float("nan")
        why, rule = "", "equal"
        if world > 1 and abs(ratio - world) < 0.01 * world:
            why, rule = f" (= W: the sum is not divided by the world size {world})", "average"
        elif world > 1 and abs(ratio - 1 / world) < 0.01:
            why, rule = " (= 1/W: divided twice?)", "average"
        elif abs(ratio) < 0.01:
            why = " (the average never reached p.grad?)"
        bucket = f" (bucket {where[name]})" if name in where else ""
        return rule, (f"first gradient that differs after one backward: {name}{bucket}: yours / "
                      f"torch DDP's ≈ {ratio:.3f}{why}")
    return "reset", ("one step's gradients match torch DDP's, a later step's do not: state from "
                     "the previous step was reused (reset it in sync_gradients)")


def _against_torch(rank, world, my_ddp, cap_mb, broken):
    with CollectiveSpy(my_ddp, world=world) as spy:
        ours = train_ddp(rank, world, lambda m: my_ddp(m, bucket_cap_mb=cap_mb))
    reduces = [c for c in spy.calls if c.name == "all_reduce"]
    unwaited = sum(1 for c in reduces if c.async_op and not c.waited)
    ref = train_ddp(rank, world, torch_ddp)
    if (d := max_abs_diff(ours, ref)) > TOL:
        rule, why = _explain_gradients(rank, world, my_ddp, cap_mb, make_model)
        if unwaited:
            rule, why = "wait", (f"{unwaited} of {len(reduces)} all-reduces were never waited, "
                                 "so sync_gradients read buffers still being reduced: call "
                                 "work.wait() on each before dividing")
        broken.setdefault("equal", f"cap {cap_mb} MiB: parameters differ from torch DDP's by "
                                   f"{d:.2e} after 3 steps; {why}")
        if rule != "equal":
            broken.setdefault(rule, f"cap {cap_mb} MiB: {why}")
    elif (d := max_abs_diff(ours, train_single())) > TOL:
        broken.setdefault("equal", f"parameters differ from one process on the global batch by "
                                   f"{d:.2e}")


def _order_problem(log, n_buckets, what) -> str | None:
    order = [i for i, _ in log]
    if order != list(range(n_buckets)):
        return (f"{what}: buckets launched in order {order}, expected {list(range(n_buckets))}: "
                "launch strictly in bucket order (every rank must issue the same all-reduces in "
                "the same order), not in the order buckets fill up")
    return None


def _pattern(rank, world, my_ddp, broken):
    """Two backwards of the MLP, one parameter per bucket, every all-reduce watched."""
    torch.manual_seed(0)
    ddp = my_ddp(MLP(12, (16, 8), 5), bucket_cap_mb=1e-9)
    n = len(ddp.buckets)
    first_launched = first_log = 0  # backward 1's launches and log entries
    with CollectiveSpy(ddp, world=world) as spy:
        for step in range(2):
            start = len(ddp.launch_log)
            spy.phase = "backward"
            F.cross_entropy(ddp(torch.randn(4, 12)), torch.arange(4)).backward()
            launched = [c for c in spy.calls if c.name == "all_reduce"]
            spy.phase = "sync"
            ddp.sync_gradients()
            log = list(ddp.launch_log)[start:]
            if step == 1:
                if len(launched) < n and first_launched == n:
                    broken.setdefault("reset", f"backward 2 launched {len(launched)} of {n} "
                                               f"buckets (backward 1 launched {n}): reset the "
                                               "per-step state at the end of sync_gradients")
                elif len(log) < n and first_log == n:
                    broken.setdefault("reset", f"backward 2 logged {len(log)} of {n} launches: "
                                               "reset the per-step state in sync_gradients")
                break
            first_launched, first_log = len(launched), len(log)
            if (problem := _order_problem(log, n, "MLP")) and log:
                broken.setdefault("order", problem)
            if not launched:
                late = [c for c in spy.calls if c.name == "all_reduce"]
                broken.setdefault("overlap", f"no all-reduce was launched during backward ("
                                             f"{len(late)} in sync_gradients): launch each bucket "
                                             "from the hook as soon as it is full")
            elif log and log[0][1] != 1:
                broken.setdefault("overlap", f"bucket 0 launched after {log[0][1]} gradients were "
                                             "ready (counting the one that completed it): launch "
                                             "it as soon as it is full, during backward")
            for c in launched:
                if not c.async_op:
                    broken.setdefault("async", "a blocking all-reduce in the hook: backward stops "
                                               "until each bucket's communication is done, so "
                                               "nothing overlaps; pass async_op=True, keep the "
                                               "work and wait in sync_gradients()")
                elif c.waited == "backward":
                    broken.setdefault("async", "the all-reduce's work is waited inside the hook: "
                                               "backward stops there; wait in sync_gradients()")
            unwaited = [i for i, c in enumerate(spy.calls) if c.async_op and not c.waited]
            if unwaited:
                broken.setdefault("wait", f"sync_gradients() returned without work.wait() on "
                                          f"{len(unwaited)} of {len(spy.calls)} all-reduces: the "
                                          "buffer may still be in flight when you read it")
            spy.clear()
    if hasattr(ddp, "close"):
        ddp.close()


def _head_first(rank):
    torch.manual_seed(rank)
    return HeadFirst()


def _head_first_order(rank, world, my_ddp, broken):
    ddp = my_ddp(_head_first(rank), bucket_cap_mb=1e-9)  # buckets: body.b, body.w, head.b, head.w
    x, y = global_batch(0, 12)
    F.cross_entropy(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()
    ddp.sync_gradients()
    if problem := _order_problem(list(ddp.launch_log), 4, "model registered head before body"):
        broken.setdefault("order", problem)
        return
    rule, explain = _explain_gradients(rank, world, my_ddp, 1e-9, _head_first)
    if rule != "reset":
        broken.setdefault("equal", f"model registered head before body: {explain}")


def _ddp_rank(rank, world, my_ddp):
    broken: dict[str, str] = {}
    _against_torch(rank, world, my_ddp, 0.0005, broken)      # 4 buckets
    if world in (2, 3):
        _against_torch(rank, world, my_ddp, 25.0, broken)    # 1 bucket
    if world == 2:
        _pattern(rank, world, my_ddp, broken)
        _head_first_order(rank, world, my_ddp, broken)
    return broken


def _ddp_caps_rank(rank, world, my_ddp, caps):
    out = []
    for cap in caps:
        broken: dict[str, str] = {}
        _against_torch(rank, world, my_ddp, cap, broken)
        out.append(broken)
    return out


def _generated_caps(my_ddp, timeout):
    """Bucket caps hypothesis draws (1 to all of the model's parameters per bucket), one launch
    per world size 2-4, against torch's DDP; ``(rule, message)`` for the first that breaks one."""
    from minidist.launch import run

    from .core import _merge_rank_messages
    caps = examples(st.integers(1, 4000).map(lambda b: b / 2**20), 3)   # bytes -> MiB
    for world in (2, 3, 4):
        per_rank = run(_ddp_caps_rank, world, my_ddp, caps, timeout=3 * timeout)
        for i, cap in enumerate(caps):
            for key in DDP_RULES:
                merged = _merge_rank_messages([d[i].get(key) for d in per_rank])
                if merged:
                    return key, f"W={world}, bucket cap {cap * 2**20:.0f} bytes (generated): {merged}"
    return None


def grade_ddp(my_ddp, total: float = 7, timeout: float = 60.0, build_buckets=None) -> Report:
    """Grade ``MyDDP`` (see the module docstring): one launch per world size 1-4, one check per
    rule of :data:`DDP_RULES`. ``build_buckets``: Part A's function (default: the one ``MyDDP``
    calls); when it breaks a layout rule, the report says first that Part B fails because of it."""
    report = Report("Part B: MyDDP against torch's DDP", total=total)
    if build_buckets is None:
        build_buckets = getattr(my_ddp.__init__, "__globals__", {}).get("build_buckets")
    if callable(build_buckets) and (layout := _layout_rank(build_buckets)):
        report.notes.append("fails because build_buckets (Part A) fails: "
                            + "; ".join(f"[{k}] {v}" for k, v in layout.items())
                            + " — fix Part A first")
    check_rules(report, DDP_RULES, _ddp_rank, (1, 2, 3, 4), my_ddp, timeout=timeout)
    if not report.failed:   # the rules hold at the named caps: caps hypothesis draws
        report.check("3 generated bucket caps at W = 2, 3, 4 against torch's DDP",
                     lambda: _generated_caps(my_ddp, timeout))
    return report
