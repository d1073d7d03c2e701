"""Generated inputs in the graders (minidist_course/grading/generated.py), and the attempts a
learner's trial run got past the hand-picked cases or saw named under the wrong rule: each now
scores below full marks, naming the right rule."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from minidist_course.grading import context_parallel as cp, expert_parallel as moe
from minidist_course.grading.core import Report
from minidist_course.grading.generated import generated_check, st


def _failed(report):
    return [r for r in report.results if not r.passed]


def test_generated_check_shows_the_smallest_failing_input_and_is_seeded():
    def check(n):   # wrong from 37 on
        return None if n < 37 else ("big", f"{n} is too big")
    messages = []
    for _ in range(2):
        report = Report("t", rules={"big": "n stays under 37"})
        generated_check(report, "n", st.integers(0, 10**6), check, max_examples=50)
        (bad,) = _failed(report)
        messages.append(bad.message)
    assert messages[0] == messages[1]                       # the same inputs every run
    assert "smallest generated input that fails, 37: 37 is too big" in messages[0]
    assert messages[0].startswith("[big] n stays under 37")


def test_generated_check_shows_a_crash_with_its_input_under_the_crash_rule():
    report = Report("t", rules={"int": "an int"})
    generated_check(report, "n", st.integers(0, 100), lambda n: [][n] if n > 4 else None,
                    max_examples=50, crash_rule="int")
    (bad,) = _failed(report)
    assert bad.rule == "int" and "input that fails, 5, your code raised" in bad.message
    assert "IndexError" in bad.message


def test_generated_check_passes_a_right_function():
    report = Report("t")
    generated_check(report, "n", st.integers(), lambda n: None, max_examples=20)
    assert report.passed


# ---------------------------------------------------------------- exercise 15, learners' attempts

def _capacity(T, E, k, f):
    return math.ceil(Fraction(T * k) * Fraction(str(float(f))) / E)


def test_factor_after_the_ceiling_is_named_once():
    """Passed all seven named cases; gives 5 where the rule gives 4 (T=7, E=2, factor 1.1)."""
    def after(T, E, k, f):
        return math.ceil(Fraction(math.ceil(Fraction(T * k, E))) * Fraction(str(float(f))))
    assert all(after(*c) == _capacity(*c) for c in moe.CAPACITY_CASES)   # why it got through
    report = moe.grade_capacity(after)
    assert report.score < report.max_score
    assert [r.rule for r in _failed(report)] == ["once"]
    assert "scale T·k/E by the factor first" in _failed(report)[0].message


def test_round_half_to_even_is_named_as_such_not_rounded_down():
    report = moe.grade_capacity(lambda T, E, k, f: round(T * k * f / E))
    first = _failed(report)[0]
    assert first.name.startswith("T=10 E=4") and "half to even" in first.message


def test_bincount_without_minlength_is_named_counts():
    """Silently 0.0400 instead of 0.0336 when the router collapses onto expert 0; a crash when a
    trailing expert gets no token."""
    def aux(probs, experts, coeff):
        T, E = probs.shape
        f = torch.bincount(experts.reshape(-1)).float() / experts.numel()
        return coeff * E * (f * probs.mean(dim=0)).sum()
    report = moe.grade_aux_loss(aux)
    assert report.score < report.max_score
    assert {r.rule for r in _failed(report)} == {"counts"}
    probs = torch.softmax(torch.randn(5, 3, generator=torch.Generator().manual_seed(0)), -1)
    crash = moe._aux_check(aux, 5, 3, 1, 0.1, 0, collapse=None)
    assert crash is None or crash[0] == "counts"
    collapsed = moe._aux_check(aux, 6, 4, 2, 0.1, 0, collapse=0)   # experts 0, 1 only: 2 < E
    assert collapsed[0] == "counts" and "minlength" in collapsed[1]
    del probs


def test_wrong_tokens_per_expert_are_named_tokens_not_grouping():
    def perm(experts, weights, kept, num_experts):
        T, k = experts.shape
        key = torch.where(kept, experts, torch.full_like(experts, num_experts)).t().reshape(-1)
        order = torch.sort(key, stable=True).indices
        counts = torch.bincount(key, minlength=num_experts + 1)[:num_experts]
        order = order[: int(counts.sum())]
        return order // k, weights.t().reshape(-1)[order], counts
    out = moe._perm_table_check(perm, 10, 4, 2, None, 1)
    assert out is not None and out[0] == "tokens" and "expert" in out[1]


# ---------------------------------------------------------------- exercise 14, learners' attempts

def _merge_ok(out_a, lse_a, out_b, lse_b):
    m = torch.maximum(lse_a, lse_b)
    empty = torch.isinf(m) & (m < 0)
    m_safe = torch.where(empty, torch.zeros_like(m), m)
    lse = m_safe + torch.log1p(torch.exp(-(lse_a - lse_b).abs().nan_to_num(nan=math.inf)))
    lse = torch.where(empty, m, lse)
    lse_safe = torch.where(empty, torch.zeros_like(lse), lse)
    return (torch.exp(lse_a - lse_safe)[..., None] * out_a
            + torch.exp(lse_b - lse_safe)[..., None] * out_b), lse


def test_empty_blocks_tested_as_whole_tensors_are_caught_on_single_rows():
    """Passed every named case (whole tensors empty); single rows that saw no key in either block
    were nan."""
    def merge(out_a, lse_a, out_b, lse_b):
        if torch.isinf(lse_a).all():
            return out_b, lse_b
        if torch.isinf(lse_b).all():
            return out_a, lse_a
        m = torch.maximum(lse_a, lse_b)
        lse = m + torch.log1p(torch.exp(-(lse_a - lse_b).abs()))
        return (torch.exp(lse_a - lse)[..., None] * out_a
                + torch.exp(lse_b - lse)[..., None] * out_b), lse
    report = cp.grade_merge(merge)
    (bad,) = _failed(report)
    assert bad.rule == "empty" and "row(s)" in bad.message and "got nan" in bad.message
    assert cp.grade_merge(_merge_ok).passed


def test_a_finite_stand_in_for_minus_inf_is_not_told_about_nan():
    def merge(out_a, lse_a, out_b, lse_b):
        return _merge_ok(out_a, lse_a.clamp_min(-1e30), out_b, lse_b.clamp_min(-1e30))
    report = cp.grade_merge(merge)
    for bad in _failed(report):
        assert bad.rule == "empty" and "-1e+30, finite" in bad.message
        assert "got nan" not in bad.message and "is nan" not in bad.message


def test_chunks_of_ceil_length_are_named_uneven_not_pairing():
    def zigzag(S, W, r):
        n = -(-S // (2 * W))
        chunks = [torch.arange(S)[i * n:(i + 1) * n] for i in range(2 * W)]
        return torch.cat([chunks[r], chunks[2 * W - 1 - r]])
    report = cp.grade_zigzag(zigzag)
    assert report.score < report.max_score and {r.rule for r in _failed(report)} == {"uneven"}


# ---------------------------------------------------------------- held back: memorised answers

import _solutions  # noqa: E402

from minidist_course.grading import generated  # noqa: E402

# (notebook, grading cell, the names of the functions it grades): graders of pure functions
PURE = [
    ("00_memory_and_time", "training_memory_grade", ["training_memory_bytes"]),
    ("00_memory_and_time", "flops_and_days_grade", ["training_flops", "training_days"]),
    ("02_collectives_by_composition", "busbw_factor_grade", ["busbw_factor"]),
    ("07_one_f_one_b", "one_f_one_b_grade", ["my_one_f_one_b"]),
    ("07_one_f_one_b", "zb_h1_grade", ["my_zb_h1"]),
    ("08_launch_environment", "who_am_i_grade", ["who_am_i"]),
    ("10_framework_map", "logged_loss_grade", ["logged_loss"]),
    ("10_framework_map", "clip_factor_grade", ["clip_factor"]),
    ("11_gpu_placement", "place_grade", ["place"]),
    ("13_cost", "gpus_for_deadline_grade", ["gpus_for_deadline"]),
    ("13_cost", "spot_wall_time_grade", ["spot_wall_time"]),
    ("13_cost", "young_interval_grade", ["young_interval"]),
    ("14_context_parallel", "merge_grade", ["merge"]),
    ("14_context_parallel", "zigzag_positions_grade", ["zigzag_positions"]),
    ("15_moe_dispatch", "capacity_grade", ["capacity"]),
    ("15_moe_dispatch", "aux_loss_grade", ["aux_loss"]),
]


def _memoriser(correct, seen: dict, recording: list):
    """Right on every input seen while recording (the named cases); elsewhere the answer of the
    first named case: a solution that learned the grader's printout, not the rule."""
    def fn(*args):
        key = repr(args)
        if recording[0]:
            seen[key] = args
        return correct(*(args if key in seen else next(iter(seen.values()))))
    return fn


