"""Ring attention: each rank keeps its queries; the K/V blocks travel around the ring.

Liu, Zaharia & Abbeel 2023, §3; zigzag split as Megatron-LM. Forward merges each block's partial
result by log-add-exp; the hand-written backward sends the K/V blocks again, each with its dK/dV.
Design notes: docs/design/context_parallel.md
"""

from __future__ import annotations

import torch

from ..comm import p2p
from ..comm.p2p import group_rank_world
from ..trace import span
from .blocks import block_backward, block_forward, compute_dtype, merge
from .sharding import SPLITS, agreed_length, block_kind, chunks

__all__ = ["ring_attention", "RingAttention", "ring_traffic"]

_KV, _DKV = 1, 2   # tags: the K/V block and its gradient accumulator are different messages



class _Layout:
    """Every rank's runs of positions, and where each run sits in that rank's local tensors."""

    def __init__(self, split, seq_len, world, causal):
        self.world, self.causal = world, causal
        self.runs = [chunks(split, seq_len, world, r) for r in range(world)]
        self.sizes = [sum(int(x.numel()) for x in rr) for rr in self.runs]
        self.slices = []
        for rr in self.runs:
            at, sl = 0, []
            for x in rr:
                sl.append(slice(at, at + x.numel()))
                at += x.numel()
            self.slices.append(sl)

    def pairs(self, me, src, device):
        """(query slice, query positions, key slice, key positions, kind) of non-skipped pairs."""
        for qs, qp in zip(self.slices[me], self.runs[me]):
            for ks, kp in zip(self.slices[src], self.runs[src]):
                kind = block_kind(qp, kp, self.causal)
                if kind != "skipped":
                    yield qs, qp.to(device), ks, kp.to(device), kind


