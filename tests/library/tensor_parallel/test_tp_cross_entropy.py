"""Vocab-parallel cross-entropy against F.cross_entropy on the unpadded logits
(padding columns must not count in the softmax)."""

import pytest
import torch
import torch.nn.functional as F

import minidist
from minidist.tensor_parallel import pad_to_multiple, regions as R
from minidist_course.references.tensor_parallel import rel_error
from minidist.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from minidist.tensor_parallel.sharding import gather_tensor

V = 10


def _logits_and_targets(padded):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, padded, generator=g) * 3
    logits[0, 1, 4] = 1e4                       # one huge logit: exp() overflows without the max
    logits[1, 2, 9] = -1e4
    logits[..., V:] = 1e4                       # garbage in the padding columns must not count
    target = torch.randint(0, V, (2, 5), generator=g)
    target[0, 0], target[1, 4], target[0, 1] = 0, V - 1, 4   # both ends of the vocabulary
    return logits, target


def _ce_case(rank, world, eps, reduction):
    padded = pad_to_multiple(V, world)
    logits, target = _logits_and_targets(padded)
    ref_in = logits[..., :V].clone().requires_grad_()
    ref = F.cross_entropy(ref_in.reshape(-1, V), target.reshape(-1), label_smoothing=eps,
                          reduction=reduction)
    ref = ref.reshape(target.shape) if reduction == "none" else ref
    ref.backward(torch.ones_like(ref))
    mine = R.split_along(logits, -1).requires_grad_()
    loss = vocab_parallel_cross_entropy(mine, target, V, label_smoothing=eps, reduction=reduction)
    loss.backward(torch.ones_like(loss))
    grad = gather_tensor(mine.grad, 2, None)
    return {"loss": loss.detach(), "loss_err": rel_error(loss, ref),
            "grad_err": rel_error(grad[..., :V], ref_in.grad),
            "pad_grad": grad[..., V:].abs().max().item() if padded > V else 0.0,
            "finite": bool(torch.isfinite(loss).all() and torch.isfinite(grad).all())}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_vocab_parallel_cross_entropy_equals_f_cross_entropy(world, eps, reduction):
    res = minidist.run(_ce_case, world, eps, reduction, timeout=60)
    for r in res:
        assert r["finite"], "no inf/NaN: the global max must be subtracted"
        assert r["loss_err"] < 1e-5 and r["grad_err"] < 1e-5, r
        assert r["pad_grad"] == 0.0, "padded vocabulary columns must get zero gradient"
        assert torch.equal(r["loss"], res[0]["loss"]), "every rank must hold the same loss"


def _padded_shape_case(rank, world):
    return vocab_parallel_cross_entropy(torch.zeros(3, 3), torch.tensor([0, 9, 10]), V)


def test_target_out_of_range_is_a_clear_error():
    with pytest.raises(minidist.RankError, match=r"rank 0\): targets must be in \[0, 10\).*max 10"):
        minidist.run(_padded_shape_case, 4, timeout=60)


def test_without_the_max_exp_overflows():
    """Why step 1 exists: the naive softmax of a 1e4 logit is inf/NaN in fp32."""
    logits, _ = _logits_and_targets(V)
    naive = logits.exp() / logits.exp().sum(-1, keepdim=True)
    assert not torch.isfinite(naive).all()


