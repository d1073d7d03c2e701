"""The 3-D section of ``minidist demo`` (``minidist_course.lessons.hybrid_demo``) and exercise 12's grader.

* the demo's rows: the tiny GPT on (dp, tp, pp) = (2, 2, 2) equals one process (loss per counted
  token, global norm, gathered clipped gradients, replicas and tied copies bitwise), through the
  console command, so the ``_SECTIONS`` entry is tested too;
* the checker can fail: the two combination bugs of chapter 12 it is there to catch (the loss
  weighted by samples instead of counted tokens, the tied embedding's gradient sum left out) give
  errors far above its tolerance;
* the grader of exercise 12 rejects the usual wrong norms and says which rule was broken, and
  accepts the library's ``global_grad_norm``.
"""

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import minidist
from minidist_course.grading.hybrid import grade_global_grad_norm
from minidist.hybrid import global_grad_norm
from minidist_course.lessons import hybrid_demo as H


@pytest.mark.timeout(300)
def test_demo_hybrid_section_passes_through_the_cli():
    res = subprocess.run([sys.executable, "-m", "minidist_course.cli", "demo", "--sections", "hybrid"],
                         capture_output=True, text=True, timeout=280)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("(2,2,2) ")]
    assert len(lines) == 4 and all("W=8" in ln and "✓" in ln for ln in lines), res.stdout
    assert "4 of 4 checks correct" in res.stdout


@pytest.mark.timeout(200)
def test_checker_sees_a_loss_weighted_by_samples_and_a_missing_tied_sum():
    ref = H.reference()
    right = H.compare(minidist.run(H.step_on_grid, 4, 2, 1, 2, timeout=150), ref)
    assert right["loss"] <= H.TOL and right["grads"] <= H.TOL and right["tied"] == 0.0
    assert right["missing"] == [] and right["replicas"] == 0.0
    # "mean": each micro-batch's token mean weighted by its share of the samples; far from one
    # process with ignored targets, so train_step refuses it on every rank, naming the shards
    by_samples = H.weighted_by_samples()
    assert by_samples["loss"] > 1000 * H.TOL and by_samples["grads"] > 1000 * H.TOL
    with pytest.raises(minidist.RankError, match=r"loss_reduction='mean' with ignored targets "
                                                 r"\(-100\) over 4 shards \(dp=2, microbatches=2\)"):
        minidist.run(H.step_on_grid, 4, 2, 1, 2, "mean", timeout=150)
    untied = H.compare(minidist.run(H.step_on_grid, 4, 2, 1, 2, "per_token", 2, H.MAX_NORM, H.CFG,
                                    H.BATCH, 0.3, False, timeout=150), ref)
    assert untied["tied"] > 1e-4 and untied["grads"] > 1000 * H.TOL
    assert untied["loss"] <= H.TOL, "the loss does not see the tied sum; the gradients do"


def test_batch_ignores_more_positions_in_the_first_samples():
    _, targets = H.batch()
    ignored = (targets == -100).float().mean(dim=1)
    assert ignored[: H.BATCH // 2].mean() > 2 * ignored[H.BATCH // 2:].mean()
    assert 0.15 < (targets == -100).float().mean() < 0.4


def _norm(skip_replicated=True, skip_tied=True, over_dp=False):
    def fn(model):
        g = model.grid
        total = torch.zeros(1, dtype=torch.float64)
        for p in model.parameters():
            if p.grad is None or (skip_tied and model.is_tied_copy(p)):
                continue
            if skip_replicated and not getattr(p, "tensor_model_parallel", False) and g.tp_rank:
                continue
            total += p.grad.double().pow(2).sum()
        for group in (g.tp_group, g.pp_group) + ((g.dp_group,) if over_dp else ()):
            dist.all_reduce(total, group=group)
        return float(total.sqrt())
    return fn


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kw,grid,needle", [
    (dict(skip_replicated=False), (1, 2, 1), "counted on every TP rank"),
    (dict(skip_tied=False), (1, 1, 2), "copy of the tied embedding is counted"),
    (dict(over_dp=True), (2, 1, 2), "summed over the DP replicas"),
])
def test_grader_names_the_rule_a_wrong_norm_breaks(kw, grid, needle):
    rep = grade_global_grad_norm(_norm(**kw), grids=[(1, 1, 1), grid])
    text = str(rep)
    assert not rep.passed and needle in text, text
    assert rep.results[0].passed, "on one process every version is right"


