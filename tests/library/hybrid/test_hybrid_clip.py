"""Gradient clipping by the global norm across TP shards, pipeline stages and DP replicas.

On dp=2 x tp=2 x pp=2 with sequence parallelism and a tied embedding, the global norm and the
clipped gradients equal ``torch.nn.utils.clip_grad_norm_`` on the one-process tied GPT (1e-6
relative), with clipping active and inactive. The counting matters: summing every rank's local
squares instead (TP-replicated LayerNorms counted tp times, the tied copy twice, replicas dp
times) gives a different norm, which the test checks too, so the rule cannot silently regress.
"""

import pytest
import torch
import torch.nn.functional as F

import minidist
from minidist import collectives as C
from minidist.grid import ProcessGrid
from minidist.hybrid import HybridGPT, clip_grad_norm_, global_grad_norm, train_step, wrap_stages
from minidist.models.gpt import GPT, GPTConfig

CFG = GPTConfig(vocab_size=93, block_size=16, n_layer=4, n_head=4, n_embd=32, tie_embeddings=True)


def batch():
    g = torch.Generator().manual_seed(11)
    return (torch.randint(0, 93, (8, 16), generator=g), torch.randint(0, 93, (8, 16), generator=g))


def _rank(rank, world, max_norm):
    grid = ProcessGrid(2, 2, 2)
    model = HybridGPT(CFG, grid, sequence_parallel=True, seed=0)
    ids, targets = batch()
    train_step(model, None, wrap_stages(model), ids, targets, 2, step=False)
    naive = torch.zeros(1, dtype=torch.float64)
    for p in model.parameters():
        naive += p.grad.double().pow(2).sum()
    C.all_reduce(naive, "sum")          # every rank's squares, world-wide: the wrong count
    norm = clip_grad_norm_(model, max_norm)
    after = global_grad_norm(model)
    return norm, after, float(naive.sqrt()), model.gather(grads=True), grid.tp_rank


def reference(max_norm):
    torch.manual_seed(0)
    model = GPT(CFG)
    ids, targets = batch()
    logits, _ = model(ids)
    F.cross_entropy(logits.reshape(-1, 93), targets.reshape(-1)).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item()
    return norm, {k: p.grad for k, p in model.named_parameters()}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("max_norm", [0.1, 1e6], ids=["clipping", "not-clipping"])
def test_global_norm_and_clipped_grads_equal_torch(max_norm):
    results = minidist.run(_rank, 8, max_norm, timeout=180)
    ref_norm, ref = reference(max_norm)
    assert (ref_norm > max_norm) == (max_norm == 0.1)
    for norm, after, naive, grads, tp_rank in results:
        assert norm == pytest.approx(ref_norm, rel=1e-6)
        assert after == pytest.approx(min(ref_norm, max_norm), rel=1e-5)
        assert abs(naive - ref_norm) > 0.1 * ref_norm, "counting every rank's squares is wrong"
        grads.pop("head.weight", None)   # the tied copy, checked equal in test_hybrid_tied
        for k, g in grads.items():
            assert (g - ref[k]).norm() <= 2e-6 * ref[k].norm(), k


@pytest.mark.timeout(60)
def test_only_the_two_norm():
    def fn(rank, world):
        model = HybridGPT(CFG, ProcessGrid(1, 1, 1))
        global_grad_norm(model, norm_type=1)
    with pytest.raises(minidist.RankError, match="only the 2-norm"):
        minidist.run(fn, 1, timeout=30)
