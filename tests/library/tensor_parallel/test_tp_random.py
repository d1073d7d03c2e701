"""Dropout under TP (Megatron's RNG tracker): same masks where activations are replicated,
different masks on different shards, unaffected by rank-local use of torch's global generator."""

import pytest
import torch

import minidist
from minidist.models.gpt import GPT, GPTConfig
from minidist.tensor_parallel.gpt import TPGPT, use_tracker_dropout
from minidist.tensor_parallel import regions as R
from minidist_course.references.tensor_parallel import rel_error
from minidist.tensor_parallel.random import dropout, model_parallel_seed


def _masks_case(rank, world, local_rand):
    model_parallel_seed(1234)
    if local_rand and rank == 0:
        torch.rand(1000)                      # rank-local use of the global generator
        torch.manual_seed(99)
    x = torch.ones(4, 16)
    return {"replicated": dropout(x, 0.5, region="replicated") != 0,
            "model-parallel": dropout(x, 0.5, region="model-parallel") != 0}


@pytest.mark.parametrize("world", [2, 4])
def test_replicated_masks_equal_model_parallel_masks_differ(world):
    res = minidist.run(_masks_case, world, False, timeout=60)
    disturbed = minidist.run(_masks_case, world, True, timeout=60)
    for r in range(world):
        assert torch.equal(res[r]["replicated"], res[0]["replicated"])
        assert torch.equal(disturbed[r]["replicated"], res[r]["replicated"]), \
            "rank-local use of the global generator must not change the masks"
        assert torch.equal(disturbed[r]["model-parallel"], res[r]["model-parallel"])
        for q in range(r):
            assert not torch.equal(res[r]["model-parallel"], res[q]["model-parallel"]), \
                "different shards must get different masks"
    kept = res[0]["replicated"].float().mean().item()
    assert 0.3 < kept < 0.7


def _unseeded_case(rank, world):
    from minidist.tensor_parallel.random import RNGTracker
    dropout(torch.ones(3), 0.5, tracker=RNGTracker())


def test_dropout_without_a_seed_is_a_clear_error():
    with pytest.raises(minidist.RankError, match="model_parallel_seed"):
        minidist.run(_unseeded_case, 1, timeout=60)


def _gpt_dropout_case(rank, world):
    cfg = GPTConfig(vocab_size=50, block_size=8, n_layer=2, n_head=4, n_embd=16, dropout=0.2)
    torch.manual_seed(0)
    ref = use_tracker_dropout(GPT(cfg))   # the same generators as the TP model's dropout
    torch.manual_seed(0)
    tp = TPGPT(cfg)
    g = torch.Generator().manual_seed(5)
    ids, targets = torch.randint(0, 50, (2, 8), generator=g), torch.randint(0, 50, (2, 8), generator=g)
    model_parallel_seed(7)
    logits_r, loss_r = ref(ids, targets)
    model_parallel_seed(7)
    if rank == 1:
        torch.rand(10)
    logits_t, loss_t = tp(ids, targets)
    full = R.gather_from_tensor_model_parallel_region(logits_t)[..., :50]
    model_parallel_seed(8)
    other = ref(ids, targets)[0]
    return {"logits": rel_error(full, logits_r), "loss": rel_error(loss_t, loss_r),
            "other_seed": rel_error(other, logits_r)}


def test_tp_gpt_with_residual_dropout_equals_single_process():
    """Residual/embedding dropout draws replicated masks, so TP=2 equals one process exactly."""
    for r in minidist.run(_gpt_dropout_case, 2, timeout=60):
        assert r["logits"] < 1e-6 and r["loss"] < 1e-6, r
        assert r["other_seed"] > 1e-2, "dropout must actually be on"
