"""An independent one-process MoE: every expert on every token, the drop rule as a Python loop.

Nothing here shares code with :mod:`.permute` or :mod:`.dispatch`: no permutation, no all-to-all.
The output is ``Σ_e combine[t, e] · expert_e(x[t])`` with a dense ``combine [T, E]`` matrix
(GShard's dispatch/combine tensors, Lepikhin et al. 2020 §2.2), so a wrong index in the
expert-parallel path cannot be mirrored here.

``chunks``: the drop rule is applied to each of ``chunks`` equal consecutive slices of the tokens
separately, with one ``capacity`` — what expert parallelism does when each of ``chunks`` ranks
holds one slice (capacity is per expert per source rank: Megatron-LM, DeepSpeed).
"""

from __future__ import annotations

import torch

from minidist.expert_parallel.router import load_balancing_loss, route, z_loss

__all__ = ["dense_moe", "kept_by_loop"]


def kept_by_loop(experts: torch.Tensor, probs_chosen: torch.Tensor, capacity: int | None,
                 policy: str = "position") -> list[list[bool]]:
    """``[T][k]`` booleans by walking the assignments in priority order with a counter per expert."""
    T, k = experts.shape
    keep = [[True] * k for _ in range(T)]
    if capacity is None:
        return keep
    order = [(j, t) for j in range(k) for t in range(T)]       # choice-major, then token order
    if policy == "probs":                                       # Python's sort is stable
        order.sort(key=lambda jt: -float(probs_chosen[jt[1], jt[0]].detach()))
    used: dict[int, int] = {}
    for j, t in order:
        e = int(experts[t, j])
        keep[t][j] = used.get(e, 0) < capacity
        used[e] = used.get(e, 0) + 1
    return keep


def dense_moe(x: torch.Tensor, router_weight: torch.Tensor, experts, top_k: int,
              capacity: int | None = None, chunks: int = 1, policy: str = "position",
              normalize_topk: bool = False, aux_loss_coeff: float = 0.0,
              z_loss_coeff: float = 0.0):
    """``x [T, h]`` → ``(out [T, h], aux 0-dim, kept [T, k] bool)``; ``experts``: all E modules.

    The aux loss is taken over all T tokens (the global batch's statistics).
    """
    T = x.shape[0]
    if T % chunks:
        raise ValueError(f"dense_moe: {T} tokens do not split into {chunks} equal chunks")
    logits = x.float() @ router_weight.float().t()
    probs, chosen, weights = route(logits, top_k, normalize_topk)
    n = T // chunks
    keep = []
    for c in range(chunks):
        keep += kept_by_loop(chosen[c * n:(c + 1) * n], weights[c * n:(c + 1) * n], capacity,
                             policy)
    kept = torch.tensor(keep, dtype=torch.bool, device=x.device).view(T, top_k)
    combine = torch.zeros(T, len(experts), dtype=torch.float32, device=x.device)
    combine = combine.scatter_add(1, chosen, torch.where(kept, weights, torch.zeros_like(weights)))
    every = torch.stack([e(x) for e in experts], dim=1)             # [T, E, h]
    out = (combine.to(x.dtype).unsqueeze(-1) * every).sum(1)
    aux = logits.new_zeros(())
    if aux_loss_coeff:
        routed = torch.bincount(chosen.reshape(-1), minlength=len(experts))
        aux = aux + load_balancing_loss(probs, routed, T * top_k, aux_loss_coeff)
    if z_loss_coeff:
        aux = aux + z_loss(logits, z_loss_coeff)
    return out, aux, kept
