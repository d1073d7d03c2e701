"""Grade exercise 15: the capacity rule, the load-balancing loss and the token permutation of a
mixture-of-experts layer, against :mod:`minidist.expert_parallel` and the dense reference.

The learner writes (see ``exercises/15_moe_dispatch.ipynb``):

* ``capacity(num_tokens, num_experts, top_k, capacity_factor) -> int``: ``ceil(T·k·factor/E)``
  computed exactly (checked on cases where the float formula rounds wrong; Megatron-LM's
  ``get_capacity`` computes it in floats, see :func:`minidist.expert_parallel.router.expert_capacity`);
* ``aux_loss(probs, experts, coeff) -> 0-dim tensor``: Switch/GShard ``coeff·E·Σ f_i·P_i``, f
  the fraction of the T·k assignments per expert, P the mean router probability, its gradient
  reaching ``probs``;
* ``permutation(experts, weights, kept, num_experts) -> (token_index, row_weights, counts)`` and
  ``unpermute(rows, token_index, row_weights, num_tokens)``: the expert-major order of the kept
  assignments and its weighted inverse; graded as they are used — one MoE forward and backward
  against :func:`~minidist_course.references.expert_parallel.dense_moe`.

Every wrong answer is compared with the usual slips and the grader names the one it matches:
rounding down or to nearest, the float ceil, forgetting k; f over T instead of T·k, P from the
chosen weights, no E, no gradient; rows not grouped by expert, flat row ids t·k + j given as
token_index, dropped rows sent, a token's k rows assigned instead of summed, rows not weighted,
tokens returned to the wrong positions. Each check's failure names its rule of
:data:`CAPACITY_RULES`, :data:`AUX_RULES` or :data:`PERM_RULES` (``[id] rule text: ...``).
"""

from __future__ import annotations

import math
from fractions import Fraction

import torch

from minidist.expert_parallel import permute as lib_permute
from ..references.expert_parallel import dense_moe
from minidist.expert_parallel.router import expert_capacity, keep_mask, load_balancing_loss, route
from .core import Report
from .generated import generated_check, st

__all__ = ["CAPACITY_CASES", "grade_aux_loss", "grade_capacity", "grade_permutation",
           "CAPACITY_RULES", "AUX_RULES", "PERM_RULES"]

CAPACITY_RULES = {
    "ceil": "round up (ceil), not down or to nearest: the fair share always fits",
    "exact": "the ceil computed exactly, not on floats ((100 / 2) · 1.1 is 55.00000000000001)",
    "top_k": "each token makes k assignments: ceil(T·k·factor/E)",
    "int": "the answer is an int, ceil(T·k·factor/E)",
    "once": "one ceil, after the factor: ceil(T·k·factor/E), not ceil(ceil(T·k/E)·factor)",
}
AUX_RULES = {
    "f": "f_i is the fraction of the T·k assignments that chose expert i (the f_i sum to 1)",
    "P": "P_i is the mean over the T tokens of the full softmax column probs[:, i]",
    "E": "the factor E: α·E·Σ f_i·P_i, so perfect balance gives α",
    "grad": "the gradient reaches probs through P (f is a count, a constant)",
    "value": "a 0-dim tensor equal to α·E·Σ f_i·P_i within 1e-6",
    "counts": "f has one entry per expert, 0 for an expert no token chose "
              "(bincount(..., minlength=E)): a collapsed router is the case the loss is for",
}
PERM_RULES = {
    "dropped": "a row over capacity is not sent: counts count the kept assignments only",
    "expert_major": "rows grouped by expert (expert-major), in token order inside an expert",
    "tokens": "expert e's rows are the tokens that chose e and were kept (each (token, choice) once)",
    "token_index": "token_index holds token ids t, not flat row ids t·k + j (divide by k)",
    "weights": "row_weights follow the rows: row n's weight is its (token, choice)'s",
    "sum": "unpermute sums a token's k weighted rows (index_add), it does not assign them",
    "weighted": "each row is weighted by its router probability before the sum",
    "positions": "row n goes back to token token_index[n]; a token with no row gets zeros",
    "graph": "row_weights stay in the autograd graph: the router gets a gradient",
}

