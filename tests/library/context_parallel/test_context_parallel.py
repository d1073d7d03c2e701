"""Context parallelism (minidist.context_parallel) against one process on the whole sequence.

One launch per world size W = 1..4 runs every case and returns each rank's shard; the test
process unshards and compares with :func:`attention_reference` (plain autograd, one process):
output, LSE, dQ, dK, dV (the fp32 runs against fp64 arithmetic on the same fp32 inputs), for
ring attention under the contiguous, zigzag and striped splits and for Ulysses, fp64 and fp32,
causal and not, two sequence lengths (one divisible by 2W, one not), batch 2, 12 query heads,
full and grouped-query K/V heads.

Tolerances (max abs error relative to max(1, the tensor's max abs value)): fp64 1e-12; fp32
1e-6·W for out and lse (the merge order differs from the one-process softmax, once per ring
step), 2e-6·W for dQ, dK, dV: the backward recomputes P = exp(S - lse) from the stored lse, whose
rounding (half an ulp of |lse| ~ 4, 2.4e-7) is a relative error of every P — the
FlashAttention-2 backward's known property. Measured at W=1 (no communication at all): up to
1.1e-6 for dK, where torch's fp32 autograd on the same inputs gives 2-4e-7.

The same launch checks the exact messages and bytes each rank sends against
:func:`ring_traffic`, a stale-K/V backward and local positions (both caught), the loss over a
sharded sequence, and sequences shorter than W (ranks with empty shards: nothing sent to or from
them, results still equal).
"""

import math

import pytest
import torch
import torch.nn.functional as F

import minidist
from minidist.trace import Timeline
from minidist.comm import p2p
from minidist.context_parallel import (SPLITS, attention_reference, block_kind, block_table,
                                       causal_work, chunks, computed_work, log_add_exp, merge,
                                       naive_log_add_exp, ring, ring_attention, ring_traffic,
                                       shard, sharded_cross_entropy, split_positions, unshard,
                                       ulysses_attention)
from minidist.context_parallel.blocks import block_forward
from minidist.context_parallel.positions import learned, rotary

B, H, D = 2, 12, 4
KV_SMALL = {1: 4, 2: 1, 3: 3, 4: 2}     # grouped K/V heads: kv % W == 0 or W % kv == 0
TOL = {torch.float64: 1e-12, torch.float32: 1e-6}
METHODS = [("ring", s) for s in SPLITS] + [("ulysses", "zigzag"), ("ulysses", "contiguous")]


# ---------------------------------------------------------------- one process: splits and rules
@pytest.mark.parametrize("split", SPLITS)
def test_split_and_inverse_cover_every_position_once(split):
    for world in (1, 2, 3, 4):
        for seq_len in (0, 1, 5, 2 * world, 2 * world + 1, 17, 32):
            parts = [split_positions(split, seq_len, world, r) for r in range(world)]
            assert sorted(torch.cat(parts).tolist()) == list(range(seq_len))
            x = torch.randn(2, seq_len, 3)
            shards = [shard(x, split, world, r, dim=1) for r in range(world)]
            assert torch.equal(unshard(shards, split, dim=1), x)
            sizes = [p.numel() for p in parts]
            assert max(sizes) - min(sizes) <= (2 if split == "zigzag" else 1)
    with pytest.raises(ValueError, match="split must be one of"):
        split_positions("diagonal", 8, 2, 0)
    with pytest.raises(ValueError, match="rank 0's slice has 3 positions"):
        unshard([torch.zeros(1, 3), torch.zeros(1, 4)], "contiguous")


def test_zigzag_pairs_chunk_r_with_chunk_2w_minus_1_minus_r():
    assert [c.tolist() for c in chunks("zigzag", 16, 4, 1)] == [[2, 3], [12, 13]]
    assert split_positions("zigzag", 16, 4, 0).tolist() == [0, 1, 14, 15]
    assert split_positions("striped", 16, 4, 3).tolist() == [3, 7, 11, 15]