@pytest.mark.parametrize("notebook, grade_id, names", PURE, ids=[p[1] for p in PURE])
def test_a_memorised_solution_passes_the_named_cases_and_fails_the_generated_ones(
        notebook, grade_id, names, monkeypatch):
    ns = _solutions.load(f"{notebook}.ipynb")
    seen, recording = {}, [True]
    for name in names:
        ns[name] = _memoriser(ns[name], seen.setdefault(name, {}), recording)
    with monkeypatch.context() as m:   # the named cases only: record their answers
        m.setattr(generated, "_smallest", lambda *a, **k: None)
        _, error = _solutions.grade(f"{notebook}.ipynb", grade_id, ns)
    assert error is None, "the memoriser must pass every named case"
    recording[0] = False
    text, error = _solutions.grade(f"{notebook}.ipynb", grade_id, ns)
    # (ZB-H1's engine checks call it inside rank processes, where nothing was recorded: not counted)
    failed = [line for line in text.splitlines() if line.lstrip().startswith("✗")
              and "on the engine" not in line]
    assert error is not None and failed, text
    assert all("generated inputs" in line for line in failed), text


def _cell(notebook, grade_id):
    return next(src for meta, src in _solutions._cells(f"{notebook}.ipynb")
                if meta.get("grade_id") == grade_id)


