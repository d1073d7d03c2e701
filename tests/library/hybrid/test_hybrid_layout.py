"""A tied GPT on one pipeline stage at tp=2 (the head *is* the embedding, one parameter under two
names): ``HybridGPT.gather()`` returns the full head (vocab, n_embd), and the one-process GPT's
state dict loads into a tied (dp, pp, tp) = (1, 1, 2) model and gives the one-process logits.
Before, the head's second name had no TP metadata: gather returned this rank's [vocab/2] rows and
loading the one-process state dict was a size mismatch."""

import pytest
import torch

import minidist
from minidist.grid import ProcessGrid
from minidist.hybrid import HybridGPT
from minidist.models.gpt import GPT, GPTConfig
from minidist.tensor_parallel.sharding import shard_state_dict

CFG = GPTConfig(vocab_size=93, block_size=16, n_layer=2, n_head=4, n_embd=32, tie_embeddings=True,
                dropout=0.0)


def _tied_tp2(rank, world):
    grid = ProcessGrid(1, 1, 2)
    model = HybridGPT(CFG, grid, seed=0)
    gathered = model.gather()
    torch.manual_seed(5)
    one = GPT(CFG)                                   # other weights than seed 0's
    stage = model.stages[0]
    stage.load_state_dict(shard_state_dict(one.state_dict(), stage, grid.tp_group))
    ids = torch.randint(0, 93, (2, 16), generator=torch.Generator().manual_seed(1))
    logits = stage(ids)
    from minidist.tensor_parallel.regions import gather_along
    full = gather_along(logits.detach(), -1, grid.tp_group)[..., :93]
    return gathered, model.gather(), full


@pytest.mark.timeout(120)
def test_tied_one_stage_tp2_gathers_and_loads_the_full_head():
    torch.manual_seed(0)
    ref0 = GPT(CFG).state_dict()
    torch.manual_seed(5)
    one = GPT(CFG)
    ids = torch.randint(0, 93, (2, 16), generator=torch.Generator().manual_seed(1))
    want = one(ids)[0].detach()   # (logits, loss)
    for gathered, loaded, logits in minidist.run(_tied_tp2, 2, timeout=100):
        assert gathered["head.weight"].shape == (93, 32)
        assert torch.equal(gathered["head.weight"], ref0["tok_emb.weight"])
        assert torch.equal(loaded["head.weight"], one.state_dict()["tok_emb.weight"])
        assert (logits - want).abs().max() <= 1e-5


def _thaw_zero1(rank, world):
    from minidist.hybrid import make_optimizer, train_step, wrap_stages
    grid = ProcessGrid(2, 1, 1)
    model = HybridGPT(CFG, grid, seed=0)
    frozen = model.stages[0].ln_f.weight
    frozen.requires_grad_(False)
    modules = wrap_stages(model, "zero1")
    opt = make_optimizer(model, "zero1", torch.optim.AdamW, lr=1e-2)
    ids = torch.randint(0, 93, (4, 16), generator=torch.Generator().manual_seed(1))
    train_step(model, opt, modules, ids, ids, 2, dp_mode="zero1")
    frozen.requires_grad_(True)
    try:
        train_step(model, opt, modules, ids, ids, 2, dp_mode="zero1")
    except RuntimeError as e:
        return str(e)
    return "no error"


@pytest.mark.timeout(120)
def test_hybrid_zero1_names_a_parameter_thawed_after_construction():
    for msg in minidist.run(_thaw_zero1, 2, timeout=100):
        assert "requires_grad changed" in msg and f"({CFG.n_embd},)" in msg, msg
