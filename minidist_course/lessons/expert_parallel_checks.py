"""Expert-parallel checks shared by ``minidist demo``, chapter 15 and exercise 15's grader.

* :func:`layer_on_ranks` (inside ``minidist.run``) runs one :class:`~minidist.expert_parallel.MoE`
  forward and backward on this rank's slice of a global batch; :func:`layer_errors` compares the
  ranks' outputs and gradients with :func:`~minidist_course.references.expert_parallel.dense_moe` on the
  whole batch (same tokens dropped), and the all-to-all bytes with the formula.
* :func:`train_on_grid` (inside ``minidist.run``) trains :class:`~minidist.expert_parallel.MoEGPT`
  for a few AdamW steps on a ``dp x ep`` grid; :func:`train_errors` compares with one process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from minidist.comm.p2p import LOCAL
from minidist.expert_parallel import MoE, MoEGPT, clip_grad_norm_, sync_grads
from minidist.grid import ProcessGrid
from minidist.expert_parallel.gpt import is_expert
from ..references.expert_parallel import dense_moe
from minidist.expert_parallel.stats import a2a_bytes_formula
from minidist.models.gpt import GPTConfig

__all__ = [
    "GPT_CFG",
    "LAYER_CFG",
    "TOL",
    "layer_errors",
    "layer_on_ranks",
    "train_errors",
    "train_on_grid",
    "train_reference",
]

LAYER_CFG = GPTConfig(n_embd=8)
GPT_CFG = GPTConfig(vocab_size=29, block_size=8, n_layer=2, n_head=2, n_embd=16)
TOL = 1e-6              # absolute, fp32: only the order of the sums differs
B, S = 2, 5             # per rank, for the layer check
AUX, ZC = 0.05, 0.01


def make_layer(E, k, cf=None, policy="position", aux=AUX, ep_group=LOCAL, stats_group=LOCAL):
    torch.manual_seed(0)
    return MoE(LAYER_CFG, E, k, capacity_factor=cf, drop_policy=policy, aux_loss_coeff=aux,
               z_loss_coeff=ZC if aux else 0.0, ep_group=ep_group, stats_group=stats_group)


def global_batch(world, seed=10):
    g = torch.Generator().manual_seed(seed)
    shape = (world * B, S, LAYER_CFG.n_embd)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def layer_on_ranks(rank, world, E, k, cf=None, policy="position", aux=AUX) -> dict:
    """One EP forward/backward of loss ``Σ y·cot + aux`` on this rank's ``B`` samples."""
    wg = dist.group.WORLD
    layer = make_layer(E, k, cf, policy, aux, wg, wg)
    xg, cot = global_batch(world)
    x = xg[rank * B:(rank + 1) * B].clone().requires_grad_()
    y = layer(x)
    ((y * cot[rank * B:(rank + 1) * B]).sum() + layer.aux_loss).backward()
    st = layer.stats
    return dict(y=y.detach(), xgrad=x.grad, router=layer.router.weight.grad,
                experts={e: [p.grad for p in m.parameters()]
                         for e, m in zip(layer.expert_ids, layer.experts)},
                aux=float(layer.aux_loss.detach()), capacity=st.capacity,
                bytes=st.a2a_bytes_sent, kept=st.kept.clone(), received=st.received.clone(),
                formula=a2a_bytes_formula(st.send_splits, st.recv_splits, rank, E,
                                          len(st.expert_ids), LAYER_CFG.n_embd, 4))


