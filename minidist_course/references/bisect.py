"""Where did it go wrong? Run a parallel configuration and one process from the same seed and
batch, record every module boundary, and name the **first** tensor that leaves the one-process
run: its step, phase, rank, error, budget and a diagnosis from the pattern of the error.

What is recorded, per step, in this order (the order of the report):

1. **forward** — ``embed`` (the first block's input), each ``blocks.i`` output, ``logits``;
2. **backward** — the gradient of each block's output, last block first;
3. **gradients** — every parameter's gradient after the DP/TP/tied reductions (``HybridGPT.gather``),
   head first, each rank's copy compared;
4. then a plain SGD step (``lr``) on both sides, and the next step's forward shows its effect.

Each rank records what its stages hold (hooks on the stages and blocks; a block's recomputation in
backward is not recorded). The driver reassembles the shards into the one-process layout: samples
from the DP slices and micro-batches (``tensor_split``, as :func:`~.step.train_step` cuts them),
sequence positions from the CP split (:func:`minidist.context_parallel.sharding.positions`) and the
sequence-parallel chunks, vocabulary from the TP shards. Activation gradients are compared after
the scale each rank's loss carries by construction (``"mean"``: dp·cp; ``"per_token"``: the global
count of tokens, as the engine backpropagates sums; ``"sum"``: 1).

The budget of a tensor is relative, ``‖got − ref‖ / ‖ref‖``: in fp32 ``64·ε·sqrt(W·M)`` (sums of
W·M terms in another order than one process: ε = 2⁻²³), with bf16 autocast ``8·2⁻⁸`` (bf16
products rounded in another order; measured up to 1.8e-2 after a step on the matrix's dense
configurations). No rounding budget covers experts under bf16: a token near a tie between two
experts goes to the other one when the shards round differently, and those experts' gradients
differ by up to 7e-2 (measured), more when a capacity then drops other tokens — a property of
routing in low precision, not a bug; MoE under autocast is refused by name (bisect it in fp32). Diagnoses,
from :func:`diagnose`: a scale of W, dp, tp or 1/W (an average missing, doubled or divided
twice), a sign flip, a permutation (the right values in the wrong places), the rows of one rank
only, the rows whose targets are ignored only.

Model: a :class:`~.stages.HybridGPT` without dropout (one process would draw other masks); with
MoE blocks, one process runs micro-batch by micro-batch as the pipeline does (the capacity and the
aux losses are per micro-batch). Compare: torchtitan's numerics guide (seed checkpoint,
deterministic mode, loss curves compared by hand) — this automates the comparison per tensor.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minidist.hybrid.step import train_step
from minidist.launch import run
from minidist.models.gpt import GPT

from .diagnose import Divergence, compare_all
from .hybrid import token_groups

__all__ = ["Divergence", "Report", "bisect", "budget"]


@dataclass
class Report:
    """``divergences`` (every tensor beyond budget, report order), ``errors`` (every compared
    tensor's relative error by ``(step, phase, name)``, report order), ``budget``, ``losses`` (per
    step: parallel, one process)."""
    divergences: list
    errors: dict
    budget: float
    losses: list

    @property
    def checked(self) -> int:
        return len(self.errors)

    @property
    def first(self) -> Divergence | None:
        return self.divergences[0] if self.divergences else None

    def format(self, top: int = 5) -> str:
        if not self.divergences:
            return f"no divergence: {self.checked} tensors within budget"
        lines = [f"first divergence of {len(self.divergences)} (of {self.checked} tensors):"]
        lines += [("→ " if i == 0 else "  ") + d.format() for i, d in enumerate(self.divergences[:top])]
        return "\n".join(lines)


def budget(world_size: int, microbatches: int, autocast_dtype=None) -> float:
    """The relative error a correct run may show (module docstring)."""
    if autocast_dtype is not None:
        return 8 * 2.0 ** -8
    return 64 * 2.0 ** -23 * math.sqrt(world_size * microbatches)


def _sgd(params, lr: float) -> None:
    """The plain SGD step both sides take between steps (any optimizer would do; this one has no
    state to keep equal)."""
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p.add_(p.grad, alpha=-lr)


class _Recorder:
    """Hooks on this rank's stages: block inputs/outputs and output gradients, per micro-batch."""

    def __init__(self, model):
        self.records: list = []          # (step, phase, name, mb, tensor)
        self.step, self.active, self.mb = 0, None, {}
        for s, stage in model.stages.items():
            stage.register_forward_pre_hook(self._enter(s))
            stage.register_forward_hook(self._leave(s, s == model.n_stages - 1))
            for i, block in stage.blocks.items():
                block.register_forward_hook(self._block(f"blocks.{i}"))
                if s == 0 and int(i) == min(int(k) for k in stage.blocks.keys()):
                    block.register_forward_pre_hook(self._embed)

    def _enter(self, s):
        def hook(module, args):
            self.active = (s, self.mb.get(s, 0))
            self.mb[s] = self.mb.get(s, 0) + 1
        return hook

    def _leave(self, s, last):
        def hook(module, args, out):
            if last:
                self.records.append((self.step, "forward", "logits", self.active[1], out.detach().clone()))
            self.active = None
        return hook

    def _embed(self, module, args):
        if self.active is not None:
            self.records.append((self.step, "forward", "embed", self.active[1], args[0].detach().clone()))

    def _block(self, name):
        def hook(module, args, out):
            if self.active is None:          # a recomputation in backward
                return
            step, mb = self.step, self.active[1]
            self.records.append((step, "forward", name, mb, out.detach().clone()))
            if out.requires_grad:
                out.register_hook(lambda g: self.records.append((step, "backward", name, mb, g.detach().clone())))
        return hook

    def next_step(self):
        self.step, self.mb = self.step + 1, {}