@pytest.mark.exhaustive   # ring launches: 20 named checks, then the generated sizes
@pytest.mark.timeout(300)
def test_a_fixed_size_receive_buffer_passes_the_named_sizes_and_fails_generated_ones():
    """A receive buffer of 1024 elements: every named size fits (1001 at most), larger chunks
    cannot be received."""
    src = _cell("03_ring_allreduce", "ring_reduce_scatter").replace(
        "incoming = torch.empty_like(chunks[recv_idx])",
        "incoming = torch.empty(1024, dtype=chunks[recv_idx].dtype)[:chunks[recv_idx].numel()]")
    ns = _solutions.load("03_ring_allreduce.ipynb", {"ring_reduce_scatter": src})
    text, error = _solutions.grade("03_ring_allreduce.ipynb", "ring_reduce_scatter_grade", ns)
    failed = [line for line in text.splitlines() if line.lstrip().startswith("✗")]
    assert error is not None and failed and all("generated sizes" in f for f in failed), text


# ------------------------------------------------- a learner's trial: messages that blamed wrongly

from minidist_course.grading import checkpoints as ck  # noqa: E402


def test_pick_mistakes_of_fallback_are_named_fallback_not_newest():
    def one_back(listing, generation=None, fallback=False):   # falls back exactly one generation
        done = sorted(n for n, s in listing if s != "unfinished")
        if generation is not None:
            if generation not in done:
                raise FileNotFoundError
            return generation
        if not done:
            raise FileNotFoundError
        if fallback and dict(listing)[done[-1]] == "corrupt":
            if len(done) < 2 or dict(listing)[done[-2]] == "corrupt":
                raise ValueError
            return done[-2]
        return done[-1]
    out = ck._pick_check(one_back, ([(0, "verified"), (1, "corrupt"), (2, "corrupt")], None, True))
    assert out[0] == "fallback" and "newest complete one that verifies" in out[1]


def test_retire_messages_for_keep_not_filled_and_off_by_one():
    def removes_bad(listing, new, keep):
        return sorted(n for n, s in listing if s != "verified")
    out = ck._retire_check(removes_bad, ([(0, "corrupt"), (20, "verified")], 20, 2))
    assert out[0] == "older" and "nothing is removed yet" in out[1]

    def new_not_counted(listing, new, keep):
        status, good, out = dict(listing), 0, []
        for n in sorted(status, reverse=True):
            if n == new:
                continue
            if good >= keep:
                out.append(n)
            elif status[n] == "verified":
                good += 1
        return sorted(out)
    out = ck._retire_check(new_not_counted, ([(1, "verified"), (2, "verified"), (3, "verified")], 3, 1))
    assert out[0] == "good" and "counts as the first" in out[1]


def test_a_float32_merge_of_float64_inputs_is_named_by_its_dtype():
    report = cp.grade_merge(lambda oa, la, ob, lb: _merge_ok(oa.float(), la.float(), ob.float(),
                                                                 lb.float()))
    failed = _failed(report)
    assert failed and all(r.rule == "shape" for r in failed), report
    assert "inputs' dtype (torch.float64)" in failed[0].message


def test_capacity_slips_named_once_and_top_k_where_floor_also_fits():
    # int(ceil(T·k/E)·factor) is wrong exactly where it equals the floor: "rounded down" is right
    floor_like = moe._capacity_check(lambda T, E, k, f: int(math.ceil(T * k / E) * f), (10, 4, 2, 1.25))
    assert floor_like[0] == "ceil" and "rounded down" in floor_like[1]
    no_k = moe._capacity_check(lambda T, E, k, f: math.ceil(Fraction(T) * Fraction(str(f)) / E),
                               (3, 2, 2, 0.34))
    assert no_k[0] == "top_k"


