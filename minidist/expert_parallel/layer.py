"""The mixture-of-experts layer for the course GPT: router + E expert MLPs, experts sharded over EP.

``MoE(cfg, num_experts, top_k)`` replaces a block's MLP (:class:`minidist.models.gpt.Block`
takes it as ``mlp=``). ``x [b, s, h]`` → ``[b, s, h]``: each token's output is the router-weighted
sum of its top-k experts' outputs; a token whose choice is dropped (over capacity) gets nothing
from that expert and is carried by the block's residual alone.

Options (Switch Transformer, Fedus et al. 2021; GShard, Lepikhin et al. 2020; ST-MoE, Zoph et al.
2022; Megatron-LM's ``moe_*`` flags):

* ``capacity_factor``: None = dropless; else each expert accepts
  :func:`~.router.expert_capacity` rows from each rank's ``T`` tokens — the local capacity,
  then the **MAX over** ``capacity_group`` (default the EP group: DeepSpeed ``top1gating`` and
  Megatron sync it so that every rank applies the same limit when their token counts differ);
* ``drop_chunks``: in one process, apply the drop rule to each of this many equal consecutive
  slices of the tokens, with the capacity of one slice — what ``drop_chunks`` EP ranks holding one
  slice each do (the one-process reference for a run with drops);
* ``drop_policy``: ``"position"`` or ``"probs"`` (:func:`~.router.keep_mask`);
* ``aux_loss_coeff`` α, ``z_loss_coeff``: the losses are left in ``self.aux_loss`` (a 0-dim tensor
  with a graph) for the model to add to its loss. ``stats_group``: the ranks whose tokens
  ``f_i`` is counted over (the counts are all-reduced, no gradient needed). With the group of
  every rank that sees different tokens, ``f`` is the global batch's, and the average over ranks
  of the per-rank losses ``α·E·Σ f_i·P_i(local)`` is exactly the one-process loss on the global
  batch (equal token counts per rank; Megatron-LM's ``global_aux_loss``). ``LOCAL``: per-rank
  statistics (the original per-device formulation), which match one process only per micro-batch.

Groups are process groups; ``None`` is the world, as everywhere in the library, and the default
``LOCAL`` (:data:`minidist.comm.p2p.LOCAL`) is no group: this process alone (the one-process
layer), no collective is called.

Parameters: ``router`` (``[E, h]``, fp32, no bias) is replicated over the EP group; ``experts`` holds
only this rank's experts (``expert_ids``), initialised from the same RNG draws as a one-process
layer with all E experts (all are drawn, the others dropped), so EP and one process start equal.

Inside a pipeline stage the aux losses cannot be added to the loss (the loss is on the last
stage): set ``aux_scale`` to ``f(b) -> float`` (``b`` the micro-batch's samples) and the layer
attaches its aux loss to its output with :class:`AuxLossAutoScaler` — the output is unchanged, and
the backward that reaches it also gives the aux loss the gradient ``f(b)``, as if ``f(b) · aux``
had been added to the loss (Megatron-LM's ``MoEAuxLossAutoScaler``, moe_utils.py). ``f`` depends
on the micro-batch size only, so a recomputed forward attaches the same weight.
:func:`minidist.hybrid.train_step` sets it to the weight the step's loss reduction gives.

After each forward ``self.stats`` holds :class:`~.stats.MoEStats` for that forward — overwritten,
never accumulated, so activation recomputation (which runs the forward again) cannot count the
same tokens twice; a training loop reads it once per step.
"""

from __future__ import annotations

import torch
from torch import nn

from ..collectives import all_reduce
from ..comm.p2p import LOCAL, group_rank_world
from ..models.gpt import MLP, GPTConfig
from .dispatch import dispatch_combine, local_experts
from .router import DROP_POLICIES, expert_capacity, keep_mask, load_balancing_loss, route, z_loss
from .stats import MoEStats

__all__ = ["MoE", "AuxLossAutoScaler"]


class AuxLossAutoScaler(torch.autograd.Function):
    """``y = AuxLossAutoScaler.apply(x, aux, weight)``: ``y`` is ``x``; backward passes the
    gradient to ``x`` unchanged and gives ``aux`` (a 0-dim tensor with a graph) the gradient
    ``weight``: the aux loss is backpropagated as part of ``weight · aux`` with no loss term on
    this stage (Megatron-LM, ``megatron/core/transformer/moe/moe_utils.py``)."""

    @staticmethod
    def forward(ctx, x, aux, weight: float):
        ctx.weight, ctx.aux_meta = weight, (aux.shape, aux.dtype, aux.device)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.aux_meta
        return grad, torch.full(shape, ctx.weight, dtype=dtype, device=device), None