def _rank(rank, world, build, ids, targets, steps, microbatches, lr, kwargs, context):
    with context() if context is not None else contextlib.nullcontext():
        model, modules = build(rank, world)
        cfg = model.cfg
        if cfg.dropout or getattr(cfg, "attn_dropout", 0.0):   # every rank, before communicating
            return {"dropout": max(cfg.dropout, getattr(cfg, "attn_dropout", 0.0))}
        if model.moe and kwargs.get("autocast_dtype") is not None:
            return {"moe_autocast": str(kwargs["autocast_dtype"])}
        rec, grads, losses = _Recorder(model), [], []
        for _ in range(steps):
            out = train_step(model, None, modules, ids, targets, microbatches, step=False, **kwargs)
            losses.append(out.loss)
            grads.append({k: v.clone() for k, v in model.gather(grads=True).items()})
            _sgd(model.parameters(), lr)
            rec.next_step()
    g = model.grid
    return {"coords": dict(dp=g.dp_rank, cp=g.cp_rank, tp=g.tp_rank, pp=g.pp_rank, rank=g.rank),
            "sizes": dict(dp=g.dp_size, cp=g.cp_size, tp=g.tp_size, pp=g.pp_size),
            "split": model.cp_split, "sp": model.sequence_parallel, "cfg": model.cfg,
            "seed": model.seed, "moe": model.moe, "records": rec.records, "grads": grads,
            "losses": losses}


