"""The divergence bisector (:mod:`minidist_course.references.bisect`): silent on correct configurations, and for
each bug of the zoo (:mod:`minidist_course.zoo`) it names the first tensor off, its rank and the
pattern."""

import functools

import pytest
import torch

from minidist.grid import ProcessGrid
from minidist.hybrid import HybridGPT, wrap_stages
from minidist_course.references.bisect import bisect, budget
from minidist_course.references.diagnose import diagnose
from minidist.models.gpt import GPTConfig
from minidist_course import zoo

CFG = dict(vocab_size=37, block_size=8, n_layer=4, n_head=4, n_embd=16)


def _build(rank, world, dp=2, pp=2, tp=1, cp=1, sp=False, tie=False, dp_mode="flat", ep=1,
           dropout=0.0):
    moe = dict(num_experts=4, top_k=2, aux_loss_coeff=1e-2) if ep > 1 else None
    model = HybridGPT(GPTConfig(**CFG, tie_embeddings=tie, dropout=dropout),
                      ProcessGrid(dp, pp, tp, cp=cp, ep=ep),
                      sequence_parallel=sp, moe=moe)
    return model, wrap_stages(model, dp_mode)


def _batch(ignore=0.0, n=8):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, CFG["vocab_size"], (n, CFG["block_size"]), generator=g)
    targets = ids.roll(-1, 1)
    if ignore:   # more ignored targets in the first samples: replicas count different tokens
        rate = torch.linspace(2 * ignore, 0, n)[:, None]
        targets[torch.rand(targets.shape, generator=g) < rate] = -100
    return ids, targets


def _run(bug=None, world=4, steps=2, ignore=0.0, loss="mean", microbatches=2, **grid):
    ids, targets = _batch(ignore)
    return bisect(functools.partial(_build, **grid), world, ids, targets, microbatches=microbatches,
                  steps=steps, context=functools.partial(zoo.inject, bug) if bug else None,
                  loss_reduction=loss, timeout=120)


def test_a_correct_configuration_reports_nothing_beyond_budget():
    report = _run(tp=2, pp=2, dp=1, sp=True, tie=True, loss="per_token", ignore=0.3)
    assert report.first is None, report.format()
    assert report.checked >= 2 * (6 + 6 + 10)            # forward, backward, gradients, 2 steps
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in report.losses)


def test_dp_sum_not_average_is_a_scale_of_dp_at_the_first_gradient():
    report = _run("dp-sum-not-average")
    first = report.first
    assert (first.step, first.phase, first.name) == (0, "gradients", "head.weight"), report.format()
    assert "≈ dp" in first.diagnosis and "a sum where an average belongs" in first.diagnosis
    assert first.ranks == [0, 1, 2, 3] or set(first.ranks) >= {1, 3}   # the last stage's ranks


def test_tied_embedding_not_summed_is_named_on_the_last_stage():
    report = _run("tied-embedding-not-summed", tie=True)
    first = report.first
    assert (first.step, first.phase, first.name) == (0, "gradients", "head.weight"), report.format()
    # grid order (dp, pp, tp): pp rank 1 holds the head; with dp=2 those are ranks 1 and 3
    assert first.ranks == [1, 3], report.format()
    assert "tied embedding's two copies" in first.diagnosis


@pytest.mark.integration
@pytest.mark.parametrize("bug, grid, where", [
    ("dp-divide-twice", {}, ("gradients", "head.weight", "1/dp")),
    ("sp-grads-not-summed", dict(dp=1, tp=2, sp=True), ("gradients", "ln_f.bias", "partial")),
    ("cp-contiguous-positions", dict(dp=1, cp=2), ("forward", "embed", "rows differ")),
    ("per-token-local-count", dict(ignore=0.3, loss="per_token"),
     ("gradients", "head.weight", "error enters after the local backward")),
    ("ring-diagonal-unmasked", dict(dp=1, cp=2), ("forward", "blocks.0", "")),
    ("microbatch-mean-of-means", dict(microbatches=3), ("backward", "blocks.3", "own factor")),
    ("experts-averaged-over-dp", dict(ep=2),
     ("gradients", "blocks.3.mlp.experts.3.fc2.bias", "in a gradient reduction")),
])
def test_each_zoo_bug_is_found_where_it_lives(bug, grid, where):
    report = _run(bug, **grid)
    first = report.first
    assert first is not None and (first.step, first.phase, first.name) == (0,) + where[:2], \
        report.format()
    assert where[2] in first.diagnosis, report.format()


def test_diagnoses_name_the_pattern():
    ref = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    sizes = dict(dp=2, cp=1, tp=4, pp=1)
    assert "≈ tp" in diagnose(ref * 4, ref, sizes, 1e-6, [0], [0])
    assert "1/dp" in diagnose(ref / 2, ref, sizes, 1e-6, [0], [0])
    assert diagnose(-ref, ref, sizes, 1e-6, [0], [0]) == "sign flipped"
    assert diagnose(ref.flip(0), ref, sizes, 1e-6, [0], [0]).startswith("permuted")
    off = ref.clone()
    off[2] += 1.0
    ignored = torch.zeros(6, dtype=torch.bool)
    ignored[2] = True
    assert "ignored" in diagnose(off, ref, sizes, 1e-6, [0], [0], ignored)
    assert "only rank(s) 3" in diagnose(off, ref, sizes, 1e-6, [3], [1, 3])
    assert diagnose(ref * (1 + 3e-6), ref, sizes, 1e-6, [0], [0]).startswith("near the budget")
    weights = torch.tensor([1.0, 1.0, 2.0, 2.0, 0.5, 0.5])[:, None]
    assert "own factor (0.5 to 2)" in diagnose(ref * weights, ref, sizes, 1e-6, [0], [0])
    assert budget(8, 4) < 1e-4 and budget(8, 4, torch.bfloat16) == 8 * 2.0 ** -8


def test_dropout_is_refused_by_name_before_training():
    with pytest.raises(ValueError, match=r"bisect: dropout=0.1 draws other masks than one process"):
        _run(dp=1, dropout=0.1, steps=1, world=2)


def test_experts_under_autocast_are_refused_by_name_before_training():
    ids, targets = _batch()
    with pytest.raises(ValueError, match=r"experts under autocast_dtype=torch.bfloat16 have no "
                                         r"rounding budget.*in fp32"):
        bisect(functools.partial(_build, ep=2), 4, ids, targets, microbatches=2, steps=1,
               autocast_dtype=torch.bfloat16, timeout=120)


def test_an_unknown_bug_is_named():
    with pytest.raises(ValueError, match=r"unknown bug 'nope'; known: \['cp-contiguous"):
        with zoo.inject("nope"):
            pass
    assert not any(zoo.on(b) for b in zoo.BUGS)         # never on by default
