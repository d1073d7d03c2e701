"""Grade exercise 00: the memory wall and the time wall as calculations, against ``minidist_course.planner.calc``.

The learner writes (see ``exercises/00_memory_and_time.ipynb``):

* ``bytes_per_param(mixed_precision)`` → ``{"weights", "grads", "optimizer"}`` bytes per parameter
  when training with Adam: fp32 4 + 4 + 8; mixed precision 2 + 2 + 12 (the fp32 master copy sits
  with the optimizer state) — ZeRO (Rajbhandari et al. 2020) §3.1;
* ``training_memory_bytes(params, mixed_precision)``: weights + gradients + optimizer state;
* ``training_flops(params, tokens)`` ≈ 6·N·D (Kaplan et al. 2020, §2.1);
* ``training_days(params, tokens, n_gpus, peak_flops, mfu)``: the FLOPs over n_gpus · peak · MFU,
  in days, assuming perfect scaling.

A wrong number is reported with the ratio yours/expected and, when the ratio is a typical slip
(86400: seconds not days; 1/3: 2·N·D, forward only; 0.75: the master weights forgotten...), what it
means.
"""

from __future__ import annotations

from ..planner import calc
from .core import Report
from .generated import generated_check, st

__all__ = ["grade_bytes_per_param", "grade_training_memory", "grade_flops_and_days",
           "PRIMER_MODEL", "BYTES_RULES", "MEMORY_RULES", "FLOPS_RULES"]

BYTES_RULES = {
    "fp32": "fp32 with Adam: 4 bytes of weights, 4 of gradients, 8 of optimizer state (two moments)",
    "master": "mixed precision: 2 + 2, and the optimizer state holds the fp32 master weights too: "
              "4 + 4 + 4",
    "keys": "a dict with the keys weights, grads and optimizer",
}
MEMORY_RULES = {
    "total": "weights + gradients + optimizer state, for every parameter",
    "master": "mixed precision keeps the fp32 master copy: 16 bytes per parameter, as fp32",
    "bytes": "in bytes (not GB)",
}
FLOPS_RULES = {
    "six": "training FLOPs ≈ 6·N·D (forward 2·N·D, backward 4·N·D)",
    "mfu": "the GPUs deliver MFU x their peak, not the peak",
    "days": "the answer is in days: seconds / 86400",
}
_HINT_RULE = {86400.0: "days", 24.0: "days", 1 / 86400: "days", 1 / 3: "six", 0.75: "master",
              1e9: "bytes", 1e-9: "bytes"}

PRIMER_MODEL = 100e9  # chapter 00's model: 100 billion parameters

_HINTS = [  # (ratio yours/expected, what it usually means)
    (86400.0, "seconds, not days (divide by 86400)"),
    (24.0, "hours, not days"),
    (1 / 86400, "days divided by 86400 once too often"),
    (1 / 3, "2·N·D is the forward pass only; training is 6·N·D (backward ≈ 2× forward)"),
    (0.75, "the fp32 master copy of the weights (4 bytes/param) is missing"),
    (2.0, "twice too much: a factor counted twice?"),
    (0.5, "half of what is expected: a factor missing?"),
    (1e9, "GB where bytes were asked (1 GB = 1e9 bytes)"),
    (1e-9, "bytes divided by 1e9: bytes were asked"),
]


def _close(got, want, rel=1e-9) -> bool:
    return isinstance(got, (int, float)) and abs(got - want) <= rel * abs(want)


def _wrong(what: str, got, want, default: str = "", mfu: float | None = None):
    """The message for a wrong number; with ``default`` (a rule id), ``(rule, message)``: the
    rule a typical slip breaks (from its ratio yours/expected), else ``default``."""
    rule = default
    if not isinstance(got, (int, float)) or isinstance(got, bool):
        text = f"{what}: expected a number, got {type(got).__name__} {got!r}"
        return (rule, text) if default else text
    text = f"{what}: expected {want:.6g}, got {got:.6g}"
    if want and got:
        ratio = got / want
        text += f" (yours/expected = {ratio:.4g})"
        for r, hint in _HINTS:
            if abs(ratio / r - 1) < 1e-3:
                text += f": {hint}"
                rule = _HINT_RULE.get(r, rule)
                break
        else:
            if mfu is not None and abs(ratio / mfu - 1) < 1e-3:
                text += f": the MFU ({mfu:g}) is missing: the GPUs deliver MFU x peak"
                rule = "mfu"
            for k in (1000, 1e-3, 8, 1 / 8):
                if abs(ratio / k - 1) < 1e-3:
                    text += f": off by a factor {k:g}"
    return (rule, text) if default else text


def _expected_split(mixed: bool) -> dict:
    m = calc.training_memory(1, "bf16" if mixed else "fp32", "adam")
    return {"weights": m.weights, "grads": m.grads, "optimizer": m.optimizer}


