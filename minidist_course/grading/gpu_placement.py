"""Grade exercise 11: where a rank computes, and over what, on a node with some GPUs.

``place(local_rank, local_world_size, gpus, backend)`` → ``(device, backend, memory_fraction)``:

* no GPU: ``("cpu", "gloo", None)``; ``backend="nccl"`` raises ``ValueError`` (NCCL moves CUDA
  tensors only);
* GPUs: every rank computes on ``"cuda:{local_rank % gpus}"``; ``ceil(local_world_size / gpus)``
  ranks share a GPU and each may use ``1 / that`` of its memory (``None`` when a rank has a GPU of
  its own); ``backend="auto"`` is nccl when every rank has its own GPU, else gloo;
  ``backend="nccl"`` with more ranks than GPUs raises ``ValueError`` (NCCL refuses two ranks on
  one device).

The expected answer of every case is :func:`minidist.env.plan_devices` (``device="cuda"`` with
GPUs, ``"cpu"`` without): a ``ValueError`` from it means the learner's ``place`` must raise one.
"""

from __future__ import annotations

from minidist.env import plan_devices
from .core import Report
from .generated import generated_check, st

__all__ = ["CASES", "expected", "grade_place", "PLACE_RULES"]

PLACE_RULES = {
    "cpu": "no GPU: the CPU and gloo, no memory share",
    "device": "every rank computes on cuda:{local_rank % gpus} (ranks share GPUs)",
    "share": "ceil(ranks / gpus) ranks share a GPU and each may use 1 / that of its memory "
             "(None with a GPU of its own)",
    "backend": "auto is nccl when every rank has a GPU of its own, else gloo (NCCL refuses two "
               "ranks on one GPU)",
    "nccl_error": "backend nccl raises ValueError without a GPU per rank",
}
_WHAT_RULE = {"device": "device", "backend": "backend", "memory fraction": "share"}

CASES = [(lr, lws, gpus, backend)
         for gpus, lws, lr in [(0, 1, 0), (0, 4, 3), (1, 1, 0), (1, 2, 1), (1, 8, 5), (2, 2, 1),
                               (2, 3, 2), (2, 8, 7), (4, 4, 3), (4, 2, 1), (4, 8, 6)]
         for backend in ("gloo", "nccl", "auto")]


def expected(local_rank: int, local_world_size: int, gpus: int, backend: str):
    """``(device, backend, memory_fraction)`` from ``plan_devices``; raises its ``ValueError``."""
    plan = plan_devices("cuda" if gpus else "cpu", backend, local_world_size, gpus)
    device = f"cuda:{local_rank % gpus}" if plan.device == "cuda" else "cpu"
    return device, plan.backend, plan.memory_fraction


def _name(case) -> str:
    lr, lws, gpus, backend = case
    return f"local rank {lr} of {lws}, {gpus} GPU(s), backend {backend!r}"


def _check(fn, case):
    try:
        want = expected(*case)
    except ValueError as e:
        try:
            got = fn(*case)
        except ValueError:
            return None
        return "nccl_error", (f"expected ValueError ({str(e).split('. ')[0]}), got {got!r}")
    got = fn(*case)
    if not (isinstance(got, tuple) and len(got) == 3):
        return ("cpu" if not case[2] else "device"), (
            f"expected a tuple (device, backend, memory_fraction) {want!r}, got {got!r}")
    for what, w, g in zip(("device", "backend", "memory fraction"), want, got):
        same = (g is None and w is None) if (w is None or g is None) else \
            (abs(g - w) <= 1e-9 if what == "memory fraction" else g == w)
        if not same:
            hint = ""
            if what == "device" and case[2] and g == f"cuda:{case[0]}":
                hint = f" — ranks share the {case[2]} GPU(s): local_rank % gpus"
            elif what == "memory fraction" and w is not None and g == 1 / case[1]:
                hint = (" — the share is per GPU: ceil(ranks / gpus) ranks share one, not all "
                        f"{case[1]}")
            elif what == "backend" and w == "gloo" and g == "nccl":
                hint = " — NCCL refuses two ranks on one GPU: shared GPUs go over gloo"
            rule = "cpu" if not case[2] else _WHAT_RULE[what]
            return rule, f"{what}: expected {w!r}, got {g!r}{hint} (expected {want!r})"
    return None


def grade_place(fn, total: float = 4) -> Report:
    """``fn(local_rank, local_world_size, gpus, backend)`` on :data:`CASES`."""
    report = Report("Who computes where, over what", total=total, rules=PLACE_RULES)
    for case in CASES:
        report.check(_name(case), lambda c=case: _check(fn, c))
    cases = st.tuples(st.integers(1, 64), st.integers(0, 16),
                      st.sampled_from(["gloo", "nccl", "auto"])).flatmap(
        lambda c: st.tuples(st.integers(0, c[0] - 1), st.just(c[0]), st.just(c[1]), st.just(c[2])))
    generated_check(report, "1 to 64 ranks on 0 to 16 GPUs", cases, lambda c: _check(fn, c),
                    max_examples=80, describe=_name, crash_rule="device")
    return report
