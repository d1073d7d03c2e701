"""The tensor-parallel section of ``minidist demo``: a few end-to-end checks in a few seconds.

Each row compares a TP computation with its single-process reference (the same ones the tests
and the lesson use): the f/g MLP, vocab-parallel cross-entropy with 1e4 logits and a padded
vocabulary, the tiny GPT (plain TP and with sequence parallelism), and the communication of one
block against the formula.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import launch
from . import accounting, regions as R
from .compare import max_rel_error, rel_error
from .cross_entropy import vocab_parallel_cross_entropy
from .layers import ColumnParallelLinear, RowParallelLinear, pad_to_multiple
from .sharding import gather_state_dict, gather_tensor

__all__ = ["demo_rows"]
TOL = 1e-6


def _mlp_error():
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


def _ce_error(world):
    v = 10
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, pad_to_multiple(v, world), generator=g)
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


def _gpt_errors(sp):
    from ..models.gpt import GPT, GPTConfig, TPGPT
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


def _rank(rank, world):
    out = {"mlp": _mlp_error(), "ce": _ce_error(world)}
    out["gpt"], out["block"] = _gpt_errors(False)
    out["gpt_sp"], out["block_sp"] = _gpt_errors(True)
    return out


def demo_rows() -> list[dict]:
    """Rows for ``minidist demo`` (each ``{"section", "check", "world_size", "max_error", "ok",
    "detail"}``); runs TP = 2 and 4 on CPU ranks in a few seconds."""
    rows = []
    for world in (2, 4):
        res = launch.run(_rank, world, timeout=120)
        worst = {k: max(r[k] for r in res) for k in ("mlp", "ce", "gpt", "gpt_sp")}
        want = accounting.block_formula(2, 8, 16, world)["bytes_sent"]
        got = res[0]["block"]
        rows += [
            {"check": "column+row MLP (f, g) = one process", "max_error": worst["mlp"],
             "detail": "output, x.grad, weight grads"},
            {"check": "vocab-parallel CE = F.cross_entropy", "max_error": worst["ce"],
             "detail": "V=10 padded, 1e4 logit, eps 0 and 0.1"},
            {"check": "tiny GPT (TP) = one process", "max_error": worst["gpt"],
             "detail": "logits, loss, every gradient"},
            {"check": "tiny GPT (TP + sequence parallel) = one process", "max_error": worst["gpt_sp"],
             "detail": "logits, loss, every gradient"},
        ]
        for r in rows[-4:]:
            r.update(section="TP", world_size=world, ok=r["max_error"] < TOL)
        ok = got["forward"] == want and got["backward"] == want
        rows.append({"section": "TP", "check": "block comm = 2 all-reduces/pass formula",
                     "world_size": world, "max_error": 0.0 if ok else 1.0, "ok": ok,
                     "detail": f"{got['forward']} B fwd, {got['backward']} B bwd sent, formula {want}"})
    return rows
