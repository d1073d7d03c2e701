"""Activation recomputation (minidist.sharding.checkpoint) gives the gradients of the run without
it — bit for bit, dropout included (the RNG state is replayed) — like torch.utils.checkpoint in
its
reentrant and non-reentrant forms, and it works under bucketed DDP's and ZeRO-3's hooks."""

import pytest
import torch
import torch._dynamo  # noqa: F401
from torch import nn

import minidist
from minidist.sharding import checkpoint, fsdp, fsdp_state
from minidist.sharding.recompute import Checkpointed
from minidist_course.references.sharding import (Block, global_batch, local_batch, loss_fn,
    make_model, max_abs_diff, named_state)

IMPLS = ["off", "minidist", "torch-reentrant", "torch-non-reentrant"]


def _model(impl):
    model = make_model(dropout=0.3)
    model.blocks = nn.ModuleList(Checkpointed(b, enabled=impl != "off",
                                              impl="minidist" if impl == "off" else impl)
                                 for b in model.blocks)
    return model


def _grads(impl):
    model = _model(impl)
    x, y = global_batch(0)
    torch.manual_seed(7)
    loss_fn(model(x), y).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_gradients_equal_without_recomputation_and_torch_checkpoint_both_forms():
    ref = _grads("off")
    for impl in IMPLS[1:]:
        assert max_abs_diff(_grads(impl), ref) == 0.0, impl
    # dropout is on: a different RNG state gives different gradients, so the check can fail
    model = _model("off")
    x, y = global_batch(0)
    torch.manual_seed(8)
    loss_fn(model(x), y).backward()
    other = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert max_abs_diff(other, ref) > 1e-4


def test_recomputation_replays_the_forwards_autocast():
    """Regression (mixed precision x recomputation): the recomputation runs in backward, outside
    the forward's ``torch.autocast``; without entering it again it recomputed in fp32 and the
    backward failed ("expected m1 and m2 to have the same dtype"). Bitwise the gradients of the
    same forward under bf16 autocast without recomputation, as torch's checkpoint gives (the
    forward's own dtype, not autocast's default: fairscale#1199; pytorch#71124 for torch's)."""
    def grads(impl):
        model = _model(impl)
        x, y = global_batch(0)
        torch.manual_seed(7)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        loss_fn(out.float(), y).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    ref = grads("off")
    assert {g.dtype for g in ref.values()} == {torch.float32}   # parameters stay fp32
    for impl in ("minidist", "torch-non-reentrant"):
        assert max_abs_diff(grads(impl), ref) == 0.0, impl
    assert max_abs_diff(_grads("off"), ref) > 1e-5   # bf16 does change the gradients


