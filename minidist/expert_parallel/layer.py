"""The mixture-of-experts layer for the course GPT: router + E expert MLPs, experts sharded over EP.

``x [b, s, h] -> [b, s, h]``: the router-weighted sum of each token's top-k experts (Switch,
GShard, ST-MoE; Megatron-LM's ``moe_*`` options). Aux losses in ``self.aux_loss`` (or attached
to the output with ``aux_scale``); ``self.stats`` per forward.
Design notes: docs/design/expert_parallel.md
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
    """``y = apply(x, aux, weight)`` is ``x``; backward also gives ``aux`` the gradient ``weight``
    (Megatron-LM's ``MoEAuxLossAutoScaler``)."""

    @staticmethod
    def forward(ctx, x, aux, weight: float):
        ctx.weight, ctx.aux_meta = weight, (aux.shape, aux.dtype, aux.device)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.aux_meta
        return grad, torch.full(shape, ctx.weight, dtype=dtype, device=device), None


class MoE(nn.Module):
    """Top-k mixture of MLP experts, expert-parallel over ``ep_group``; the routing statistics of
    the aux loss summed over ``stats_group`` (a group, or a tuple of groups: over their product).
    The capacity applies to each of ``drop_chunks`` equal contiguous chunks of the ``b·s`` tokens,
    or to each group ``drop_groups(b, s)`` gives (index tensors into the flattened tokens, in the
    order a rank holding them sees them: a one-process model standing for ranks that each hold
    scattered positions). ``ValueError``: bad ``top_k``, ``capacity_factor`` <= 0, unknown
    ``drop_policy``, input not 3-D, groups of unequal size."""

    def __init__(self, cfg: GPTConfig, num_experts: int, top_k: int = 1,
                 capacity_factor: float | None = None, drop_policy: str = "position",
                 normalize_topk: bool = False, aux_loss_coeff: float = 0.0,
                 z_loss_coeff: float = 0.0, ep_group=LOCAL, ep_size: int | None = None,
                 stats_group=LOCAL, capacity_group="ep", drop_chunks: int = 1, drop_groups=None):
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
        self.drop_chunks, self.drop_groups = drop_chunks, drop_groups
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
        """Copies leave the last forward's aux loss (a graph) behind."""
        state = dict(super().__getstate__())
        state["aux_loss"] = None
        return state

    def _groups(self, b: int, s: int, device) -> list[torch.Tensor]:
        """The token groups the capacity applies to, each in the order its rank holds them."""
        T, n = b * s, self.drop_chunks
        if self.drop_groups is not None:
            groups = [g.to(device) for g in self.drop_groups(b, s)]
            if len({len(g) for g in groups}) != 1 or sum(len(g) for g in groups) != T:
                raise ValueError(f"MoE (rank {self.ep_rank}): drop_groups must cut the {T} tokens "
                                 f"into groups of one size, got {[len(g) for g in groups]}")
            return groups
        if T % n:
            raise ValueError(f"MoE (rank {self.ep_rank}): {T} tokens do not split into "
                             f"drop_chunks={n} equal chunks")
        return list(torch.arange(T, device=device).view(n, T // n))

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
        capacity, groups = None, self._groups(b, s, flat.device)
        if self.capacity_factor is not None:
            local = torch.tensor([expert_capacity(len(groups[0]), E, k, self.capacity_factor)],
                                 device=flat.device)
            if group_rank_world(self.capacity_group)[1] > 1:
                all_reduce(local, op="max", group=self.capacity_group)
            capacity = int(local)
        kept = torch.empty_like(experts, dtype=torch.bool)
        for g in groups:
            kept[g] = keep_mask(experts[g], weights[g], E, capacity, self.drop_policy)
        out, moved = dispatch_combine(flat, experts, weights.to(flat.dtype), kept, E,
                                      list(self.experts), self.ep_group, self.ep_rank, self.ep_size)
        routed = torch.bincount(experts.reshape(-1), minlength=E)
        local_routed = routed.clone()
        total = torch.tensor([T * k], device=flat.device)
        groups = self.stats_group if isinstance(self.stats_group, tuple) else (self.stats_group,)
        if any(group_rank_world(g)[1] > 1 for g in groups):
            both = torch.cat([routed, total])
            for g in groups:   # over their product: the ranks whose tokens share the statistics
                if group_rank_world(g)[1] > 1:
                    all_reduce(both, op="sum", group=g)
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