@pytest.mark.timeout(300)
def test_grader_accepts_the_library_norm_and_rejects_missing_reductions():
    assert grade_global_grad_norm(global_grad_norm, grids=[(2, 2, 2)]).passed

    def no_tp_sum(model):
        t = torch.tensor([sum(p.grad.double().pow(2).sum().item() for p in model.parameters()
                              if p.grad is not None and not model.is_tied_copy(p))])
        dist.all_reduce(t, group=model.grid.pp_group)
        return float(t.sqrt())
    rep = grade_global_grad_norm(no_tp_sum, grids=[(1, 2, 2)])
    assert not rep.passed and "TP ranks of one stage disagree" in str(rep), str(rep)


@pytest.mark.timeout(300)
def test_exercise_grading_cell_rejects_a_norm_that_counts_replicated_parameters_everywhere():
    """The notebook's own grading cell (solutions/12_global_grad_norm.ipynb) with a plausible wrong
    solution injected: the report names the rule and the cell fails."""
    import _solutions
    ns = _solutions.load("12_global_grad_norm.ipynb", {"global_grad_norm": '''
def global_grad_norm(model):
    total = torch.zeros(1, dtype=torch.float64)
    for p in model.parameters():
        if p.grad is not None and not model.is_tied_copy(p):
            total += p.grad.double().pow(2).sum()     # replicated ones on every TP rank
    dist.all_reduce(total, group=model.grid.tp_group)
    dist.all_reduce(total, group=model.grid.pp_group)
    return float(total.sqrt())
'''})
    text, error = _solutions.grade("12_global_grad_norm.ipynb", "global_grad_norm_grade", ns)
    assert error is not None, text
    assert "counted on every TP rank" in text and "✓ (dp,tp,pp)=(1,1,2)" in text, text
    assert "score: 2.5/5" in text, text


@pytest.mark.timeout(300)
def test_grader_names_every_rule_a_whole_world_sum_breaks():
    """Every local gradient summed over the whole world: replicated parameters on every TP rank,
    the tied copy, and the DP replicas at once — sqrt(dp·(a + tp·b + c)), √2 above the tied/TP slip
    alone on dp = 2. The grader must name all three rules, not only print the two numbers."""
    def world_sum(model):
        total = torch.zeros(1, dtype=torch.float64)
        for p in model.parameters():
            if p.grad is not None:
                total += p.grad.double().pow(2).sum()
        dist.all_reduce(total)
        return float(total.sqrt())
    text = str(grade_global_grad_norm(world_sum, grids=[(2, 2, 2)]))
    assert "3 rules broken" in text, text
    for needle in ("counted on every TP rank", "copy of the tied embedding is counted",
                   "summed over the DP replicas"):
        assert needle in text, text


@pytest.mark.timeout(200)
def test_grader_reports_a_collective_called_on_one_stage_only_as_such_within_its_timeout():
    import time

    def first_stage_only(model):
        t = torch.ones(1, dtype=torch.float64)
        if model.grid.pp_rank == 0:                    # the other stage never joins
            dist.all_reduce(t, group=model.grid.pp_group)
        return float(t)
    t0 = time.monotonic()
    rep = grade_global_grad_norm(first_stage_only, grids=[(1, 1, 2), (1, 2, 2)], timeout=10)
    text = str(rep)
    assert time.monotonic() - t0 < 10 + 60, "one timeout, then the later grid is not run"
    assert "a collective that only some ranks of a group called" in text, text
    assert "if pp_rank == 0" in text and "not run:" in text, text
    assert not rep.passed
