"""TP inside a 2-D grid: dp=2 x tp=2 on 4 ranks (ProcessGrid), gradients averaged over the DP
group, equal to one process on the whole batch (equal halves, so the mean of means is the mean)."""

import torch

import minidist
from minidist import collectives
from minidist.grid import ProcessGrid
from minidist.models.gpt import GPT, GPTConfig
from minidist.tensor_parallel.gpt import TPGPT
from minidist.tensor_parallel import gather_state_dict
from minidist_course.references.tensor_parallel import max_rel_error

CFG = GPTConfig(vocab_size=50, block_size=8, n_layer=2, n_head=4, n_embd=16)


def _dp_tp_case(rank, world, sp):
    grid = ProcessGrid(dp=2, tp=2)
    g = torch.Generator().manual_seed(0)
    ids, tgt = torch.randint(0, 50, (4, 8), generator=g), torch.randint(0, 50, (4, 8), generator=g)
    torch.manual_seed(0)
    ref = GPT(CFG)
    ref(ids, tgt)[1].backward()
    torch.manual_seed(0)
    model = TPGPT(CFG, group=grid.tp_group, sequence_parallel=sp)
    half = slice(2 * grid.dp_rank, 2 * grid.dp_rank + 2)
    model(ids[half], tgt[half])[1].backward()
    model.finish_grads()
    for p in model.parameters():
        collectives.all_reduce(p.grad, "avg", group=grid.dp_group)
    grads = gather_state_dict(model, group=grid.tp_group, grads=True)
    return max_rel_error(grads, {n: p.grad for n, p in ref.named_parameters()})[0]


def test_dp_x_tp_grid_equals_one_process_on_the_full_batch():
    for sp in (False, True):
        errs = minidist.run(_dp_tp_case, 4, sp, timeout=60)
        assert max(errs) < 1e-6, (sp, errs)