CAPACITY_CASES = [  # (T, E, k, factor)
    (10, 4, 1, 1.0),      # 2.5 -> 3: round up
    (12, 4, 1, 1.0),      # exactly 3
    (10, 4, 2, 1.25),     # 6.25 -> 7: k counts
    (100, 2, 1, 1.1),     # (100/2)*1.1 = 55.00000000000001 in floats: exactly 55
    (50, 1, 1, 2.2),      # 50*2.2 = 110.00000000000001: exactly 110
    (14, 8, 2, 1.0),      # 3.5 -> 4
    (3, 8, 1, 0.5),       # 0.1875 -> 1
]


def _capacity_check(fn, case):
    T, E, k, f = case
    want = expert_capacity(T, E, k, f)
    got = fn(T, E, k, f)
    if isinstance(got, bool) or not isinstance(got, int):
        return "int", f"expected an int ({want}), got {type(got).__name__} {got!r}"
    if got == want:
        return None
    text = f"expected {want}, got {got}"
    exact = T * k * f / E
    rule = "int"
    if got == math.ceil((T / E) * f * k) or got == math.ceil(T * k * f / E):
        text += (f": floating point — {T}·{k}·{f}/{E} is {exact!r} in floats; compute the ceil "
                 "exactly (fractions.Fraction(str(factor)), or integers)")
        rule = "exact"
    elif got in (math.ceil(Fraction(math.ceil(Fraction(T * k, E))) * Fraction(repr(float(f)))),
                 math.floor(math.ceil(Fraction(T * k, E)) * Fraction(repr(float(f))))) \
            and got != math.floor(exact):
        text += (f": the factor applied after a first ceil — ceil({T}·{k}/{E}) = "
                 f"{math.ceil(Fraction(T * k, E))}, times {f}, rounded again; scale T·k/E by the "
                 "factor first, then round up once")
        rule = "once"
    elif k > 1 and got == expert_capacity(T, E, 1, f):
        text += ": top_k is missing — each token makes k assignments: ceil(T·k·factor/E)"
        rule = "top_k"
    elif got == round(exact) and got != math.floor(exact):
        text += (": rounded to nearest (Python's round: half to even); the rule rounds up (ceil), "
                 "so the fair share always fits")
        rule = "ceil"
    elif got == math.floor(exact):
        both = " (or to nearest, half to even: both give that here)" if got == round(exact) else ""
        text += f": rounded down{both}; the rule rounds up (ceil), so the fair share always fits"
        rule = "ceil"
    return rule, text


# (T, E, k, factor): factors with one or two decimals, where floats round both ways
CAPACITY_INPUTS = st.integers(1, 64).flatmap(lambda E: st.tuples(
    st.integers(0, 4096), st.just(E), st.integers(1, min(E, 8)),
    st.integers(1, 400).map(lambda n: n / 100)))


def grade_capacity(fn, total: float = 2) -> Report:
    report = Report("Part A: expert capacity", total=total, rules=CAPACITY_RULES)
    for case in CAPACITY_CASES:
        T, E, k, f = case
        report.check(f"T={T} E={E} k={k} factor {f}", lambda c=case: _capacity_check(fn, c))
    generated_check(report, "T, E, k, factor", CAPACITY_INPUTS, lambda c: _capacity_check(fn, c),
                    max_examples=300, describe=lambda c: "T={} E={} k={} factor {}".format(*c),
                    crash_rule="int")
    return report


def _aux_inputs(T, E, k, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g) * 2
    probs, experts, weights = route(logits, k)
    return probs, experts, weights


def _aux_variants(probs, experts, weights, coeff):
    T, E = probs.shape
    k = experts.shape[1]
    counts = torch.bincount(experts.reshape(-1), minlength=E).float()
    P = probs.mean(0)
    chosen_P = torch.zeros(E).scatter_add(0, experts.reshape(-1), weights.reshape(-1)) / T
    return {  # what a slip is -> (the rule it breaks, the value it gives)
        "f divided by T, not T·k: the fractions f_i must sum to 1 over the experts":
            ("f", coeff * E * (counts / T * P).sum()),
        "P from the chosen experts' weights only: P_i is the mean of the full softmax column i":
            ("P", coeff * E * (counts / (T * k) * chosen_P).sum()),
        "the factor E is missing: α·E·Σ f_i·P_i (so that perfect balance gives α)":
            ("E", coeff * (counts / (T * k) * P).sum()),
        "P summed over the tokens, not averaged":
            ("P", coeff * E * (counts / (T * k) * probs.sum(0)).sum()),
    }


