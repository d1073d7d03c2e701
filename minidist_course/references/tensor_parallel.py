"""How the tests, the demo and the lesson measure "equal to the single-process model", and the
tensor-parallel checks the demo, the tests and ch06 share (run them inside ``minidist.run``).

``rel_error(a, b) = ||a - b|| / ||b||`` (2-norm over all elements; ``||a - b||`` when ``b`` is all
zeros): the norm-wise relative error of numerical linear algebra. In fp32 a TP layer differs from
the single-process one only in the order of floating-point additions (a row-parallel layer sums W
partial products), so the tests ask for ``rel_error < 1e-6`` (fp32 epsilon is 1.2e-7). A broken
operator (a missing f or g) gives errors of order 1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minidist.models.gpt import GPT, GPTConfig
from minidist.tensor_parallel import accounting, regions as R
from minidist.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from minidist.tensor_parallel.gpt import TPGPT
from minidist.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, pad_to_multiple
from minidist.tensor_parallel.sharding import gather_state_dict, gather_tensor

__all__ = ["rel_error", "max_rel_error", "mlp_error", "cross_entropy_error", "gpt_errors", "TOL"]

TOL = 1e-6  # fp32: TP changes only the order of additions


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """Norm-wise relative error of ``a`` against the reference ``b`` (same shape: else ValueError)."""
    if a.shape != b.shape:
        raise ValueError(f"rel_error: shapes differ, {tuple(a.shape)} vs reference {tuple(b.shape)}")
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    scale = b.norm().item()
    diff = (a - b).norm().item()
    if scale == 0.0:
        return diff
    return diff / scale


def max_rel_error(got: dict, ref: dict) -> tuple[float, str]:
    """``(worst error, its key)`` over the keys of ``ref``; a key missing from ``got`` is an error."""
    missing = sorted(set(ref) - set(got))
    if missing:
        raise KeyError(f"max_rel_error: missing {missing}")
    worst, where = 0.0, ""
    for k in ref:
        e = rel_error(got[k], ref[k])
        if e > worst or not where:
            worst, where = e, k
    return worst, where


def mlp_error() -> float:
    """Column + row MLP (f, g) against ``nn.Sequential(Linear, ReLU, Linear)`` on one process: the
    worst rel_error of the output, the input gradient and every gathered weight gradient."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    torch.manual_seed(0)
    tp = nn.Sequential(ColumnParallelLinear(4, 8), nn.ReLU(), RowParallelLinear(8, 4))
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    xr, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
    yr, yt = ref(xr), tp(xt)
    (yr ** 2).sum().backward(), (yt ** 2).sum().backward()
    grads = gather_state_dict(tp, grads=True)
    return max(rel_error(yt, yr), rel_error(xt.grad, xr.grad),
               max_rel_error(grads, {n: p.grad for n, p in ref.named_parameters()})[0])


def cross_entropy_error(world_size: int) -> float:
    """vocab_parallel_cross_entropy against ``F.cross_entropy`` with a vocabulary of 10 padded to a
    multiple of ``world_size``, a logit of 1e4, label smoothing 0 and 0.1: the worst rel_error of loss and
    logit gradient, and the largest gradient on a padding column (must be 0)."""
    v = 10
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, pad_to_multiple(v, world_size), generator=g)
    logits[0, 1, 3] = 1e4
    target = torch.randint(0, v, (2, 5), generator=g)
    target[0, 0], target[1, 4] = 0, v - 1
    errs = []
    for eps in (0.0, 0.1):
        full = logits[..., :v].clone().requires_grad_()
        ref = F.cross_entropy(full.reshape(-1, v), target.reshape(-1), label_smoothing=eps)
        ref.backward()
        mine = R.split_along(logits, -1).requires_grad_()
        loss = vocab_parallel_cross_entropy(mine, target, v, label_smoothing=eps)
        loss.backward()
        grad = gather_tensor(mine.grad, 2)
        errs += [rel_error(loss, ref), rel_error(grad[..., :v], full.grad),
                 grad[..., v:].abs().max().item() if grad.shape[-1] > v else 0.0]
    return max(errs)


def gpt_errors(sp: bool) -> tuple[float, dict]:
    """TPGPT (``sp``: with sequence parallelism) against GPT built from the same seed: the worst
    rel_error of logits, loss and every gradient; and the bytes block 0 sent per pass
    (``{"forward": ..., "backward": ...}``) for :func:`accounting.block_formula`."""
    cfg = GPTConfig(vocab_size=50, block_size=8, n_layer=2, n_head=4, n_embd=16)
    torch.manual_seed(0)
    ref = GPT(cfg)
    torch.manual_seed(0)
    tp = TPGPT(cfg, sequence_parallel=sp)
    g = torch.Generator().manual_seed(3)
    ids, tgt = torch.randint(0, 50, (2, 8), generator=g), torch.randint(0, 50, (2, 8), generator=g)
    logits_r, loss_r = ref(ids, tgt)
    loss_r.backward()
    with accounting.comm_log() as log:
        logits_t, loss_t = tp(ids, tgt)
        loss_t.backward()
    tp.finish_grads()
    full = R.gather_from_tensor_model_parallel_region(logits_t.detach())[..., :50]
    err = max(rel_error(full, logits_r), rel_error(loss_t, loss_r),
              max_rel_error(gather_state_dict(tp, grads=True),
                            {n: p.grad for n, p in ref.named_parameters()})[0])
    summary = accounting.summarize(log, by=("scope", "phase"))
    block = {ph: sum(summary.get((f"block0.{part}", ph), {"bytes_sent": 0})["bytes_sent"]
                     for part in ("attn", "mlp")) for ph in ("forward", "backward")}
    return err, block
