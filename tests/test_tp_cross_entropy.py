"""Vocab-parallel cross-entropy against F.cross_entropy on the unpadded logits
(padding columns must not count in the softmax)."""

import pytest
import torch
import torch.nn.functional as F

import minidist
from minidist.tensor_parallel import pad_to_multiple, regions as R
from minidist.lessons.tp_checks import rel_error
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