def _aux_check(fn, T, E, k, coeff, seed, collapse=None):
    probs, experts, weights = _aux_inputs(T, E, k, seed)
    if collapse is not None:   # the router's choices pile onto the first experts: others get none
        experts = torch.arange(k).repeat(T, 1) + collapse * 0
        weights = probs.gather(1, experts)
    p = probs.clone().requires_grad_()
    try:
        got = fn(p, experts, coeff)
    except RuntimeError as e:
        if "must match the size" in str(e) and int(experts.max()) < E - 1:
            return "counts", (f"{e} — expert {E - 1} got no token, so bincount without "
                              "minlength returns fewer than E counts")
        raise
    if not isinstance(got, torch.Tensor) or got.numel() != 1:
        return "value", f"expected a 0-dim tensor, got {type(got).__name__} {got!r}"
    want = load_balancing_loss(probs, torch.bincount(experts.reshape(-1), minlength=E), T * k, coeff)
    if abs(float(got.detach()) - float(want)) > 1e-6 * max(1.0, abs(float(want))):
        text = f"expected {float(want):.6g}, got {float(got.detach()):.6g}"
        for slip, (rule, value) in _aux_variants(probs, experts, weights, coeff).items():
            if abs(float(got.detach()) - float(value)) <= 1e-6 * max(1.0, abs(float(value))):
                return rule, f"{text}: {slip}"
        short = torch.bincount(experts.reshape(-1)).float() / (T * k)   # bincount, no minlength
        if short.numel() == 1 < E and abs(float(got.detach()) - float(
                coeff * E * (short * probs.mean(0)).sum())) <= 1e-6 * max(1.0, abs(float(want))):
            return "counts", (f"{text}: every assignment went to expert 0, and the counts have 1 "
                              f"entry, not E = {E}, so it broadcast over every P_i — experts no "
                              "token chose must count 0 (bincount with minlength=E)")
        return "value", text
    if not got.requires_grad:
        return "grad", ("the value is right but it has no gradient: P must be computed from probs with "
                "autograd (only the counts f are constants), or the router never learns to balance")
    got.backward()
    counts = torch.bincount(experts.reshape(-1), minlength=E).float()
    want_grad = (coeff * E * counts / (T * k) / T).expand(T, E)
    if p.grad is None or (p.grad - want_grad).abs().max() > 1e-6:
        return "grad", ("the gradient with respect to probs is wrong: d/dprobs[t, i] = α·E·f_i/T (f a "
                "constant, P the mean of probs)")
    return None


# (T, E, k, coeff, seed, collapse): None for a random router, else every token on experts 0..k-1
AUX_INPUTS = st.integers(1, 8).flatmap(lambda E: st.tuples(
    st.integers(1, 40), st.just(E), st.integers(1, E), st.sampled_from([0.01, 0.1, 1.0]),
    st.integers(0, 2**16), st.one_of(st.none(), st.just(0))))


def _describe_aux(a):
    T, E, k, coeff, seed, collapse = a
    router = "random router (seed {})".format(seed) if collapse is None else \
        f"collapsed router: every token chose experts 0..{k - 1}"
    return f"T={T} E={E} k={k} α={coeff}, {router}"


def grade_aux_loss(fn, total: float = 2) -> Report:
    report = Report("Part B: the load-balancing loss", total=total, rules=AUX_RULES)
    for T, E, k, coeff, seed in ((16, 4, 1, 0.01, 0), (30, 8, 2, 0.1, 1), (7, 2, 2, 1.0, 2)):
        report.check(f"T={T} E={E} k={k} α={coeff}: value and gradient",
                     lambda a=(T, E, k, coeff, seed): _aux_check(fn, *a))
    generated_check(report, "value and gradient", AUX_INPUTS, lambda a: _aux_check(fn, *a),
                    max_examples=60, describe=_describe_aux, crash_rule="value")
    return report


