"""An embedding tied to the output head across the first and last pipeline stages.

The first stage holds the token embedding, the last a copy as its head (the same TP row shards of
the padded vocabulary). After each backward the copies' gradients are summed over the embedding
group ({first stage, last stage} of each pipeline; Megatron-LM's
``_allreduce_word_embedding_grads``), so both get the summed gradient and the same update.
Checked over 4 training steps on tp=2 x pp=2 (and dp=4 x pp=2 with ZeRO-1, where the copies sit in
flat buffers of their own so the reduce-scatter sums them in the same order): the copies stay
bitwise identical, and every parameter equals the one-process tied GPT's after the same steps
(1e-5 relative per tensor, fp32, SGD with momentum: Adam would turn the rounding noise of
gradients that are zero in exact arithmetic — the attention key bias — into lr-sized steps).
Without the all-reduce the copies drift apart — checked.
"""

import pytest
import torch
import torch.nn.functional as F

import minidist
from minidist.grid import ProcessGrid
from minidist.hybrid import HybridGPT, make_optimizer, train_step, wrap_stages
from minidist.models.gpt import GPT, GPTConfig

CFG = GPTConfig(vocab_size=93, block_size=16, n_layer=4, n_head=4, n_embd=32, tie_embeddings=True)
STEPS, LR = 4, 0.1


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randint(0, 93, (8, 16), generator=g), torch.randint(0, 93, (8, 16), generator=g))


def _rank(rank, world, dp, tp, pp, mode, tie_sync):
    grid = ProcessGrid(dp, pp, tp)
    model = HybridGPT(CFG, grid, seed=0)
    if not tie_sync:
        model.allreduce_tied_grads = lambda: None     # what goes wrong without it
    modules = wrap_stages(model, mode)
    opt = make_optimizer(model, mode, torch.optim.SGD, lr=LR, momentum=0.9)
    same = []
    for step in range(STEPS):
        ids, targets = batch(step)
        train_step(model, opt, modules, ids, targets, 2, dp_mode=mode, max_norm=1.0)
        copy = model.first.tok_emb.weight if model.first is not None else (
            model.last.head.weight if model.last is not None else None)
        if copy is not None and grid.embedding_group is not None:
            other = copy.detach().clone()
            minidist.collectives.all_reduce(other, "max", group=grid.embedding_group)
            mine = copy.detach().clone()
            minidist.collectives.all_reduce(mine, "min", group=grid.embedding_group)
            same.append(torch.equal(other, mine))
    return same, model.gather(), grid.tp_rank


def reference():
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for step in range(STEPS):
        ids, targets = batch(step)
        opt.zero_grad()
        logits, _ = model(ids)
        F.cross_entropy(logits.reshape(-1, 93), targets.reshape(-1)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return model.state_dict()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("dp,tp,pp,mode", [(1, 2, 2, "flat"), (4, 1, 2, "zero1")])
def test_tied_copies_stay_identical_and_equal_one_process(dp, tp, pp, mode):
    results = minidist.run(_rank, dp * tp * pp, dp, tp, pp, mode, True, timeout=180)
    ref = reference()
    checked = 0
    for same, params, _ in results:
        assert all(same), "the tied embedding's copies differ after a step"
        checked += bool(same)
        for k, v in params.items():
            want = ref["tok_emb.weight"] if k == "head.weight" else ref[k]
            assert (v - want).norm() <= 1e-5 * want.norm(), k
    assert checked == 2 * dp * tp   # first and last stage of every pipeline compared


@pytest.mark.timeout(120)
def test_without_the_embedding_allreduce_the_copies_drift():
    results = minidist.run(_rank, 4, 1, 2, 2, "flat", False, timeout=90)
    assert not any(s for same, _, _ in results for s in same)