def test_causal_work_contiguous_is_imbalanced_zigzag_is_equal():
    assert causal_work("contiguous", 32, 4) == [36, 100, 164, 228]
    assert causal_work("zigzag", 32, 4) == [132] * 4
    for world in (1, 2, 3, 4):
        for seq_len in (8 * world, 40 * world):
            z = causal_work("zigzag", seq_len, world)
            assert len(set(z)) == 1 and sum(z) == seq_len * (seq_len + 1) // 2
            c = causal_work("contiguous", seq_len, world)
            if world > 1:
                assert c == sorted(c) and c[-1] > c[0]
    # what the blocks cost when diagonal blocks are computed whole: zigzag still equal
    assert computed_work("zigzag", 32, 4) == [144] * 4
    assert computed_work("contiguous", 32, 4) == [64, 128, 192, 256]


def _kinds_contiguous(world):
    return {(i, j): ["full" if j < i else "diagonal" if j == i else "skipped"]
            for i in range(world) for j in range(world)}


def _kinds_zigzag(world):
    """Rank i holds chunks (i, 2W-1-i). Key rank j < i: both query runs see j's early run fully,
    not its late one; j > i: the early query run sees nothing, the late one everything; j = i:
    each run's own diagonal, and the late query run sees the early key run fully."""
    out = {}
    for i in range(world):
        for j in range(world):
            if j < i:
                out[(i, j)] = ["full", "skipped", "full", "skipped"]
            elif j > i:
                out[(i, j)] = ["skipped", "skipped", "full", "full"]
            else:
                out[(i, j)] = ["diagonal", "skipped", "full", "diagonal"]
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_block_mask_table_per_split(world):
    """The rule, tabled for contiguous and zigzag, and checked against the element-wise mask for
    every split: 'full' blocks are all visible, 'skipped' none, 'diagonal' some but not all."""
    seq_len = 4 * world
    assert block_table("contiguous", seq_len, world) == _kinds_contiguous(world)
    assert block_table("zigzag", seq_len, world) == _kinds_zigzag(world)
    for split in SPLITS:
        for i in range(world):
            for j in range(world):
                for a in chunks(split, seq_len, world, i):
                    for b in chunks(split, seq_len, world, j):
                        mask = b.view(1, -1) <= a.view(-1, 1)
                        kind = block_kind(a, b)
                        assert kind == ("full" if mask.all() else "skipped" if not mask.any()
                                        else "diagonal"), (split, i, j)
                        assert block_kind(a, b, causal=False) == "full"
    striped = block_table("striped", seq_len, world)
    assert all(k == ["diagonal"] for k in striped.values()) or world == 1


def test_log_add_exp_is_stable_and_naive_overflows():
    a = torch.tensor([0.0, -math.inf, 5.0, -math.inf, -1e4, 3.0])
    b = torch.tensor([100.0, 2.0, -math.inf, -math.inf, 1e4, 3.0])
    assert torch.equal(log_add_exp(a, b), torch.logaddexp(a, b))
    naive = naive_log_add_exp(torch.tensor([0.0]), torch.tensor([100.0]))
    assert torch.isinf(naive).all(), "lse=0, b=100 in fp32: exp(100) overflows"
    assert log_add_exp(torch.tensor([0.0]), torch.tensor([100.0])).item() == 100.0


