"""Sequence parallelism gives the same results as plain TP (with dropout on), with activations of
the LayerNorm/dropout regions sharded along the sequence."""

import pytest
import torch

import minidist
from minidist.models.gpt import GPTConfig
from minidist.tensor_parallel.gpt import TPGPT
from minidist_course.references.tensor_parallel import rel_error
from minidist.tensor_parallel.random import model_parallel_seed

CFG = GPTConfig(vocab_size=50, block_size=8, n_layer=2, n_head=4, n_embd=16, dropout=0.1,
                attn_dropout=0.1)


def _step(model, ids, targets, finish):
    model_parallel_seed(7)
    shapes = []
    hook = model.blocks[0].ln1.register_forward_hook(lambda m, i, o: shapes.append(tuple(o.shape)))
    loss = model(ids, targets)[1]
    loss.backward()
    hook.remove()
    if finish:
        model.finish_grads()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, shapes[0]


def _sp_case(rank, world, finish):
    torch.manual_seed(0)
    tp = TPGPT(CFG)
    torch.manual_seed(0)
    sp = TPGPT(CFG, sequence_parallel=True)
    g = torch.Generator().manual_seed(5)
    ids, targets = torch.randint(0, 50, (2, 8), generator=g), torch.randint(0, 50, (2, 8), generator=g)
    loss_t, grads_t, shape_t = _step(tp, ids, targets, True)
    loss_s, grads_s, shape_s = _step(sp, ids, targets, finish)
    errs = {n: rel_error(grads_s[n], grads_t[n]) for n in grads_t}
    return {"loss": rel_error(loss_s, loss_t), "grads": max(errs.values()),
            "ln_grads": max(v for n, v in errs.items() if ".ln" in n or "ln_f" in n),
            "shape_tp": shape_t, "shape_sp": shape_s}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_sequence_parallel_equals_plain_tp(world):
    for r in minidist.run(_sp_case, world, True, timeout=60):
        assert r["loss"] < 1e-6 and r["grads"] < 1e-6, r
        assert r["shape_tp"] == (2, 8, 16) and r["shape_sp"] == (2, 8 // world, 16)


def test_forgetting_the_sequence_parallel_grad_all_reduce_is_caught():
    for r in minidist.run(_sp_case, 2, False, timeout=60):
        assert r["ln_grads"] > 1e-2, r


def _bad_len_case(rank, world):
    TPGPT(GPTConfig(vocab_size=50, block_size=8, n_head=4, n_embd=16), sequence_parallel=True)(
        torch.zeros(1, 6, dtype=torch.long))


def test_sequence_not_divisible_is_a_clear_error():
    with pytest.raises(minidist.RankError, match=r"rank 0\): sequence parallelism needs the "
                                                 r"sequence length \(6\) divisible by the "
                                                 r"tensor-parallel size 4"):
        minidist.run(_bad_len_case, 4, timeout=60)


def _size_checks(rank, world):
    """How many always-on size agreements each region's forward and backward run."""
    import minidist.collectives as C
    from minidist.comm.ops import CollectiveMismatchError
    from minidist.tensor_parallel import regions as R
    from minidist.comm import agreed
    calls = []
    real = C.check_sizes_agree
    # a call site's first call agrees apart (agreed.py); later ones carry it beside the data
    C.check_sizes_agree = agreed.check_sizes_agree = \
        lambda opname, *a, **k: (calls.append(opname), real(opname, *a, **k))[1]
    out = {}
    try:
        for name, fn, shape in (
                ("gather_from_sequence_parallel_region", R.gather_from_sequence_parallel_region, (2, 3, 4)),
                ("reduce_scatter_to_sequence_parallel_region",
                 R.reduce_scatter_to_sequence_parallel_region, (2, 2 * world, 4)),
                ("scatter_to_sequence_parallel_region", R.scatter_to_sequence_parallel_region,
                 (2, 2 * world, 4))):
            x = torch.randn(shape, requires_grad=True)
            calls.clear()
            y = fn(x)
            forward = list(calls)
            calls.clear()
            y.backward(torch.ones_like(y))
            out[name] = (forward, list(calls))
        # a rank whose shard has another length is still refused in the forward, on every rank
        try:
            R.gather_from_sequence_parallel_region(torch.randn(2, 3 + rank, 4))
            out["mismatch"] = None
        except CollectiveMismatchError as e:
            out["mismatch"] = str(e)
    finally:
        C.check_sizes_agree = agreed.check_sizes_agree = real
    return out


def test_a_backward_skips_the_size_check_only_after_a_checked_forward():
    """The backward's gradient has the forward output's shape, so after an all-gather or a
    reduce-scatter its pieces have the sizes the forward agreed on: the backward skips the
    agreement (one small all-reduce less per region). After a split (no collective, no check)
    the backward's all-gather still checks."""
    for out in minidist.run(_size_checks, 2, timeout=60):
        assert out["gather_from_sequence_parallel_region"] == (["all_gather"], [])
        assert out["reduce_scatter_to_sequence_parallel_region"] == (["reduce_scatter"], [])
        assert out["scatter_to_sequence_parallel_region"] == ([], ["all_gather"])
        assert "ranks disagree on the sizes" in out["mismatch"], out["mismatch"]