class _Scaled(nn.Module):
    """A block with a keyword argument and dropout: ``forward(x, *, scale)``."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(6, 8), nn.Linear(8, 6), nn.Dropout(0.3)

    def forward(self, x, *, scale):
        return self.fc2(self.drop(torch.tanh(self.fc1(x)))) * scale


def _split_backward_grads(impl, twice=False):
    """Gradients of a zero-bubble pipeline stage's split backward (B, then the weight pass W) or
    of two ``retain_graph`` backwards through a Checkpointed block with a keyword argument."""
    from minidist.pipeline_parallel.split_backward import backward_input, backward_weight
    torch.manual_seed(0)
    block = Checkpointed(_Scaled(), enabled=impl != "off",
                         impl="minidist" if impl == "off" else impl)
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(1), requires_grad=True)
    scale = torch.tensor(1.5, requires_grad=True)
    torch.manual_seed(7)
    y = block(x, scale=scale)
    if twice:
        y.sum().backward(retain_graph=True)
        y.sum().backward()
        dx = x.grad
    else:
        dx, wg = backward_input(y, torch.ones_like(y), x, list(block.parameters()) + [scale])
        backward_weight(wg)
    return dx, {n: p.grad.clone() for n, p in block.named_parameters()} | {"scale": scale.grad}


@pytest.mark.parametrize("twice", [False, True], ids=["B-then-W", "retain_graph"])
def test_a_graph_walked_by_two_backwards_is_recomputed_in_each(twice):
    """Zero-bubble pipelines walk a stage's graph twice (B with retain_graph, then W): minidist's
    checkpoint used to refuse the second walk ("a saved tensor was asked for twice") where torch's
    non-reentrant one recomputes again. Bit for bit the gradients without recomputation; keyword
    arguments (a tensor among them, which gets its gradient) pass through."""
    ref_dx, ref = _split_backward_grads("off", twice)
    for impl in ("minidist", "torch-non-reentrant"):
        dx, got = _split_backward_grads(impl, twice)
        assert torch.equal(dx, ref_dx), impl
        assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref), impl


def test_reentrant_torch_checkpoint_refuses_keyword_arguments_by_name():
    block = Checkpointed(_Scaled(), impl="torch-reentrant")
    with pytest.raises(ValueError, match=r"reentrant checkpoint takes no keyword arguments \(got \['scale'\]\)"):
        block(torch.randn(2, 6, requires_grad=True), scale=2.0)


def test_recomputation_that_saves_something_else_is_an_error():
    calls = []

    def fn(x):
        calls.append(1)
        return x.exp() if len(calls) == 1 else x * 2  # exp saves its output, x * 2 saves nothing

    x = torch.randn(3, requires_grad=True)
    y = checkpoint(fn, x)
    with pytest.raises(RuntimeError, match="saved 0 tensors, the first run 1"):
        y.sum().backward()


def _train(rank, world, impl, wrapper):
    model = _model(impl)
    wrapper, _, amp = wrapper.partition("+")
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp == "bf16")
    if wrapper == "ddp":
        from minidist.data_parallel import BucketedDDP
        model = BucketedDDP(model, bucket_cap_mb=0.0005)
    else:
        model = fsdp.fully_shard(model, auto_wrap=(Block,))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        opt.zero_grad()
        x, y = local_batch(step, rank, world)
        torch.manual_seed(100 * step + rank)   # dropout differs per rank and step, as in training
        with autocast:
            out = model(x)
        loss_fn(out.float(), y).backward()
        opt.step()
    if wrapper == "ddp":
        model.close()
        return named_state(model.module)
    return fsdp_state.full_state_dict(model)


def _both(rank, world, wrapper):
    return {impl: _train(rank, world, impl, wrapper) for impl in ("off", "minidist")}


# "zero3+bf16": field report pytorch#148831 (FSDP2 lost the autocast of a recomputation)
@pytest.mark.parametrize("wrapper", ["ddp", "zero3", "zero3+bf16"])
def test_works_under_bucketed_ddp_and_zero3_hooks(wrapper):
    for out in minidist.run(_both, 2, wrapper, timeout=120):
        assert max_abs_diff(out["minidist"], out["off"]) <= 1e-7
        assert max_abs_diff(out["off"], named_state(_model("off"))) > 1e-3


def test_recomputed_tensors_a_backward_does_not_use_die_with_that_backward(monkeypatch):
    """Field report (pytorch#136766): zero bubble with activation checkpointing kept what B
    recomputed for W's nodes alive until W, and memory grew. Here every tensor B's recomputation
    made is freed when B ends; W recomputes its own."""
    import gc
    import weakref

    from minidist.pipeline_parallel.split_backward import backward_input, backward_weight
    from minidist.sharding import recompute as R

    made = []
    original = R._recompute

    def recording(*args):
        saved = original(*args)
        made.append([weakref.ref(t) for t in saved.values()])
        return saved

    monkeypatch.setattr(R, "_recompute", recording)
    torch.manual_seed(0)
    block = Checkpointed(_Scaled())
    x = torch.randn(5, 6, requires_grad=True)
    y = block(x, scale=2.0)
    _, wg = backward_input(y, torch.ones_like(y), x, list(block.parameters()))
    gc.collect()
    assert len(made) == 1 and made[0] and all(r() is None for r in made[0])
    backward_weight(wg)
    assert len(made) > 1 and all(p.grad is not None for p in block.parameters())   # W: its own


def test_a_plain_backward_leaves_no_recomputed_tensor_alive(monkeypatch):
    """Regression: the recomputation's pack hook returned the tensor itself, so a saved output
    (tanh's) held its own grad_fn: a reference cycle through autograd's C++ nodes that Python's
    garbage collector cannot see, and every recomputed activation of every step stayed alive
    (15 of 15 here). The recomputed graph now keeps nothing."""
    import gc
    import weakref

    from minidist.sharding import recompute as R

    made = []
    original = R._recompute
    monkeypatch.setattr(R, "_recompute", lambda *a: made.append(original(*a)) or made[-1])
    block = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 6))
    for _ in range(3):
        checkpoint(block, torch.randn(5, 6, requires_grad=True)).sum().backward()
    refs = [weakref.ref(t) for saved in made for t in saved.values()]
    made.clear()
    gc.collect()
    assert len(refs) == 15 and all(r() is None for r in refs)