def _one_process(cfg, seed, ids, targets, steps, lr, reduction, autocast_dtype, moe=None,
                 dp=1, microbatches=1, groups=None):
    """The same steps in one process: records by (step, phase, name) and gradients per step.
    With ``moe``, :class:`~minidist.expert_parallel.MoEGPT` runs micro-batch by micro-batch — the
    m-th micro-batch of every replica together, the capacity applied to each replica's part (or,
    ``groups``, to each rank's tokens: :func:`.hybrid.token_groups`) — and adds ``(n_m/N)·aux(m)``
    to the cross-entropy, as the pipeline does."""
    from minidist.expert_parallel.gpt import MoEGPT
    torch.manual_seed(seed)
    model = (GPT(cfg) if moe is None else MoEGPT(cfg, **moe, drop_chunks=dp) if groups is None
             else MoEGPT(cfg, **moe, drop_groups=groups))
    acts, grads, losses = {}, [], []
    B = ids.shape[0]
    parts = [torch.arange(B)] if moe is None else [
        torch.cat([r.tensor_split(microbatches)[m] for r in torch.arange(B).tensor_split(dp)])
        for m in range(microbatches)]
    step, rows = 0, parts[0]

    def put(key, value, at):   # rows ``at`` of the whole-batch tensor
        if key not in acts:
            acts[key] = value.new_zeros((B, *value.shape[1:]))
        acts[key][at] = value.detach()

    def keep(name):
        def hook(module, args, out):
            s, at = step, rows
            put((s, "forward", name), out, at)
            out.register_hook(lambda g: put((s, "backward", name), g, at))
        return hook
    for i, block in enumerate(model.blocks):
        block.register_forward_hook(keep(f"blocks.{i}"))
    model.blocks[0].register_forward_pre_hook(lambda m, a: put((step, "forward", "embed"), a[0], rows))
    ctx = (lambda: torch.autocast("cpu", dtype=autocast_dtype)) if autocast_dtype is not None else (
        lambda: torch.autocast("cpu", enabled=False))
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        logits, aux = [], 0.0
        for rows in parts:
            with ctx():
                out = model(ids[rows])[0]
            put((step, "forward", "logits"), out, rows)
            logits.append(out.float())
            if moe is not None:
                aux = aux + rows.numel() / B * model.aux_loss
        order = torch.cat(parts)
        loss = F.cross_entropy(torch.cat(logits).reshape(-1, cfg.vocab_size),
                               targets[order].reshape(-1),
                               reduction="sum" if reduction == "sum" else "mean") + aux
        loss.backward()
        losses.append(loss.item())
        grads.append({k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None})
        _sgd(model.parameters(), lr)
    return acts, grads, losses


def bisect(build, world_size: int, ids: torch.Tensor, targets: torch.Tensor, microbatches: int,
           steps: int = 2, lr: float = 0.1, context=None, timeout: float = 300,
           **step_kwargs) -> Report:
    """Run ``build`` on ``world_size`` ranks for ``steps`` steps of :func:`~.step.train_step` on
    the global batch ``ids``/``targets`` ``[B, s]`` (``step_kwargs``: its schedule, dp_mode,
    loss_reduction, autocast_dtype), then one process; return the :class:`Report`.

    ``build(rank, world_size) -> (HybridGPT, modules)`` (picklable, e.g. a module-level function):
    the model and ``wrap_stages(model, dp_mode)``. ``context``: None or a picklable callable of
    no argument returning a context manager, entered on every rank around the build and the steps
    (e.g. a patch that mutates one library function). Raises ``ValueError`` for dropout > 0 and
    for MoE blocks under autocast (each named, before training), and what ``train_step`` raises.
    """
    results = run(_rank, world_size, build, ids, targets, steps, microbatches, lr, step_kwargs,
                  context, timeout=timeout)
    head = results[0]
    if "dropout" in head:
        raise ValueError(f"bisect: dropout={head['dropout']} draws other masks than one process; "
                         "build the model with dropout=0")
    if "moe_autocast" in head:
        raise ValueError(f"bisect: experts under autocast_dtype={head['moe_autocast']} have no "
                         "rounding budget — a token near a tie between two experts goes to the "
                         "other one when the ranks round differently, and those experts' "
                         "gradients differ by more than rounding; bisect this configuration "
                         "in fp32 (autocast_dtype=None)")
    cfg = head["cfg"]
    reduction = step_kwargs.get("loss_reduction") or ("per_token" if (targets == -100).any() else "mean")
    dtype = step_kwargs.get("autocast_dtype")
    sizes, sp = head["sizes"], head["sp"] and head["sizes"]["tp"] > 1
    groups = (token_groups(sizes["dp"], sizes["cp"], head["split"], sizes["tp"] if sp else 1)
              if head["moe"] and head["moe"].get("capacity_factor") is not None
              and (sizes["cp"] > 1 or sp) else None)
    acts, grads, losses = _one_process(cfg, head["seed"], ids, targets, steps, lr, reduction, dtype,
                                       head["moe"], sizes["dp"], microbatches, groups)
    layout = dict(B=ids.shape[0], s=ids.shape[1], M=microbatches, V=cfg.vocab_size,
                  reduction=reduction,
                  tokens=int((targets != -100).sum()), ignored=targets == -100)
    limit = budget(world_size, microbatches, dtype)
    divergences, errors = compare_all(results, acts, grads, layout, limit, steps)
    par = [r for r in results if r["coords"]["rank"] == 0][0]["losses"]
    return Report(divergences, errors, limit, list(zip(par, losses)))