def _check_split(fn, mixed: bool):
    got = fn(mixed)
    want = _expected_split(mixed)
    if not isinstance(got, dict) or set(got) != set(want):
        return "keys", f"expected a dict with keys {sorted(want)}, got {got!r}"
    label = "mixed precision" if mixed else "fp32"
    bad = [_wrong(f"{label} {k}", got[k], v) for k, v in want.items() if not _close(got[k], v)]
    if bad:
        return ("master" if mixed else "fp32"), "; ".join(bad)
    return None


def grade_bytes_per_param(fn, total: float = 2) -> Report:
    """``fn(mixed_precision)`` against ``calc.training_memory(1, dtype, "adam")``."""
    report = Report("Part A: bytes per parameter, Adam", total=total, rules=BYTES_RULES)
    report.check("fp32: 4 + 4 + 8", lambda: _check_split(fn, False))
    report.check("mixed precision: 2 + 2 + 12 (fp32 master weights and two moments)",
                 lambda: _check_split(fn, True))
    return report


def grade_training_memory(fn, total: float = 2) -> Report:
    """``fn(params, mixed_precision)`` against ``calc.training_memory(...).total``."""
    report = Report("Part B: training memory", total=total, rules=MEMORY_RULES)
    for params, mixed in [(PRIMER_MODEL, True), (PRIMER_MODEL, False), (7e9, True), (1, True)]:
        want = calc.training_memory(params, "bf16" if mixed else "fp32", "adam").total
        label = f"{params:g} parameters, {'mixed precision' if mixed else 'fp32'}"
        report.check(f"{label}: {calc.human_bytes(want)}",
                     lambda p=params, m=mixed, w=want, lb=label:
                     None if _close(fn(p, m), w) else _wrong(lb, fn(p, m), w, "total"))

    def one(case):
        params, mixed = case
        want = calc.training_memory(params, "bf16" if mixed else "fp32", "adam").total
        got = fn(params, mixed)
        return None if _close(got, want) else _wrong(f"{params:g} parameters", got, want, "total")
    generated_check(report, "parameter counts 1 to 1e13", st.tuples(
        st.one_of(st.integers(1, 10**13), st.floats(1, 1e13)), st.booleans()), one,
        max_examples=50, describe=lambda c: f"params={c[0]!r}, mixed_precision={c[1]}",
        crash_rule="total")
    return report


def _days(params, tokens, n_gpus, peak, mfu):
    return calc.training_time(calc.training_flops(params, tokens), n_gpus, peak, mfu) / 86400


def grade_flops_and_days(flops_fn, days_fn, total: float = 4) -> Report:
    """``flops_fn(params, tokens)`` against ``calc.training_flops``; ``days_fn(params, tokens,
    n_gpus, peak_flops, mfu)`` against ``calc.training_time(...) / 86400``."""
    report = Report("Part C: FLOPs and days", total=total, rules=FLOPS_RULES)
    a100, h100 = calc.GPUS["A100-80GB"]["peak_flops"], calc.GPUS["H100-80GB"]["peak_flops"]
    for params, tokens in [(PRIMER_MODEL, 2e12), (175e9, 300e9), (7e9, 2e12)]:
        want = calc.training_flops(params, tokens)
        label = f"training FLOPs, N={params:g}, D={tokens:g}"
        report.check(f"{label}: {want:.3g}", lambda p=params, t=tokens, w=want, lb=label:
                     None if _close(flops_fn(p, t), w) else _wrong(lb, flops_fn(p, t), w, "six"))
    for params, tokens, n, peak, mfu in [(PRIMER_MODEL, 2e12, 1024, a100, 0.4),
                                         (7e9, 2e12, 1, a100, 0.4),
                                         (175e9, 300e9, 1024, h100, 0.5)]:
        want = _days(params, tokens, n, peak, mfu)
        label = f"days, N={params:g}, D={tokens:g}, {n} GPUs at {peak:.3g} FLOP/s, MFU {mfu:g}"
        report.check(f"{label}: {want:.4g}",
                     lambda a=(params, tokens, n, peak, mfu), w=want, lb=label:
                     None if _close(days_fn(*a), w, 1e-6) else _wrong(lb, days_fn(*a), w, "days",
                                                                      mfu=a[4]))

    def one(case):
        params, tokens, n, peak, mfu = case
        flops, want = calc.training_flops(params, tokens), _days(*case)
        got = flops_fn(params, tokens)
        if not _close(got, flops):
            return _wrong("training FLOPs", got, flops, "six")
        got = days_fn(*case)
        return None if _close(got, want, 1e-6) else _wrong("days", got, want, "days", mfu=mfu)
    big = st.floats(1e6, 1e13)
    generated_check(report, "FLOPs and days of random runs", st.tuples(
        big, big, st.integers(1, 100_000), st.floats(1e12, 5e15), st.floats(0.01, 1.0)), one,
        max_examples=50, crash_rule="six",
        describe=lambda c: "N={:.4g}, D={:.4g}, {} GPUs at {:.4g} FLOP/s, MFU {:.3g}".format(*c))
    return report