def _check(q, k, v, split, seq_len, rank, world, group=None):
    where = f"ring_attention (rank {rank} of {world})"
    if split not in SPLITS:
        raise ValueError(f"{where}: split must be one of {SPLITS}, got {split!r}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"{where}: q, k, v must be [batch, heads, seq, head_dim]; got shapes "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2:] != q.shape[2:]:
        raise ValueError(f"{where}: k and v must be [b, h_kv, s, d] matching q {tuple(q.shape)} "
                         f"in batch, sequence and head_dim; got {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{where}: {q.shape[1]} query heads are not a multiple of the "
                         f"{k.shape[1]} key/value heads")
    if seq_len is None:
        seq_len = agreed_length(q.shape[2], group, where, world, q.device) if world > 1 else q.shape[2]
    expected = sum(int(x.numel()) for x in chunks(split, seq_len, world, rank))
    if q.shape[2] != expected:
        raise ValueError(f"{where}: q holds {q.shape[2]} positions, but the {split} split of a "
                         f"sequence of {seq_len} over {world} ranks gives this rank {expected}; "
                         "shard with context_parallel.shard(x, split, world, rank, dim=2) and pass "
                         "seq_len= when the sequence does not divide evenly")
    return seq_len


class RingAttention(torch.autograd.Function):
    """``(out, lse) = RingAttention.apply(q, k, v, group, split, seq_len, causal, scale)``."""

    @staticmethod
    def forward(ctx, q, k, v, group, split, seq_len, causal, scale):
        rank, world = group_rank_world(group)
        lay = _Layout(split, seq_len, world, causal)
        cdt = compute_dtype(q.dtype)
        qc = q.to(cdt)
        b, h, s, d = q.shape
        out = torch.zeros(b, h, s, d, dtype=cdt, device=q.device)
        lse = torch.full((b, h, s), float("-inf"), dtype=cdt, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        with p2p.collective("cp/ring_attention/forward"):
            for t in range(world):
                src = (rank - t) % world
                works = []
                if t < world - 1:   # post the next block's transfer before this block's compute
                    incoming = kv.new_empty(2, b, k.shape[1], lay.sizes[(src - 1) % world], d)
                    works = [p2p.irecv(incoming, prv, group, _KV), p2p.isend(kv, nxt, group, _KV)]
                with span(f"fwd {t}", "compute", rank=rank, stage=t):
                    kc = kv.to(cdt)
                    for qs, qp, ks, kp, kind in lay.pairs(rank, src, q.device):
                        o, l = block_forward(qc[:, :, qs], kc[0][:, :, ks], kc[1][:, :, ks], qp,
                                             kp, kind, scale)
                        out[:, :, qs], lse[:, :, qs] = merge(out[:, :, qs], lse[:, :, qs], o, l)
                with span("wait", "comm", rank=rank, stage=t):
                    p2p.wait_all(works)
                if works:
                    kv = incoming
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.lay, ctx.group, ctx.scale = lay, group, scale
        ctx.mark_non_differentiable(lse)
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        lay, group, scale = ctx.lay, ctx.group, ctx.scale
        rank, world = group_rank_world(group)
        cdt = out.dtype
        qc, do = q.to(cdt), dout.to(cdt)
        delta = (do * out).sum(-1)
        dq = torch.zeros_like(qc)
        b, h_kv, d = k.shape[0], k.shape[1], k.shape[3]
        kv = torch.stack([k, v]).contiguous()
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        dkv_in, dkv_works, sent = None, [], []
        with p2p.collective("cp/ring_attention/backward"):
            for t in range(world):
                src = (rank - t) % world
                works = []
                if t < world - 1:
                    incoming = kv.new_empty(2, b, h_kv, lay.sizes[(src - 1) % world], d)
                    works = [p2p.irecv(incoming, prv, group, _KV), p2p.isend(kv, nxt, group, _KV)]
                with span(f"bwd {t}", "compute", rank=rank, stage=t):
                    kc = kv.to(cdt)
                    dkv = torch.zeros(2, b, h_kv, lay.sizes[src], d, dtype=cdt, device=q.device)
                    for qs, qp, ks, kp, kind in lay.pairs(rank, src, q.device):
                        dq_, dk_, dv_ = block_backward(qc[:, :, qs], kc[0][:, :, ks],
                                                       kc[1][:, :, ks], do[:, :, qs],
                                                       lse[:, :, qs], delta[:, :, qs], qp, kp,
                                                       kind, scale)
                        dq[:, :, qs] += dq_
                        dkv[0][:, :, ks] += dk_
                        dkv[1][:, :, ks] += dv_
                with span("wait", "comm", rank=rank, stage=t):
                    if t > 0:   # the accumulator of this block, from the ranks that held it before
                        p2p.wait_all(dkv_works)
                        dkv += dkv_in
                    p2p.wait_all(works)
                if world > 1:   # pass the accumulator on with its block; the last hop: home
                    dkv_in = dkv.new_empty(2, b, h_kv, lay.sizes[(src - 1) % world], d)
                    sent.append(dkv)
                    dkv_works = [p2p.irecv(dkv_in, prv, group, _DKV),
                                 p2p.isend(dkv, nxt, group, _DKV)]
                if works:
                    kv = incoming
            if world > 1:
                p2p.wait_all(dkv_works)
                dkv = dkv_in
        return (dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None,
                None)


def ring_attention(q, k, v, group=None, split: str = "zigzag", seq_len: int | None = None,
                   causal: bool = True, scale: float | None = None):
    """Attention of this rank's queries to the whole (context-parallel) sequence.

    ``q`` ``[b, h, s_r, d]``, ``k``/``v`` ``[b, h_kv, s_r, d]``; ``split``: contiguous, zigzag or
    striped; ``seq_len``: the global ``S`` (None: agreed over the group). Returns
    ``(out [b, h, s_r, d], lse [b, h, s_r])``, differentiable. ``ValueError`` (naming the rank) for
    shapes, heads, a local length that does not fit the split, or ranks of different lengths."""
    rank, world = group_rank_world(group)
    seq_len = _check(q, k, v, split, seq_len, rank, world, group)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return RingAttention.apply(q, k, v, group, split, seq_len, causal, scale)


def ring_traffic(split: str, seq_len: int, world: int, rank: int, batch: int, kv_heads: int,
                 head_dim: int, element_size: int, grad_element_size: int | None = None) -> dict:
    """The messages and bytes ``rank`` sends forward and backward (formula, not measured)."""
    grad_element_size = element_size if grad_element_size is None else grad_element_size
    sizes = [sum(int(x.numel()) for x in chunks(split, seq_len, world, r)) for r in range(world)]
    per_pos = 2 * batch * kv_heads * head_dim
    if world == 1:
        return {"forward": (0, 0), "backward": (0, 0)}
    kv = [sizes[(rank - t) % world] for t in range(world - 1)]
    acc = [sizes[(rank - t) % world] for t in range(world)]
    fwd = (sum(1 for s in kv if s), sum(kv) * per_pos * element_size)
    bwd = (fwd[0] + sum(1 for s in acc if s),
           fwd[1] + sum(acc) * per_pos * grad_element_size)
    return {"forward": fwd, "backward": bwd}
