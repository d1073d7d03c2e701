"""Permute tokens expert-major and back: the local half of the dispatch (Megatron-LM's ``permute``).
Design notes: docs/design/expert_parallel.md
"""

from __future__ import annotations

import torch

__all__ = ["permutation", "permute", "regroup_index", "split_sizes", "unpermute"]


def permutation(experts: torch.Tensor, weights: torch.Tensor, kept: torch.Tensor, num_experts: int):
    """``experts, weights, kept [T, k]`` -> ``(token_index [N], row_weights [N], counts [E])``:
    the kept rows in expert order."""
    k = experts.shape[1]
    key = torch.where(kept, experts, torch.full_like(experts, num_experts)).reshape(-1)
    order = torch.sort(key, stable=True).indices               # token-major flat order kept stable
    counts = torch.bincount(key, minlength=num_experts + 1)[:num_experts]
    order = order[: int(counts.sum())]
    return order // k, weights.reshape(-1)[order], counts


def permute(x: torch.Tensor, token_index: torch.Tensor) -> torch.Tensor:
    """``x [T, h]`` → ``[N, h]``, row n = ``x[token_index[n]]``."""
    return x.index_select(0, token_index)


def unpermute(rows: torch.Tensor, token_index: torch.Tensor, row_weights: torch.Tensor | None,
              num_tokens: int) -> torch.Tensor:
    """``rows [N, h]`` -> ``[T, h]``: ``out[t] = Σ row_weights[n] · rows[n]`` over the rows of t (else 0)."""
    if row_weights is not None:
        rows = rows * row_weights.to(rows.dtype).unsqueeze(-1)
    out = rows.new_zeros(num_tokens, rows.shape[-1])
    return out.index_add(0, token_index, rows)


def split_sizes(counts: torch.Tensor, experts_per_rank: int, world: int) -> list[int]:
    """Rows per destination rank: rank j owns experts ``[j·c, (j+1)·c)``, ``c = experts_per_rank``."""
    padded = torch.zeros(world * experts_per_rank, dtype=torch.int64)
    padded[: counts.numel()] = counts.cpu()
    return padded.view(world, experts_per_rank).sum(1).tolist()


def regroup_index(recv_counts: torch.Tensor) -> torch.Tensor:
    """``recv_counts [W, L]`` -> the index reordering rows ``[source][expert]`` to ``[expert][source]``."""
    W, L = recv_counts.shape
    flat = recv_counts.reshape(-1)
    starts = torch.cumsum(flat, 0) - flat
    pieces = [torch.arange(int(starts[j * L + e]), int(starts[j * L + e] + flat[j * L + e]),
                           device=recv_counts.device) for e in range(L) for j in range(W)]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64,
                                                        device=recv_counts.device)
