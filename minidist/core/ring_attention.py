"""Ring attention: context parallelism's attention, the K/V blocks passed around the CP ring.

Each of the W ranks of a context-parallel group holds the queries, keys and values of its
positions (a contiguous, zigzag or striped split). At step t it attends to the K/V block of rank
(r - t) mod W while the block travels on to rank r + 1, and merges each partial result into its
running output by log-sum-exp. The backward recomputes each block's probabilities from the final
LSE; each block's dK/dV accumulator travels with the block and reaches home at the last hop.
Sources: Liu et al. 2023 (Ring Attention) §3; Brandon et al. 2023 (Striped Attention) and
Megatron-LM's zigzag split for causal balance; FlashAttention-2 (Dao 2023) Algorithm 2;
torch.distributed.tensor.experimental.context_parallel.
"""

import torch
import torch.distributed as dist

NEG_INF = float("-inf")


def runs(split, seq_len, world, rank):
    """The global positions ``rank`` holds, as runs: zigzag holds chunks r and 2W-1-r of 2W."""
    pos = torch.arange(seq_len)
    if split == "contiguous":
        parts = [pos.tensor_split(world)[rank]]
    elif split == "zigzag":
        chunks = pos.tensor_split(2 * world)
        parts = [chunks[rank], chunks[2 * world - 1 - rank]]
    else:  # striped: positions r, r + W, r + 2W, ...
        parts = [pos[rank::world]]
    return [p for p in parts if len(p)]


def log_add_exp(a, b):
    """``log(exp(a) + exp(b))`` without overflow: ``max + log1p(exp(-|a - b|))``."""
    m = torch.maximum(a, b)
    out = m + torch.log1p(torch.exp(-(a - b).abs()))
    return torch.where(m == NEG_INF, m, out)     # both -inf (no key seen yet): -inf


def _finite(lse):   # a query row with no visible key has lse -inf: use 0, so exp(s - lse) is 0
    return torch.where(lse == NEG_INF, torch.zeros_like(lse), lse)


def merge(out, lse, block_out, block_lse):
    """Merge one block's ``(out [b, h, s, d], lse [b, h, s])`` into the running result."""
    new = log_add_exp(lse, block_lse)
    w_old = torch.exp(lse - _finite(new)).unsqueeze(-1)
    w_block = torch.exp(block_lse - _finite(new)).unsqueeze(-1)
    return w_old * out + w_block * block_out, new


def _scores(q, k, mask, scale):
    s = (q @ k.transpose(-2, -1)) * scale
    return s if mask is None else s.masked_fill(~mask, NEG_INF)


def block_attention(q, k, v, mask, scale):
    """Queries ``[b, h, s_q, d]`` on one key block: ``(out, lse)``; ``mask [s_q, s_k]``: visible."""
    s = _scores(q, k, mask, scale)
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - _finite(lse).unsqueeze(-1)) @ v, lse


def block_grads(q, k, v, do, lse, delta, mask, scale):
    """``(dq, dk, dv)`` of one block from the global ``lse`` and ``delta = sum_d dO * O``."""
    p = torch.exp(_scores(q, k, mask, scale) - _finite(lse).unsqueeze(-1))
    ds = p * (do @ v.transpose(-2, -1) - delta.unsqueeze(-1))
    return (ds @ k) * scale, (ds.transpose(-2, -1) @ q) * scale, p.transpose(-2, -1) @ do


def _pairs(q_runs, k_runs, causal, device):
    """(query slice, key slice, mask) of each (query run, key run) pair with a visible key."""
    qa = 0
    for qp in q_runs:
        ka = 0
        for kp in k_runs:
            mask = (kp[None, :] <= qp[:, None]).to(device) if causal else None
            if mask is None or mask.any():
                yield slice(qa, qa + len(qp)), slice(ka, ka + len(kp)), mask
            ka += len(kp)
        qa += len(qp)


def _pass_on(send, n, rank, world, group, tag):
    """Post the send of ``send [2, b, h, s, d]`` to the next rank of the ring and the receive of
    the previous rank's (``n`` positions): ``(receive buffer, works)``."""
    recv = send.new_empty(send.shape[:3] + (n, send.shape[4]))
    return recv, [dist.irecv(recv, group=group, group_src=(rank - 1) % world, tag=tag),
                  dist.isend(send, group=group, group_dst=(rank + 1) % world, tag=tag)]


def _wait(works):
    for w in works:
        w.wait()


class RingAttention(torch.autograd.Function):
    """``(out, lse) = RingAttention.apply(q, k, v, seq_len, split, group, causal, scale)``."""

    @staticmethod
    def forward(ctx, q, k, v, seq_len, split, group, causal, scale):
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        layout = [runs(split, seq_len, world, r) for r in range(world)]
        size = [sum(len(p) for p in rr) for rr in layout]
        out, lse = torch.zeros_like(q), q.new_full(q.shape[:3], NEG_INF)
        kv = torch.stack([k, v])                          # K and V travel as one message
        for t in range(world):
            src = (rank - t) % world                      # whose block this rank holds now
            if t < world - 1:                             # post the next transfer, then compute
                incoming, works = _pass_on(kv, size[(src - 1) % world], rank, world, group, 1)
            for qs, ks, mask in _pairs(layout[rank], layout[src], causal, q.device):
                o, l = block_attention(q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], mask, scale)
                out[:, :, qs], lse[:, :, qs] = merge(out[:, :, qs], lse[:, :, qs], o, l)
            if t < world - 1:
                _wait(works)
                kv = incoming
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout, ctx.size, ctx.group, ctx.causal, ctx.scale = layout, size, group, causal, scale
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        layout, size, group, causal, scale = ctx.layout, ctx.size, ctx.group, ctx.causal, ctx.scale
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        delta = (dout * out).sum(-1)
        dq = torch.zeros_like(q)
        kv = torch.stack([k, v])
        dkv_in, grad_works = None, []
        for t in range(world):
            src = (rank - t) % world
            if t < world - 1:
                incoming, works = _pass_on(kv, size[(src - 1) % world], rank, world, group, 1)
            dkv = torch.zeros_like(kv)                    # this rank's share of src's dK, dV
            for qs, ks, mask in _pairs(layout[rank], layout[src], causal, q.device):
                dq_, dk, dv = block_grads(q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks],
                                          dout[:, :, qs], lse[:, :, qs], delta[:, :, qs],
                                          mask, scale)
                dq[:, :, qs] += dq_
                dkv[0][:, :, ks] += dk
                dkv[1][:, :, ks] += dv
            if t > 0:                                     # the shares of the ranks before
                _wait(grad_works)
                dkv += dkv_in
            if t < world - 1:
                _wait(works)
                kv = incoming
            if world > 1:                                 # the accumulator goes on with its block
                dkv_in, grad_works = _pass_on(dkv, size[(src - 1) % world], rank, world, group, 2)
        if world > 1:                                     # the last hop brings it home
            _wait(grad_works)
            dkv = dkv_in
        return dq, dkv[0], dkv[1], None, None, None, None, None


def ring_attention(q, k, v, seq_len, split="zigzag", group=None, causal=True, scale=None):
    """This rank's queries ``[b, h, s_r, d]`` attending to the whole sequence of ``seq_len``
    positions over the CP ``group``: ``(out [b, h, s_r, d], lse [b, h, s_r])``."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return RingAttention.apply(q, k, v, seq_len, split, group, causal, scale)
