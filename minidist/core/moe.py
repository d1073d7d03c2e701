"""Mixture of experts with expert parallelism: top-k routing and the all-to-all dispatch.

A router (a linear layer h -> E in fp32, a softmax, the top-k) picks k experts per token; an
expert accepts at most its capacity of rows, the rest are dropped. The E experts are split over
the W ranks of an EP group in contiguous blocks of ceil(E / W). The rows travel to the ranks
holding their experts by an all-to-all with uneven splits (the split sizes exchanged first), the
local experts run, and the reverse all-to-all brings the results back, weighted by the router.
Sources: GShard (Lepikhin et al. 2020) §2.2 and Algorithm 1; Switch Transformer (Fedus et al.
2021) §2; Megatron-LM's MoEAlltoAllTokenDispatcher and get_capacity.
"""

import math
from fractions import Fraction

import torch
import torch.distributed as dist


def route(logits, k, normalize=False):
    """``logits [T, E]`` -> ``(probs [T, E], experts [T, k], weights [T, k])``, all fp32.
    Ties go to the lower expert index (a stable sort), so every rank chooses alike."""
    probs = logits.float().softmax(dim=-1)
    experts = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :k]
    weights = probs.gather(1, experts)
    if normalize:                                  # Mixtral, GShard top-2: weights sum to 1
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return probs, experts, weights


def capacity(num_tokens, num_experts, k, factor):
    """Rows one expert accepts: ``ceil(T * k * factor / E)``, exact (the factor as its decimal)."""
    return math.ceil(Fraction(num_tokens * k) * Fraction(repr(float(factor))) / num_experts)


def keep_mask(experts, num_experts, cap):
    """``[T, k]`` bool, GShard's rule: first choices in token order, then second choices, ...;
    an assignment is kept if fewer than ``cap`` come before it at the same expert."""
    T, k = experts.shape
    flat = experts.t().reshape(-1)                 # (choice j, token t) at j * T + t
    onehot = torch.nn.functional.one_hot(flat, num_experts)
    place = (onehot.cumsum(0) * onehot).sum(1) - 1     # its place in its expert's queue
    return (place < cap).view(k, T).t()


def load_balancing_loss(probs, experts, coeff):
    """Switch's ``coeff * E * sum_i f_i * P_i``: f_i the share of the T*k assignments routed to
    expert i (no gradient), P_i the mean router probability of expert i."""
    E = probs.shape[-1]
    f = torch.bincount(experts.reshape(-1), minlength=E).float() / experts.numel()
    return coeff * E * (f * probs.mean(dim=0)).sum()


class AllToAll(torch.autograd.Function):
    """Rows ``x``: ``send[j]`` rows go to rank j, ``recv[j]`` come from rank j. The backward is
    the same all-to-all with the splits swapped: gradients go back where the rows came from."""

    @staticmethod
    def forward(ctx, x, send, recv, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv),) + x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return AllToAll.apply(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def local_experts(num_experts, world, rank):
    """The experts EP rank ``rank`` holds: a contiguous block of ``ceil(E / W)`` (maybe fewer)."""
    c = math.ceil(num_experts / world)
    return list(range(min(rank * c, num_experts), min((rank + 1) * c, num_experts)))


def dispatch_combine(x, experts, weights, kept, num_experts, expert_modules, group=None):
    """``x [T, h]``, ``experts, weights, kept [T, k]``; ``expert_modules``: this rank's experts.
    Returns ``out [T, h]``, ``out[t] = sum_j kept * weight_j * expert_{e_j}(x[t])``."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    E, k, c = num_experts, experts.shape[1], math.ceil(num_experts / world)
    # 1. count the kept rows per expert (a dropped row counts for the dummy expert E)
    key = torch.where(kept, experts, torch.full_like(experts, E)).reshape(-1)
    counts = torch.bincount(key, minlength=E + 1)[:E]
    # 2. exchange the counts: rank j learns how many rows each rank sends to each of its experts
    padded = torch.zeros(world * c, dtype=torch.int64, device=x.device)
    padded[:E] = counts
    recv_counts = torch.empty_like(padded)
    dist.all_to_all_single(recv_counts, padded, group=group)
    n_local = len(local_experts(E, world, rank))
    recv_counts = recv_counts.view(world, c)[:, :n_local]       # [source rank, local expert]
    send, recv = padded.view(world, c).sum(1).tolist(), recv_counts.sum(1).tolist()
    # 3. permute the rows expert-major (token order within an expert)
    order = torch.sort(key, stable=True).indices[: int(counts.sum())]
    token, row_weight = order // k, weights.reshape(-1)[order]
    # 4. all-to-all with uneven splits: the rows to the ranks holding their experts
    received = AllToAll.apply(x.index_select(0, token), send, recv, group)
    # 5. the local experts, on their rows regrouped [source][expert] -> [expert][source]
    processed = received
    if n_local:
        label = torch.arange(n_local, device=x.device).repeat(world)
        idx = torch.sort(label.repeat_interleave(recv_counts.reshape(-1)), stable=True).indices
        pieces = received.index_select(0, idx).split(recv_counts.sum(0).tolist())
        outs = torch.cat([m(p) for m, p in zip(expert_modules, pieces)])
        processed = outs.index_select(0, torch.argsort(idx))
    # 6. the reverse all-to-all, then un-permute: each row weighted, a token's k rows summed
    returned = AllToAll.apply(processed, recv, send, group)
    returned = returned * row_weight.to(returned.dtype).unsqueeze(-1)
    return returned.new_zeros(x.shape[0], returned.shape[-1]).index_add(0, token, returned)


def moe(x, router_weight, expert_modules, num_experts, k, capacity_factor=None, group=None):
    """The MoE layer: ``x [T, h]`` -> ``[T, h]``; ``router_weight [E, h]``; dropless if
    ``capacity_factor`` is None."""
    logits = torch.nn.functional.linear(x.float(), router_weight.float())
    probs, experts, weights = route(logits, k)
    kept = torch.ones_like(experts, dtype=torch.bool)
    if capacity_factor is not None:
        kept = keep_mask(experts, num_experts, capacity(x.shape[0], num_experts, k,
                                                        capacity_factor))
    return dispatch_combine(x, experts, weights.to(x.dtype), kept, num_experts, expert_modules,
                            group)
