"""The tiny GPT, tensor-parallel (TP 1, 2, 4, with and without sequence parallelism), against the
single-process GPT: logits, loss, every gradient and the weights after SGD steps, 1e-6 relative."""

import pytest
import torch

import minidist
from minidist.models.gpt import GPT, GPTConfig
from minidist.tensor_parallel.gpt import TPGPT
from minidist.tensor_parallel import accounting, gather_state_dict, regions as R
from minidist_course.references.tensor_parallel import max_rel_error, rel_error

TOL = 1e-6
CFG = GPTConfig(vocab_size=50, block_size=8, n_layer=2, n_head=4, n_embd=16)


def _batch(step, cfg=CFG, b=2):
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randint(0, cfg.vocab_size, (b, cfg.block_size), generator=g),
            torch.randint(0, cfg.vocab_size, (b, cfg.block_size), generator=g))


def _gpt_case(rank, world, sp, steps):
    torch.manual_seed(0)
    ref = GPT(CFG)
    torch.manual_seed(0)
    tp = TPGPT(CFG, sequence_parallel=sp)
    # SGD, not Adam: the key bias has an exactly-zero true gradient (softmax ignores a constant
    # shift of q.k), so both models hold rounding noise (~1e-10) there, and Adam's g/sqrt(v) turns
    # noise into full steps of size lr with random sign -- a property of Adam, not of TP.
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt_t = torch.optim.SGD(tp.parameters(), lr=0.1, momentum=0.9)
    worst = {"init": max_rel_error(gather_state_dict(tp), ref.state_dict())[0]}
    for step in range(steps):
        ids, targets = _batch(step)
        logits_r, loss_r = ref(ids, targets)
        logits_t, loss_t = tp(ids, targets)
        loss_r.backward()
        loss_t.backward()
        tp.finish_grads()
        full = R.gather_from_tensor_model_parallel_region(logits_t.detach())[..., :CFG.vocab_size]
        errs = {"logits": rel_error(full, logits_r), "loss": rel_error(loss_t, loss_r),
                "grads": max_rel_error(gather_state_dict(tp, grads=True),
                                       {n: p.grad for n, p in ref.named_parameters()})[0]}
        opt_r.step(), opt_t.step(), opt_r.zero_grad(), opt_t.zero_grad()
        errs["weights"] = max_rel_error(gather_state_dict(tp), ref.state_dict())[0]
        worst.update({k: max(worst.get(k, 0.0), v) for k, v in errs.items()})
    return worst


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_tp_gpt_matches_single_process_gpt_over_sgd_steps(world, sp):
    for worst in minidist.run(_gpt_case, world, sp, 3, timeout=90):
        assert worst["init"] == 0.0, "same seed must give the same full weights"
        assert max(worst.values()) < TOL, worst


def _heads_case(rank, world):
    TPGPT(GPTConfig(n_head=4, n_embd=12, vocab_size=12))


def test_heads_not_divisible_by_tp_size_is_a_clear_error():
    with pytest.raises(minidist.RankError, match=r"rank 0\): n_head=4 is not divisible by the "
                                                 r"tensor-parallel size 3"):
        minidist.run(_heads_case, 3, timeout=60)


def _comm_case(rank, world, sp):
    torch.manual_seed(0)
    tp = TPGPT(CFG, sequence_parallel=sp)
    ids, targets = _batch(0)
    with accounting.comm_log() as log:
        tp(ids, targets)[1].backward()
    return accounting.summarize(log, by=("scope", "phase"))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_communication_per_block_matches_the_formula(world, sp):
    res = minidist.run(_comm_case, world, sp, timeout=60)
    want = accounting.block_formula(2, CFG.block_size, CFG.n_embd, world, 4, sp)
    for summary in res:
        for i in range(CFG.n_layer):
            for phase in ("forward", "backward"):
                got = [summary[(f"block{i}.{part}", phase)] for part in ("attn", "mlp")]
                assert sum(g["count"] for g in got) == sum(want["ops"].values())
                assert sum(g["payload_bytes"] for g in got) == want["payload_bytes"]
                assert sum(g["bytes_sent"] for g in got) == want["bytes_sent"], (phase, got, want)


def _block_case(rank, world, which):
    from minidist.models.gpt import MLP, CausalSelfAttention
    from minidist.tensor_parallel import ParallelMLP, ParallelSelfAttention
    torch.manual_seed(0)
    ref = CausalSelfAttention(CFG) if which == "attn" else MLP(CFG)
    torch.manual_seed(0)
    tp = (ParallelSelfAttention(CFG.n_embd, CFG.n_head) if which == "attn"
          else ParallelMLP(CFG.n_embd, 4 * CFG.n_embd))
    x = torch.randn(2, CFG.block_size, CFG.n_embd, generator=torch.Generator().manual_seed(4))
    xr, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
    yr, yt = ref(xr), tp(xt)
    (yr ** 2).sum().backward()
    (yt ** 2).sum().backward()
    return max(rel_error(yt, yr), rel_error(xt.grad, xr.grad),
               max_rel_error(gather_state_dict(tp, grads=True),
                             {n: p.grad for n, p in ref.named_parameters()})[0])


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("which", ["attn", "mlp"])
def test_parallel_attention_and_mlp_blocks_match_single_process(world, which):
    for err in minidist.run(_block_case, world, which, timeout=60):
        assert err < TOL, err


def test_a_tied_head_is_refused_not_silently_untied():
    """TPGPT's head is a ColumnParallelLinear of its own: tie_embeddings=True would give another
    model than GPT(cfg) without a word, so it is refused, pointing at HybridGPT (which ties)."""
    import dataclasses
    with pytest.raises(ValueError, match=r"TPGPT \(rank 0\): tie_embeddings=True is not supported.*HybridGPT"):
        TPGPT(dataclasses.replace(CFG, tie_embeddings=True))