def _merge_halves(q, k, v, lse_fn):
    """Attend to two key halves separately and merge with ``lse_fn`` as the log-add-exp."""
    n = k.shape[2] // 2
    pos = torch.arange(k.shape[2])
    o1, l1 = block_forward(q, k[:, :, :n], v[:, :, :n], pos, pos[:n], "full", D ** -0.5)
    o2, l2 = block_forward(q, k[:, :, n:], v[:, :, n:], pos, pos[n:], "full", D ** -0.5)
    lse = lse_fn(l1, l2)
    return torch.exp(l1 - lse).unsqueeze(-1) * o1 + torch.exp(l2 - lse).unsqueeze(-1) * o2, lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_large_logits_stable_merge_equal_naive_merge_fails(dtype):
    """Scores of order 1e4: the stable merge is finite and equals one process; the naive one
    (``lse + log(1 + exp(b - lse))``) is not finite."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, D, generator=g, dtype=dtype) for _ in range(3))
    q, k = q * 70, k * 70                       # |scores| up to ~1e4
    ref_o, ref_l = attention_reference(q.double(), k.double(), v.double(), causal=False)
    assert ref_l.abs().max() > 5e3
    o, l = _merge_halves(q, k, v, log_add_exp)
    assert torch.isfinite(o).all() and torch.isfinite(l).all()
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    assert (o.double() - ref_o).abs().max() <= tol * 10   # outputs O(1); lse O(1e4):
    assert ((l.double() - ref_l).abs() / ref_l.abs()).max() <= tol
    o2, m = merge(*_merge_halves(q, k, v, log_add_exp), torch.zeros_like(o), torch.full_like(l, -math.inf))
    assert torch.equal(o2, o) and torch.equal(m, l), "merging with an empty block changes nothing"
    bad_o, bad_l = _merge_halves(q, k, v, naive_log_add_exp)
    assert not (torch.isfinite(bad_o).all() and torch.isfinite(bad_l).all())


def test_rotary_at_global_positions_is_relative():
    """RoPE scores depend only on the distance: q at position p, k at p - 3, whatever p."""
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 1, 1, 8, generator=g), torch.randn(1, 1, 1, 8, generator=g)
    s = [(rotary(q, torch.tensor([p])) * rotary(k, torch.tensor([p - 3]))).sum() for p in (3, 10, 50)]
    assert torch.allclose(s[0], s[1], atol=1e-5) and torch.allclose(s[0], s[2], atol=1e-5)
    with pytest.raises(ValueError, match="past the table"):
        learned(torch.nn.Embedding(8, 4), torch.tensor([3, 8]))


# ---------------------------------------------------------------- many ranks: one launch per W
def _data(seq_len, dtype, kv, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, seq_len, D, generator=g, dtype=torch.float64) * scale
    k = torch.randn(B, kv, seq_len, D, generator=g, dtype=torch.float64) * scale
    v = torch.randn(B, kv, seq_len, D, generator=g, dtype=torch.float64)
    do = torch.randn(B, H, seq_len, D, generator=g, dtype=torch.float64)
    return [t.to(dtype) for t in (q, k, v, do)]


def _cases(world):
    for method, split in METHODS:
        for dtype in (torch.float64, torch.float32):
            for causal in (True, False):
                for seq_len in (6 * world, 6 * world + 1):
                    for kv in (H, KV_SMALL[world]):
                        yield method, split, dtype, causal, seq_len, kv


def _attend(method, q, k, v, split, seq_len, causal):
    fn = ring_attention if method == "ring" else ulysses_attention
    return fn(q, k, v, split=split, seq_len=seq_len, causal=causal)


def _run_case(rank, world, method, split, dtype, causal, seq_len, kv, scale=1.0):
    q, k, v, do = _data(seq_len, dtype, kv, scale)
    q, k, v, do = (shard(t, split, world, rank, dim=2) for t in (q, k, v, do))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with p2p.count_traffic() as fwd:
        out, lse = _attend(method, q, k, v, split, seq_len, causal)
    with p2p.count_traffic() as bwd:
        out.backward(do)
    return (out.detach(), lse, q.grad, k.grad, v.grad,
            (fwd.msgs_sent, fwd.bytes_sent), (bwd.msgs_sent, bwd.bytes_sent))


def _stale_kv_backward(rank, world):
    """The bug: the backward never rotates K/V (each step reuses the block it started with): every
    K/V block the backward receives is overwritten with the one this rank sent first, its own."""
    q, k, v, do = _data(6 * world, torch.float64, H)
    q, k, v, do = (shard(t, "zigzag", world, rank, dim=2) for t in (q, k, v, do))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, _ = ring_attention(q, k, v, split="zigzag")
    real_isend, real_irecv, own = p2p.isend, p2p.irecv, []

    class Stale:
        def __init__(self, work, buf):
            self.work, self.buf = work, buf

        def wait(self):
            self.work.wait()
            self.buf.copy_(own[0])

    def isend(t, dst, group=None, tag=0, **kw):
        if tag == ring._KV and not own:
            own.append(t.clone())
        return real_isend(t, dst, group, tag, **kw)

    def irecv(t, src, group=None, tag=0, **kw):
        work = real_irecv(t, src, group, tag, **kw)
        return Stale(work, t) if tag == ring._KV else work

    p2p.isend, p2p.irecv = isend, irecv
    try:
        out.backward(do)
    finally:
        p2p.isend, p2p.irecv = real_isend, real_irecv
    return q.grad, k.grad, v.grad


def _rope_positions(rank, world, local):
    """Ring attention of rotary q/k: positions global (right) or local arange (the bug)."""
    q, k, v, _ = _data(6 * world, torch.float64, H)
    q, k, v = (shard(t, "zigzag", world, rank, dim=2) for t in (q, k, v))
    pos = (torch.arange(q.shape[2]) if local
           else split_positions("zigzag", 6 * world, world, rank))
    return ring_attention(rotary(q, pos), rotary(k, pos), v, split="zigzag")[0]


def _loss_case(rank, world):
    """Cross-entropy over a sharded sequence: 30% ignored tokens, uneven over ranks (S = 4W+1)."""
    g = torch.Generator().manual_seed(5)
    seq_len = 4 * world + 1
    logits = torch.randn(B, seq_len, 7, generator=g, dtype=torch.float64)
    targets = torch.randint(0, 7, (B, seq_len), generator=g)
    targets[torch.rand(targets.shape, generator=g) < 0.3] = -100
    if world > 1:   # rank 0 counts nothing
        targets[:, split_positions("zigzag", seq_len, world, 0)] = -100
    x = shard(logits, "zigzag", world, rank).requires_grad_()
    t = shard(targets, "zigzag", world, rank)
    loss = sharded_cross_entropy(x, t)
    loss.backward()
    local_mean = F.cross_entropy(x.detach().reshape(-1, 7), t.reshape(-1))   # the wrong way
    return float(loss), x.grad, float(local_mean)


def _rank(rank, world):
    res = {case: _run_case(rank, world, *case) for case in _cases(world)}
    big = {dt: _run_case(rank, world, "ring", "zigzag", dt, True, 6 * world, H, scale=70.0)
           for dt in (torch.float64, torch.float32)}
    bf16 = {m: _run_case(rank, world, m, "zigzag", torch.bfloat16, True, 6 * world, H)
            for m in ("ring", "ulysses")}
    tiny = {(m, sp, n): _run_case(rank, world, m, sp, torch.float64, True, n, H)   # empty shards
            for m, sp in METHODS for n in (0, 1, world - 1) if n < world}
    extra = {"tiny": tiny, "stale": _stale_kv_backward(rank, world),
             "rope_global": _rope_positions(rank, world, False),
             "rope_local": _rope_positions(rank, world, True),
             "loss": _loss_case(rank, world)}
    return res, big, bf16, extra


def _reference(dtype, causal, seq_len, kv, scale=1.0, ref_dtype=None):
    q, k, v, do = _data(seq_len, dtype, kv, scale)
    ref_dtype = ref_dtype or dtype
    q, k, v = (t.to(ref_dtype).requires_grad_() for t in (q, k, v))
    out, lse = attention_reference(q, k, v, causal)
    out.backward(do.to(ref_dtype))
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def _errors(parts, split, ref):
    got = [unshard([p[i] for p in parts], split, dim=2) for i in range(5)]
    assert all(g.shape == r.shape for g, r in zip(got, ref))
    return [0.0 if r.numel() == 0 else
            (g.double() - r.double()).abs().max().item() / max(1.0, r.abs().max().item())
            for g, r in zip(got, ref)]


REPORT = {}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ring_and_ulysses_equal_full_attention(world):
    results = minidist.run(_rank, world, timeout=200)
    worst = {}
    for case in _cases(world):
        method, split, dtype, causal, seq_len, kv = case
        parts = [r[0][case] for r in results]
        errs = _errors(parts, split, _reference(dtype, causal, seq_len, kv,
                                                ref_dtype=torch.float64))
        tol = TOL[dtype] * (world if dtype == torch.float32 else 1)
        grad_tol = tol * (2 if dtype == torch.float32 else 1)
        assert max(errs[:2]) <= tol and max(errs[2:]) <= grad_tol, \
            f"W={world} {case}: errors out/lse/dq/dk/dv {errs} > {tol} / {grad_tol}"
        key = (method, split, str(dtype).split(".")[1])
        worst[key] = max(worst.get(key, 0.0), max(errs))
        if method == "ring":   # the exact messages and bytes every rank sent, forward and backward
            for rank, p in enumerate(parts):
                f = ring_traffic(split, seq_len, world, rank, B, kv, D, p[0].element_size())
                assert p[5] == f["forward"], (case, rank, p[5], f)
                assert p[6] == f["backward"], (case, rank, p[6], f)
                if world > 1 and seq_len >= 2 * world:
                    assert p[5][0] == world - 1 and p[6][0] == 2 * world - 1
        else:   # 5 all-to-alls forward (q, k, v, out, lse), 3 backward (out; q, k, v)
            for p in parts:
                if world > 1:
                    assert p[5][0] == 5 * (world - 1) and p[6][0] == 4 * (world - 1), p[5:]
    REPORT[world] = worst
    print(f"W={world} worst max-abs error per method/split/dtype: "
          + ", ".join(f"{'/'.join(k)} {v:.1e}" for k, v in sorted(worst.items())))

    # large logits (|scores| ~ 1e4): finite, and equal to fp64 arithmetic on the same inputs up
    # to what an lse of that size allows: lse is stored rounded (eps·|lse| absolute), and every
    # P = exp(S - lse) — the output's normalisation, the backward's recomputation — inherits it as
    # a relative error. Bound: 8·eps·max|lse|·max(1, max|ref|) (fp32: 1.6e-2, fp64: 3e-11 at
    # |lse| = 1.7e4; measured at W=1: out 2e-5 and dq 5e-3 of it in fp32, dq 3e-10·0.03 in fp64)
    for dtype in (torch.float64, torch.float32):
        parts = [r[1][dtype] for r in results]
        ref = _reference(dtype, True, 6 * world, H, 70.0, ref_dtype=torch.float64)
        got = [unshard([p[i] for p in parts], "zigzag", dim=2) for i in range(5)]
        assert all(torch.isfinite(t).all() for t in got)
        lse_max = ref[1].abs().max().item()
        assert lse_max > 5e3
        for name, g, r in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
            bound = 8 * torch.finfo(dtype).eps * lse_max * max(1.0, r.abs().max().item())
            err = (g.double() - r).abs().max().item()
            assert err <= bound, (dtype, name, err, bound)

    # bf16 against an fp32 reference on the same (bf16-rounded) inputs: the compute is fp32, so
    # the error is the final rounding to bf16 (half an ulp, 2^-9 relative) plus fp32 noise; the
    # backward's gradients are sums over S terms rounded once: bound 2^-8 of each tensor's max
    for method in ("ring", "ulysses"):
        parts = [r[2][method] for r in results]
        ref = _reference(torch.bfloat16, True, 6 * world, H, ref_dtype=torch.float32)
        got = [unshard([p[i] for p in parts], "zigzag", dim=2) for i in range(5)]
        for name, g, r in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
            bound = 2 ** -8 * r.abs().max().item()
            assert (g.float() - r).abs().max().item() <= bound, (method, name)

    extra = [r[3] for r in results]
    for (method, split, n), _ in extra[0]["tiny"].items():   # fewer positions than ranks
        parts = [e["tiny"][(method, split, n)] for e in extra]
        errs = _errors(parts, split, _reference(torch.float64, True, n, H))
        assert max(errs) <= 1e-12, (method, split, n, errs)
        if method == "ring":
            for rank, p in enumerate(parts):
                f = ring_traffic(split, n, world, rank, B, H, D, 8)
                assert (p[5], p[6]) == (f["forward"], f["backward"]), (split, n, rank)
    ref = _reference(torch.float64, True, 6 * world, H)
    stale = [unshard([e["stale"][i] for e in extra], "zigzag", dim=2) for i in range(3)]
    stale_err = max((a - b).abs().max().item() for a, b in zip(stale, ref[2:]))
    assert (stale_err > 1e-2) == (world > 1), f"a stale-K/V backward must be caught: {stale_err}"

    q, k, v, _ = _data(6 * world, torch.float64, H)
    pos = torch.arange(6 * world)
    rope_ref = attention_reference(rotary(q, pos), rotary(k, pos), v)[0]
    glob = unshard([e["rope_global"] for e in extra], "zigzag", dim=2)
    local = unshard([e["rope_local"] for e in extra], "zigzag", dim=2)
    assert (glob - rope_ref).abs().max() <= 1e-12
    assert ((local - rope_ref).abs().max() > 1e-2) == (world > 1), "local positions caught"

    g = torch.Generator().manual_seed(5)
    seq_len = 4 * world + 1
    logits = torch.randn(B, seq_len, 7, generator=g, dtype=torch.float64).requires_grad_()
    targets = torch.randint(0, 7, (B, seq_len), generator=g)
    targets[torch.rand(targets.shape, generator=g) < 0.3] = -100
    if world > 1:
        targets[:, split_positions("zigzag", seq_len, world, 0)] = -100
    ref_loss = F.cross_entropy(logits.reshape(-1, 7), targets.reshape(-1))
    ref_loss.backward()
    for loss, _, _ in (e["loss"] for e in extra):
        assert abs(loss - ref_loss.item()) <= 1e-12
    grad = unshard([e["loss"][1] for e in extra], "zigzag")
    assert (grad - logits.grad).abs().max() <= 1e-12
    if world > 1:   # the mean of the ranks' means is not the token mean
        means = [e["loss"][2] for e in extra]
        assert math.isnan(means[0]) or abs(sum(means) / world - ref_loss.item()) > 1e-3


def _bad_input(rank, world):
    out = []
    q = torch.zeros(1, 6, 5, 4)
    for fn, args, kw in ((ring_attention, (q, q, q), {"seq_len": 16}),   # 5 != 16/4 positions
                         (ulysses_attention, (torch.zeros(1, 6, 4, 4),) * 3, {}),   # 6 % 4
                         (ulysses_attention, (torch.zeros(1, 12, 4, 4), torch.zeros(1, 3, 4, 4),
                                              torch.zeros(1, 3, 4, 4)), {})):
        try:
            fn(*args, **kw)
            out.append("no error")
        except ValueError as e:
            out.append(str(e))
    return out


@pytest.mark.timeout(60)
def test_bad_input_is_a_clear_error_on_every_rank():
    for rank, (ring_msg, heads_msg, kv_msg) in enumerate(minidist.run(_bad_input, 4, timeout=40)):
        assert f"rank {rank} of 4" in ring_msg and "gives this rank 4" in ring_msg
        assert "6 attention heads do not divide over 4 ranks" in heads_msg
        assert "3 key/value heads on 4 ranks" in kv_msg


# ---------------------------------------------------------------- the cost formulas (planner)
def test_cp_cost_formulas_agree_with_the_ring_and_divide_by_cp():
    from minidist_course.planner.context_parallel import activation_bytes, longest_context, ring_time
    from minidist_course import planner
    from minidist_course.planner.search import longest_context as from_search
    assert planner.longest_context is longest_context and from_search is longest_context
    assert planner.ring_time is ring_time and planner.activation_bytes is activation_bytes
    # the ring's counted messages and bytes (fp32 K/V and accumulators) are the formula's
    for world in (2, 3, 4):
        rt = ring_time(hidden=H * D, heads=H, seq_len=8 * world, cp=world, alpha=0, beta=1,
                       flop_rate=1e30, micro_batch=B, act_bytes=4, grad_bytes=4)
        f = ring_traffic("zigzag", 8 * world, world, 0, B, H, D, 4)
        assert rt.messages == (f["forward"][0], f["backward"][0])
        assert rt.bytes == f["forward"][1] + f["backward"][1]
        assert rt.hidden == 0.0 and rt.exposed_s == rt.comm_s    # nothing to hide behind
    assert ring_time(4096, 32, 131072, 8, 5e-6, 1 / 300e9, 400e12).hidden == 1.0
    # activations per rank: exactly 1/cp of one rank's
    for rec in ("none", "selective", "full"):
        one = activation_bytes(32, 4096, 32000, 65536, 1, 2, recompute=rec)
        assert activation_bytes(32, 4096, 32000, 65536, 4, 2, recompute=rec) == pytest.approx(one / 4)
    # the longest context fits, one more step does not
    for r in longest_context(32, 4096, 32, 32000, 6.7e9, 8):
        total = r["states"] + r["activations"]
        more = r["states"] + activation_bytes(32, 4096, 32000, r["seq_len"] + 1024 * 2 * r["cp"],
                                              r["cp"], r["tp"])
        assert total <= 80e9 < more and r["seq_len"] % (2 * r["cp"]) == 0


def _posting_order(rank, world):
    """At each step, how many K/V messages this rank had already posted when the block's compute
    began (forward), and the recorded compute/wait events."""
    seen = []
    original = ring.block_forward

    def spy(*args):
        seen.append(p2p.traffic("cp/ring_attention/forward").msgs_sent)
        return original(*args)
    q, k, v, do = (shard(t, "contiguous", world, rank, dim=2)
                   for t in _data(4 * world, torch.float64, H))
    q.requires_grad_()
    ring.block_forward = spy
    try:
        p2p.reset_traffic()
        tl = Timeline()
        with tl.observe():
            out, _ = ring_attention(q, k, v, split="contiguous", causal=False)
            out.backward(do)
    finally:
        ring.block_forward = original
    return seen, [(e.name, e.lane, e.stage) for e in tl.events]


@pytest.mark.timeout(60)
def test_next_transfer_is_posted_before_the_current_block_is_computed():
    """Non-causal, contiguous: one block per step. At step t < W-1 the send of step t is already
    posted (t + 1 messages) when the compute starts; the last step posts nothing new."""
    world = 3
    for seen, events in minidist.run(_posting_order, world, timeout=40):
        assert seen == [1, 2, 2], seen
        compute = [e for e in events if e[1] == "compute"]
        assert [e[0] for e in compute] == [f"fwd {t}" for t in range(world)] + \
            [f"bwd {t}" for t in range(world)]
        assert sum(1 for e in events if e[0] == "wait") == 2 * world


def _uneven_without_seq_len(rank, world):
    q = torch.randn(1, 2, 3 if rank == 0 else 2, 4, dtype=torch.float64)   # 5 positions, cut 3 + 2
    out = []
    for fn in (ring_attention, ulysses_attention):
        with pytest.raises(ValueError) as e:
            fn(q, q, q, split="contiguous")
        out.append((str(e.value), tuple(fn(q, q, q, split="contiguous", seq_len=5)[0].shape)))
    return out


def test_uneven_shards_without_seq_len_are_refused_on_every_rank_naming_seq_len():
    """Field report: shards cut unevenly by hand, no ``seq_len``: each rank inferred its own
    length (6 and 4), passed its own check, and the run died in gloo with a hint that blamed the
    user's send/recv. The ranks now agree on the lengths first (ring and Ulysses); with
    ``seq_len=5`` both run."""
    for rank, both in enumerate(minidist.run(_uneven_without_seq_len, 2, timeout=60)):
        for name, (msg, shape) in zip(("ring_attention", "ulysses_attention"), both):
            assert f"{name} (rank {rank} of 2)" in msg and "[3, 2]" in msg, msg
            assert "pass seq_len=5" in msg, msg
            assert shape == (1, 2, 3 if rank == 0 else 2, 4)
