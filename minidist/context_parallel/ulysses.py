"""DeepSpeed-Ulysses (Jacobs et al. 2023, §3): trade the sequence split for a head split, attend
locally, trade back. The all-to-alls are autograd Functions (backward: the reverse all-to-all).
Design notes: docs/design/context_parallel.md
"""

from __future__ import annotations

import torch

from .. import collectives as C
from .blocks import attention_reference, compute_dtype
from ..comm.p2p import group_rank_world
from .sharding import agreed_length, positions

__all__ = ["ulysses_attention", "check_heads", "heads_of"]


def check_heads(heads: int, kv_heads: int, world: int, rank: int = 0) -> None:
    """``ValueError`` unless ``heads % world == 0`` and ``kv_heads % world == 0 or
    world % kv_heads == 0`` (and ``heads % kv_heads == 0``)."""
    where = f"ulysses_attention (rank {rank} of {world})"
    if heads % world:
        raise ValueError(f"{where}: {heads} attention heads do not divide over {world} ranks; "
                         f"Ulysses gives each rank heads/W heads, so W must divide {heads} "
                         "(or use ring attention, which splits the sequence only)")
    if heads % kv_heads:
        raise ValueError(f"{where}: {heads} query heads are not a multiple of {kv_heads} "
                         "key/value heads")
    if kv_heads % world and world % kv_heads:
        raise ValueError(f"{where}: {kv_heads} key/value heads on {world} ranks: need "
                         f"kv_heads % W == 0 or W % kv_heads == 0 ({kv_heads} % {world} = "
                         f"{kv_heads % world}, {world} % {kv_heads} = {world % kv_heads})")


def heads_of(rank: int, heads: int, world: int) -> list[int]:
    """The heads ``rank`` attends to (shared by several ranks when ``W % heads == 0``)."""
    if heads % world == 0:
        n = heads // world
        return list(range(rank * n, (rank + 1) * n))
    return [rank // (world // heads)]


def _seq_to_heads(x, group, heads_by_rank, pos_by_rank, rank, world):
    """``[b, H, S_r, d]`` -> ``[b, |heads_by_rank[rank]|, S, d]`` in sequence order."""
    b, _, _, d = x.shape
    mine = len(heads_by_rank[rank])
    send = [x[:, heads_by_rank[j]].contiguous() for j in range(world)]
    recv = [x.new_empty(b, mine, pos_by_rank[j].numel(), d) for j in range(world)]
    if world > 1:
        C.all_to_all(recv, send, group=group)
    else:
        recv = send
    seq = torch.cat(recv, dim=2)
    out = seq.new_empty(seq.shape)
    return out.index_copy_(2, torch.cat(pos_by_rank).to(x.device), seq)


def _heads_to_seq(y, group, heads_by_rank, pos_by_rank, rank, world, heads):
    """The adjoint of :func:`_seq_to_heads`, summing a replicated head's gradient."""
    b, _, _, d = y.shape
    send = [y.index_select(2, pos_by_rank[j].to(y.device)).contiguous() for j in range(world)]
    recv = [y.new_empty(b, len(heads_by_rank[j]), pos_by_rank[rank].numel(), d)
            for j in range(world)]
    if world > 1:
        C.all_to_all(recv, send, group=group)
    else:
        recv = send
    out = y.new_zeros(b, heads, pos_by_rank[rank].numel(), d)
    for j in range(world):
        out.index_add_(1, torch.tensor(heads_by_rank[j], device=y.device), recv[j])
    return out


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, heads_by_rank, pos_by_rank, rank, world):
        ctx.args = (group, heads_by_rank, pos_by_rank, rank, world, x.shape[1])
        return _seq_to_heads(x, group, heads_by_rank, pos_by_rank, rank, world)

    @staticmethod
    def backward(ctx, g):
        return (_heads_to_seq(g.contiguous(), *ctx.args), None, None, None, None, None)


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group, heads_by_rank, pos_by_rank, rank, world, heads):
        ctx.args = (group, heads_by_rank, pos_by_rank, rank, world)
        return _heads_to_seq(y, group, heads_by_rank, pos_by_rank, rank, world, heads)

    @staticmethod
    def backward(ctx, g):
        return (_seq_to_heads(g.contiguous(), *ctx.args), None, None, None, None, None, None)


def ulysses_attention(q, k, v, group=None, split: str = "zigzag", seq_len: int | None = None,
                      causal: bool = True, scale: float | None = None):
    """Full attention of this rank's positions by all-to-all; as :func:`.ring.ring_attention`.
    ``ValueError`` for ``H % W``, the K/V head rule, or a local length that does not fit the split."""
    rank, world = group_rank_world(group)
    b, heads, s, d = q.shape
    kv_heads = k.shape[1]
    check_heads(heads, kv_heads, world, rank)
    if seq_len is None:
        seq_len = (agreed_length(s, group, f"ulysses_attention (rank {rank} of {world})", world,
                                 q.device)
                   if world > 1 else s)
    pos = [positions(split, seq_len, world, r) for r in range(world)]
    if pos[rank].numel() != s or k.shape[2] != s or v.shape != k.shape:
        raise ValueError(f"ulysses_attention (rank {rank} of {world}): q holds {s} positions, "
                         f"k/v {tuple(k.shape)}, but the {split} split of {seq_len} gives this "
                         f"rank {pos[rank].numel()}; pass seq_len= when S does not divide evenly")
    qh = [heads_of(r, heads, world) for r in range(world)]
    kh = [heads_of(r, kv_heads, world) for r in range(world)]
    q_, k_, v_ = (_SeqToHeads.apply(t.contiguous(), group, hh, pos, rank, world)
                  for t, hh in ((q, qh), (k, kh), (v, kh)))
    cdt = compute_dtype(q.dtype)   # bf16/fp16: the local attention in fp32, as in ring
    out, lse = attention_reference(q_.to(cdt), k_.to(cdt), v_.to(cdt), causal, scale)
    out = _HeadsToSeq.apply(out.to(q.dtype).contiguous(), group, qh, pos, rank, world, heads)
    lse = _HeadsToSeq.apply(lse.unsqueeze(-1).contiguous(), group, qh, pos, rank, world, heads)
    return out, lse.squeeze(-1).detach()