class MoE(nn.Module):
    """Top-k mixture of :class:`~minidist.models.gpt.MLP` experts, expert-parallel over ``ep_group``.

    Raises:
        ValueError: bad ``top_k``, ``capacity_factor`` <= 0, unknown ``drop_policy``, input not 3-D.
    """

    def __init__(self, cfg: GPTConfig, num_experts: int, top_k: int = 1,
                 capacity_factor: float | None = None, drop_policy: str = "position",
                 normalize_topk: bool = False, aux_loss_coeff: float = 0.0,
                 z_loss_coeff: float = 0.0, ep_group=LOCAL, ep_size: int | None = None,
                 stats_group=LOCAL, capacity_group="ep", drop_chunks: int = 1):
        super().__init__()
        if not isinstance(num_experts, int) or num_experts < 1:
            raise ValueError(f"MoE: num_experts must be an int >= 1, got {num_experts!r}")
        if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
            raise ValueError(f"MoE: top_k must be an int in 1..{num_experts}, got {top_k!r}")
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(f"MoE: capacity_factor must be > 0 or None (dropless), got "
                             f"{capacity_factor!r}")
        if drop_policy not in DROP_POLICIES:
            raise ValueError(f"MoE: drop_policy must be one of {DROP_POLICIES}, got {drop_policy!r}")
        self.num_experts, self.top_k = num_experts, top_k
        self.capacity_factor, self.drop_policy = capacity_factor, drop_policy
        self.normalize_topk = normalize_topk
        self.aux_loss_coeff, self.z_loss_coeff = aux_loss_coeff, z_loss_coeff
        if not isinstance(drop_chunks, int) or drop_chunks < 1:
            raise ValueError(f"MoE: drop_chunks must be an int >= 1, got {drop_chunks!r}")
        self.drop_chunks = drop_chunks
        self.ep_group, self.stats_group = ep_group, stats_group
        self.capacity_group = ep_group if capacity_group == "ep" else capacity_group
        self.ep_rank, self.ep_size = group_rank_world(ep_group)
        if ep_size is not None and ep_size != self.ep_size:
            raise ValueError(f"MoE (rank {self.ep_rank}): ep_size {ep_size} but the EP group has "
                             f"{self.ep_size} ranks")
        self.router = nn.Linear(cfg.n_embd, num_experts, bias=False, dtype=torch.float32)
        every = [MLP(cfg) for _ in range(num_experts)]   # same draws on every rank and in one process
        self.expert_ids = local_experts(num_experts, self.ep_size, self.ep_rank)
        self.experts = nn.ModuleList(every[e] for e in self.expert_ids)
        for p in self.experts.parameters():
            p.expert_parallel = True   # marks the parameters replicated only over the expert-DP group
        self.aux_loss = None
        self.aux_scale = None     # f(micro-batch samples) -> weight: attach aux to the output
        self.stats = None

    def __getstate__(self):
        """Copies and pickles leave the last forward's aux loss behind (a graph cannot be copied:
        ``copy.deepcopy`` of a model after its forward would fail)."""
        state = dict(super().__getstate__())
        state["aux_loss"] = None
        return state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3:
            raise ValueError(f"MoE (rank {self.ep_rank}): expected x [batch, seq, width], got "
                             f"shape {tuple(x.shape)}")
        b, s, h = x.shape
        flat = x.reshape(b * s, h)
        T, E, k = flat.shape[0], self.num_experts, self.top_k
        with torch.autocast(x.device.type, enabled=False):   # fp32 also under mixed precision
            logits = nn.functional.linear(flat.float(), self.router.weight.float())  # fp32 router
        probs, experts, weights = route(logits, k, self.normalize_topk)
        capacity, n = None, self.drop_chunks
        if T % n:
            raise ValueError(f"MoE (rank {self.ep_rank}): {T} tokens do not split into "
                             f"drop_chunks={n} equal chunks")
        if self.capacity_factor is not None:
            local = torch.tensor([expert_capacity(T // n, E, k, self.capacity_factor)],
                                 device=flat.device)
            if group_rank_world(self.capacity_group)[1] > 1:
                all_reduce(local, op="max", group=self.capacity_group)
            capacity = int(local)
        kept = torch.cat([keep_mask(experts[c * (T // n):(c + 1) * (T // n)],
                                    weights[c * (T // n):(c + 1) * (T // n)], E, capacity,
                                    self.drop_policy) for c in range(n)])
        out, moved = dispatch_combine(flat, experts, weights.to(flat.dtype), kept, E,
                                      list(self.experts), self.ep_group, self.ep_rank, self.ep_size)
        routed = torch.bincount(experts.reshape(-1), minlength=E)
        local_routed = routed.clone()
        total = torch.tensor([T * k], device=flat.device)
        if group_rank_world(self.stats_group)[1] > 1:
            both = torch.cat([routed, total])
            all_reduce(both, op="sum", group=self.stats_group)
            routed, total = both[:E], both[E:]
        aux = logits.new_zeros(())
        if self.aux_loss_coeff:
            aux = aux + load_balancing_loss(probs, routed, int(total), self.aux_loss_coeff)
        if self.z_loss_coeff:
            aux = aux + z_loss(logits, self.z_loss_coeff)
        self.aux_loss = aux
        self.stats = MoEStats(tokens=T, routed=local_routed, kept=moved.counts,
                              received=moved.recv_counts.sum(0), capacity=capacity,
                              send_splits=moved.send_splits, recv_splits=moved.recv_splits,
                              a2a_bytes_sent=moved.a2a_bytes_sent, expert_ids=list(self.expert_ids))
        out = out.view(b, s, h)
        if self.aux_scale is not None and aux.requires_grad:
            out = AuxLossAutoScaler.apply(out, aux, float(self.aux_scale(b)))
        return out