# ------------------------------------- held back, on ranks: right on the named sizes only

def _shift_memo(correct):
    def shift_right(x, rank, world_size):
        if x.numel() in (1, 1000, 1 << 20):
            return correct(x, rank, world_size)
        return x.clone()                       # elsewhere: no shift at all
    return shift_right


def _token_memo(correct):
    def token_ring(rank, world_size, laps):
        return correct(rank, world_size, laps if laps in (1, 3) else 1)
    return token_ring


def _eval_memo(correct):
    def evaluate_exact(model, x, y, rank, world_size):
        if x.shape[0] in (10, 3):
            return correct(model, x, y, rank, world_size)
        from minidist_course.grading.sampling import eval_data
        return correct(model, *eval_data(10), rank, world_size)   # the named case's answer
    return evaluate_exact


def _norm_memo(correct):
    def global_grad_norm(model):
        if model.cfg.vocab_size == 37 and model.cfg.n_embd == 16:
            return correct(model)
        return float(sum(p.grad.pow(2).sum() for p in model.parameters()
                         if p.grad is not None) ** 0.5)        # this rank's shards only
    return global_grad_norm


def _zigzag_memo(correct):
    def zigzag_positions(seq_len, world, rank):
        p = correct(seq_len, world, rank)
        if seq_len in (6, 12, 13, 16):
            return p
        return torch.cat([p[:1], p[:-1]]) if p.numel() else p   # a position twice, one missing
    return zigzag_positions


def _copy_memo(correct):
    def copy_to_region(x):
        return correct(x) if tuple(x.shape) in ((3,), (4,)) else x * 1   # elsewhere no f at all
    return copy_to_region


def _ddp_memo(correct):
    class MyDDP(correct):
        def __init__(self, module, bucket_cap_mb=25.0):
            super().__init__(module, bucket_cap_mb)
            self.named = bucket_cap_mb in (0.0005, 25.0, 1e-9)   # the named checks' caps

        def sync_gradients(self):
            super().sync_gradients()
            if not self.named:                    # elsewhere the average is a sum
                for p in self.params:
                    p.grad.mul_(self.world_size)
    return MyDDP


def _zero_memo(correct):
    class MyZeRO1(correct):
        def step(self):
            if self.numel != 427:                 # elsewhere: gradients not averaged
                for p in self.params:
                    if p.grad is not None:
                        p.grad.mul_(self.world)
            super().step()
    return MyZeRO1


def _column_memo(correct):
    class ColumnParallelLinear(correct):
        def forward(self, x):
            y = super().forward(x)
            return y if self.weight.shape[1] == 6 else y * 1.5   # the named width only
    return ColumnParallelLinear


RANK_MEMOS = [("01_token_ring", "shift_right_grade", "shift_right", _shift_memo),
              ("06_tensor_parallel", "column_row_grade", "ColumnParallelLinear", _column_memo),
              ("06_tensor_parallel", "f_and_g_grade", "copy_to_region", _copy_memo),
              ("04_bucketed_ddp", "my_ddp_grade", "MyDDP", _ddp_memo),
              ("09_zero", "zero1_grade", "MyZeRO1", _zero_memo),
              ("01_token_ring", "token_ring_grade", "token_ring", _token_memo),
              ("05_sampler_and_evaluation", "evaluate_exact_grade", "evaluate_exact", _eval_memo),
              ("12_global_grad_norm", "global_grad_norm_grade", "global_grad_norm", _norm_memo),
              ("14_context_parallel", "ring_grade", "zigzag_positions", _zigzag_memo)]


@pytest.mark.exhaustive   # launches: the named checks, then the generated ones
@pytest.mark.timeout(300)
@pytest.mark.parametrize("notebook, grade_id, name, memo", RANK_MEMOS, ids=[m[1] for m in RANK_MEMOS])
def test_a_solution_right_only_on_the_named_sizes_fails_the_generated_ranks_check(
        notebook, grade_id, name, memo):
    ns = _solutions.load(f"{notebook}.ipynb")
    ns[name] = memo(ns[name])
    text, error = _solutions.grade(f"{notebook}.ipynb", grade_id, ns)
    failed = [line for line in text.splitlines() if line.lstrip().startswith("✗")]
    assert error is not None and failed, text
    assert all("generated" in line for line in failed), text