class _TokenIndexRange(Exception):
    """token_index holds something that is not a token of the batch."""


def _moe_with(perm_fn, unperm_fn, x, router_w, experts_mods, k, capacity):
    """One MoE forward with the learner's permutation: rows per expert slice, then un-permute."""
    _, chosen, weights = route(x @ router_w.t(), k)
    kept = keep_mask(chosen, weights, len(experts_mods), capacity)
    token_index, row_w, counts = perm_fn(chosen, weights, kept, len(experts_mods))
    bad = torch.as_tensor(token_index).reshape(-1)
    if bad.numel() and not 0 <= int(bad.min()) <= int(bad.max()) < x.shape[0]:
        raise _TokenIndexRange(f"token_index holds {int(bad.max())}, outside the tokens "
                               f"0..{x.shape[0] - 1}")
    rows = x[token_index]
    outs = [m(piece) for m, piece in zip(experts_mods, rows.split([int(c) for c in counts]))]
    return unperm_fn(torch.cat(outs), token_index, row_w, x.shape[0]), chosen, weights, kept


def _perm_table_check(perm_fn, T, E, k, capacity, seed):
    g = torch.Generator().manual_seed(seed)
    _, chosen, weights = route(torch.randn(T, E, generator=g), k)
    kept = keep_mask(chosen, weights, E, capacity)
    want_idx, want_w, want_counts = lib_permute.permutation(chosen, weights, kept, E)
    idx, w, counts = perm_fn(chosen, weights, kept, E)
    idx, counts = torch.as_tensor(idx).long(), torch.as_tensor(counts).long()
    if counts.tolist() != want_counts.tolist():
        if counts.tolist() == torch.bincount(chosen.reshape(-1), minlength=E).tolist() and \
                not bool(kept.all()):
            return "dropped", (f"counts {counts.tolist()} include dropped assignments (expected "
                    f"{want_counts.tolist()}): a row over capacity is not sent")
        return "dropped", f"counts per expert: expected {want_counts.tolist()}, got {counts.tolist()}"
    if idx.tolist() == want_idx.tolist():
        if not torch.allclose(torch.as_tensor(w).float(), want_w):
            return "weights", "row_weights do not follow the rows: row n's weight is its (token, choice)'s"
        return None
    if sorted(idx.tolist()) == sorted(want_idx.tolist()):
        per_expert = list(torch.as_tensor(idx).split(counts.tolist()))
        rows_ok = all(sorted(a.tolist()) == sorted(b.tolist())
                      for a, b in zip(per_expert, want_idx.split(want_counts.tolist())))
        if rows_ok:
            return "expert_major", (f"within an expert the rows must be in token order (Megatron-LM's "
                    f"routing_map.T.nonzero()): expected {want_idx.tolist()}, got {idx.tolist()}")
        if idx.tolist() == sorted(idx.tolist()):
            return "expert_major", (f"rows are not grouped by expert (expert-major): expected "
                    f"token_index {want_idx.tolist()}, got {idx.tolist()} (token order)")
    k = chosen.shape[1]
    if k > 1 and (idx // k).tolist() == want_idx.tolist():
        return "token_index", (f"token_index: expected {want_idx.tolist()}, got {idx.tolist()}: "
                               f"flat row ids, not token indices: divide by k = {k}")
    per_expert = torch.as_tensor(idx).split(counts.tolist())
    for e, (a, b) in enumerate(zip(per_expert, want_idx.split(want_counts.tolist()))):
        if sorted(a.tolist()) != sorted(b.tolist()):
            return "tokens", (f"expert {e} gets tokens {a.tolist()}, expected {b.tolist()} (the "
                    f"tokens that chose it and were kept): token_index {idx.tolist()}, expected "
                    f"{want_idx.tolist()}")
    return "expert_major", f"token_index: expected {want_idx.tolist()}, got {idx.tolist()}"


def _unpermute_check(perm_fn, unperm_fn, T, E, k, capacity, seed):
    torch.manual_seed(seed)
    from minidist.models.gpt import MLP, GPTConfig
    cfg = GPTConfig(n_embd=8)
    mods = [MLP(cfg) for _ in range(E)]
    router_w = torch.randn(E, 8, requires_grad=True)
    x = torch.randn(T, 8, requires_grad=True)
    try:
        y, chosen, weights, kept = _moe_with(perm_fn, unperm_fn, x, router_w, mods, k, capacity)
    except _TokenIndexRange as e:
        return "token_index", str(e)
    if tuple(y.shape) != (T, 8):
        return "positions", f"unpermute must return [num_tokens, width] = {(T, 8)}, got {tuple(y.shape)}"
    y_ref, _, _ = dense_moe(x, router_w, mods, k, capacity)
    err = (y - y_ref).abs().max().item()
    if err > 1e-5:
        # which slip? compare with what the usual mistakes give
        idx, w, _ = lib_permute.permutation(chosen, weights, kept, E)
        rows = torch.cat([m(p) for m, p in zip(mods, x[idx].split(
            torch.bincount(torch.where(kept, chosen, E).reshape(-1), minlength=E + 1)[:E].tolist()))])
        assigned = torch.zeros(T, 8).index_copy(0, idx, rows * w[:, None])
        unweighted = torch.zeros(T, 8).index_add(0, idx, rows)
        for rule, slip, value in (("sum", "a token's k rows must be summed (index_add), not "
                                   "assigned: the second choice overwrote the first", assigned),
                                  ("weighted", "rows are not weighted by their router "
                                   "probability", unweighted)):
            if (y - value).abs().max().item() <= 1e-5:
                return rule, f"output differs from the dense MoE by {err:.3g}: {slip}"
        return "positions", (f"output differs from the dense MoE by {err:.3g}: tokens returned to the wrong "
                "positions — row n belongs to token token_index[n]")
    probe = torch.randn(T, 8, generator=torch.Generator().manual_seed(seed))
    want = torch.autograd.grad((y_ref * probe).sum(), router_w, allow_unused=True)[0]
    (y * probe).sum().backward()
    got = router_w.grad if router_w.grad is not None else torch.zeros_like(router_w)
    want = want if want is not None else torch.zeros_like(router_w)
    if not torch.allclose(got, want, atol=1e-5, rtol=1e-4):
        return "graph", ("the output is right but the router's gradient is not the dense MoE's "
                f"(largest difference {float((got - want).abs().max()):.3g}): keep row_weights in the "
                "autograd graph (no .detach(), no .item())")
    return None


def grade_permutation(perm_fn, unperm_fn, total: float = 3) -> Report:
    report = Report("Part C: permute and un-permute", total=total, rules=PERM_RULES)
    cases = [(6, 4, 1, None, 0), (10, 4, 2, None, 1), (12, 8, 2, 2, 2), (9, 2, 2, 3, 3)]
    for T, E, k, cap, seed in cases:
        name = f"T={T} E={E} k={k} capacity {cap if cap is not None else 'none (dropless)'}"
        report.check(f"{name}: the permutation table",
                     lambda a=(T, E, k, cap, seed): _perm_table_check(perm_fn, *a))
        report.check(f"{name}: MoE output and router gradient = dense MoE",
                     lambda a=(T, E, k, cap, seed): _unpermute_check(perm_fn, unperm_fn, *a))
    inputs = st.integers(1, 6).flatmap(lambda E: st.tuples(
        st.integers(1, 12), st.just(E), st.integers(1, min(E, 3)),
        st.one_of(st.none(), st.integers(0, 4)), st.integers(0, 2**16)))
    describe = "T={} E={} k={} capacity {} (seed {})".format
    generated_check(report, "permutation tables", inputs, lambda a: _perm_table_check(perm_fn, *a),
                    max_examples=60, describe=lambda a: describe(*a), crash_rule="expert_major")
    generated_check(report, "MoE output and router gradient", inputs,
                    lambda a: _unpermute_check(perm_fn, unperm_fn, *a), max_examples=20,
                    describe=lambda a: describe(*a), crash_rule="positions")
    return report