def layer_errors(results: list, E, k, cf=None, policy="position", aux=AUX) -> dict:
    """Max absolute errors against the dense one-process MoE: ``out``, ``xgrad``, ``router``
    (summed over ranks), ``experts`` (on their owners), ``aux`` (ranks' mean vs global value);
    ``bytes_ok``: every rank's all-to-all bytes equal the formula; ``kept``: rows kept."""
    world = len(results)
    layer = make_layer(E, k, cf, policy, aux)
    cap = results[0]["capacity"]
    xg, cot = global_batch(world)
    x = xg.reshape(-1, LAYER_CFG.n_embd).clone().requires_grad_()
    y, aux_ref, kept = dense_moe(x, layer.router.weight, list(layer.experts), k, cap, world,
                                 policy, aux_loss_coeff=aux, z_loss_coeff=ZC if aux else 0.0)
    ((y * cot.reshape(-1, LAYER_CFG.n_embd)).sum() + world * aux_ref).backward()
    flat = lambda key: torch.cat([r[key] for r in results]).reshape(-1, LAYER_CFG.n_embd)
    owned = {e: g for r in results for e, g in r["experts"].items()}
    return dict(
        out=(flat("y") - y.detach()).abs().max().item(),
        xgrad=(flat("xgrad") - x.grad).abs().max().item(),
        router=(sum(r["router"] for r in results) - layer.router.weight.grad).abs().max().item(),
        experts=max((a - b.grad).abs().max().item() for e, g in owned.items()
                    for a, b in zip(g, layer.experts[e].parameters())),
        aux=abs(sum(r["aux"] for r in results) / world - float(aux_ref.detach())),
        bytes_ok=all(r["bytes"] == r["formula"] for r in results),
        kept=(sum(int(r["kept"].sum()) for r in results), int(kept.sum())),
        all_experts=sorted(owned) == list(range(E)))


def _named(model):
    out = {}
    for name, p in model.named_parameters():
        if is_expert(p):
            parts = name.split(".")
            parts[4] = str(model.blocks[int(parts[1])].mlp.expert_ids[int(parts[4])])
            name = ".".join(parts)
        out[name] = p.detach().clone()
    return out


def _train(model, world, rank, grid, steps, lr=3e-3, eps=1e-5, max_norm=0.5, b=2):
    """AdamW (eps 1e-5: the attention key bias's gradient is zero up to rounding, and a smaller
    eps turns that rounding into ±lr steps), clipping by the global norm."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, eps=eps, weight_decay=0.1)
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)
        ids = torch.randint(0, GPT_CFG.vocab_size, (world * b, GPT_CFG.block_size), generator=g)
        targets = torch.roll(ids, -1, dims=1)
        lo = slice(rank * b, (rank + 1) * b) if grid is not None else slice(None)
        opt.zero_grad()
        _, loss = model(ids[lo], targets[lo])
        loss.backward()
        if grid is not None:
            sync_grads(model, grid)
            clip_grad_norm_(model, grid, max_norm)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def train_on_grid(rank, world, dp, ep, E, k, cf=None, steps=3) -> dict:
    """``steps`` AdamW steps of MoEGPT with ``dp`` replicas of each expert and ``ep`` ranks sharing
    the experts (``ProcessGrid(dp·ep, ep=ep)``); this rank's parameters by one-process name."""
    grid = ProcessGrid(dp * ep, ep=ep)
    torch.manual_seed(0)
    model = MoEGPT(GPT_CFG, E, k, grid=grid, capacity_factor=cf, aux_loss_coeff=0.01,
                   z_loss_coeff=0.001)
    losses = _train(model, world, rank, grid, steps)
    return dict(coords=(grid.expert_dp_rank, grid.ep_rank), losses=losses, params=_named(model))


def train_reference(world, E, k, cf=None, steps=3) -> dict:
    torch.manual_seed(0)
    model = MoEGPT(GPT_CFG, E, k, capacity_factor=cf, drop_chunks=world, aux_loss_coeff=0.01,
                   z_loss_coeff=0.001)
    return dict(losses=_train(model, world, 0, None, steps), params=_named(model))


def train_errors(results: list, ref: dict) -> dict:
    """``params``: max |Δ| over every rank's parameters; ``loss``: the ranks' mean loss per step;
    ``replicas_equal``: parameters with the same name bitwise equal on every rank holding them."""
    world = len(results)
    params = max((r["params"][n] - ref["params"][n]).abs().max().item()
                 for r in results for n in r["params"])
    loss = max(abs(sum(r["losses"][s] for r in results) / world - ref["losses"][s])
               for s in range(len(ref["losses"])))
    equal = all(torch.equal(a["params"][n], b["params"][n]) for a in results for b in results
                for n in set(a["params"]) & set(b["params"]))
    covered = set().union(*(r["params"] for r in results)) == set(ref["params"])
    return dict(params=params, loss=loss, replicas_equal=equal and covered)