# ---------------------------------------------------------------- ignore_index (padding, prompts)
def _ignore_case(rank, world):
    """Every (ignore_index, ε, reduction) against F.cross_entropy on the full logits, one launch."""
    padded = pad_to_multiple(V, world)
    logits, target = _logits_and_targets(padded)
    out = {}
    for ignore in (-100, 3):                  # the default, and a real class id that is ignored
        tgt = target.clone()
        tgt[0, 2], tgt[1, 0], tgt[1, 3] = ignore, ignore, ignore
        tgt[0, 1] = ignore                    # the token with the 1e4 logit is ignored too
        for eps in (0.0, 0.1):
            for reduction in ("none", "sum", "mean"):
                ref_in = logits[..., :V].clone().requires_grad_()
                ref = F.cross_entropy(ref_in.reshape(-1, V), tgt.reshape(-1), ignore_index=ignore,
                                      label_smoothing=eps, reduction=reduction)
                ref = ref.reshape(tgt.shape) if reduction == "none" else ref
                ref.backward(torch.ones_like(ref))
                mine = R.split_along(logits, -1).clone().requires_grad_()  # W=1: a view
                loss = vocab_parallel_cross_entropy(mine, tgt, V, label_smoothing=eps,
                                                    reduction=reduction, ignore_index=ignore)
                loss.backward(torch.ones_like(loss))
                grad = gather_tensor(mine.grad, 2, None)
                ignored = (tgt == ignore).unsqueeze(-1)
                out[(ignore, eps, reduction)] = {
                    "loss_err": rel_error(loss, ref), "grad_err": rel_error(grad[..., :V], ref_in.grad),
                    "ignored_grad": grad.masked_select(ignored).abs().max().item(),
                    "pad_grad": grad[..., V:].abs().max().item() if padded > V else 0.0,
                    "loss": loss.detach()}
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ignore_index_equals_f_cross_entropy(world):
    """Loss and gradient equal F.cross_entropy(..., ignore_index=...) within rel_error 1e-5 (fp32:
    only the order of additions differs) for V=10 split over W=1..4 (W=3, 4: V not divisible)."""
    res = minidist.run(_ignore_case, world, timeout=90)
    assert len(res[0]) == 12
    for r in res:
        for key, e in r.items():
            assert e["loss_err"] < 1e-5 and e["grad_err"] < 1e-5, (key, e)
            assert e["ignored_grad"] == 0.0, (key, "ignored tokens must get zero gradient")
            assert e["pad_grad"] == 0.0, key
            assert torch.equal(e["loss"], res[0][key]["loss"]), "every rank must hold the same loss"


def _no_token_case(rank, world, empty):
    """All tokens ignored (or none at all): as F.cross_entropy, mean is NaN, sum 0, grads 0."""
    padded = pad_to_multiple(V, world)
    logits = torch.randn(0 if empty else 3, padded, generator=torch.Generator().manual_seed(1))
    tgt = torch.full((logits.shape[0],), -100, dtype=torch.long)
    out = {}
    for eps in (0.0, 0.1):
        for reduction in ("none", "sum", "mean"):
            ref_in = logits[:, :V].clone().requires_grad_()
            ref = F.cross_entropy(ref_in, tgt, label_smoothing=eps, reduction=reduction)
            ref.backward(torch.ones_like(ref))
            mine = R.split_along(logits, -1).clone().requires_grad_()  # W=1: a view
            loss = vocab_parallel_cross_entropy(mine, tgt, V, label_smoothing=eps, reduction=reduction)
            loss.backward(torch.ones_like(loss))
            out[(eps, reduction)] = (loss.detach(), ref.detach(), mine.grad.clone(),
                                     ref_in.grad.clone())
    return out


@pytest.mark.parametrize("world,empty", [(1, False), (3, False), (2, True), (4, True)])
def test_all_ignored_and_empty_input_match_torch(world, empty):
    for r in minidist.run(_no_token_case, world, empty, timeout=60):
        for key, (loss, ref, grad, ref_grad) in r.items():
            assert loss.shape == ref.shape, key
            assert torch.equal(loss, ref) or (ref.isnan().all() and loss.isnan().all()), (key, loss, ref)
            assert not grad.any() and not ref_grad.any(), (key, "no token: gradient must be 0")
        assert r[(0.0, "mean")][0].isnan(), "a mean over no token is NaN, as torch"
        assert r[(0.0, "sum")][0] == 0.0


def _negative_target_case(rank, world):
    tgt = torch.tensor([0, -100, -5])         # -100 is ignored; -5 is not the ignore_index
    return vocab_parallel_cross_entropy(torch.zeros(3, 5), tgt, V)


def test_target_out_of_range_other_than_ignore_index_is_a_clear_error():
    with pytest.raises(minidist.RankError,
                       match=r"rank 1\): targets must be in \[0, 10\) or ignore_index=-100, "
                             r"got 1 outside \(min -5, max -5\)"):
        minidist.run(_negative_target_case, 2, timeout=60)
