"""Grade exercise 14: the log-sum-exp merge and the zigzag split, then a ring built from them.

The learner writes (see ``exercises/14_context_parallel.ipynb``):

* ``merge(out_a, lse_a, out_b, lse_b) -> (out, lse)``: two partial attention results over
  disjoint keys combined exactly, in a form that does not overflow (scores of 1e4, lse -inf for
  a block that saw no key);
* ``zigzag_positions(seq_len, world, rank) -> LongTensor``: the global positions of rank
  ``rank`` — chunks ``rank`` and ``2W-1-rank`` of ``2W`` (``torch.tensor_split``: uneven lengths
  allowed), in increasing order.

Part C runs a ring-attention forward on 1–4 ranks whose merge and split are the learner's (the
block attention and the point-to-point transfers are the library's) and compares every rank's
output with full attention on one process, including scores of order 1e4. Feedback names the
bug: an overflowing merge, the wrong chunk pairing (``r`` with ``W+r``, ``r`` with ``2W-r``), the
positions of the wrong rank, uneven lengths not handled, an empty block that turns into nan.
Each check's failure names its rule of :data:`MERGE_RULES`, :data:`ZIGZAG_RULES` or
:data:`RING_RULES` (``[id] rule text: ...``).
"""

from __future__ import annotations

import math

import torch

from minidist.context_parallel import blocks, sharding
from .core import Report
from .core import tagged
from .generated import generated_check, generated_on_ranks, st

__all__ = ["grade_merge", "grade_zigzag", "grade_ring", "MERGE_CASES", "ZIGZAG_CASES",
           "MERGE_RULES", "ZIGZAG_RULES", "RING_RULES"]

MERGE_RULES = {
    "shape": "returns (out, lse) shaped and typed like out_a and lse_a: the [b, h, s] weights "
             "broadcast over d",
    "lse": "lse = log(exp(lse_a) + exp(lse_b)), more than their max",
    "weights": "out = exp(lse_a - lse)·out_a + exp(lse_b - lse)·out_b: each weighted by its share",
    "stable": "no overflow: log-add-exp as max + log1p(exp(-|a - b|)) (scores of order 1e4, fp32)",
    "empty": "a block that saw no key (lse -inf, out 0) changes nothing; two give lse -inf, out 0 "
             "(no nan)",
}
ZIGZAG_RULES = {
    "pairing": "rank r holds chunks r and 2W-1-r of 2W: the same causal work on every rank",
    "uneven": "lengths that do not divide by 2W: cut with tensor_split (chunks differ by one)",
    "order": "each position once, in increasing order",
}
RING_RULES = {
    "finite": "the ring's running result stays finite: it starts from lse -inf and scores can be "
              "of order 1e4 (Part A's merge)",
    "cover": "the ranks' positions together are the whole sequence, each on one rank (a split "
             "that drops positions can still match full attention where it kept them)",
    "equal": "every rank's output equals full causal attention on one process (1-4 ranks, S "
             "divisible by 2W or not)",
}

MERGE_CASES = [  # (name, seed, scale, dtype, empty)
    ("random scores, fp64", 0, 1.0, torch.float64, None),
    ("random scores, fp32", 1, 1.0, torch.float32, None),
    ("lse 0 and 100 (fp32)", 2, "0/100", torch.float32, None),
    ("scores of order 1e4 (fp32)", 3, 70.0, torch.float32, None),
    ("block b saw no key (lse -inf)", 4, 1.0, torch.float64, "b"),
    ("block a saw no key (lse -inf)", 5, 1.0, torch.float64, "a"),
    ("neither block saw a key (both lse -inf)", 6, 1.0, torch.float64, "both"),
]
ZIGZAG_CASES = [(16, 4), (8, 1), (12, 2), (40, 4), (13, 3), (7, 4), (3, 2)]


def _partials(seed, scale, dtype, empty):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 3, 5, 4, generator=g, dtype=torch.float64) for _ in range(3))
    k2, v2 = (torch.randn(2, 3, 5, 4, generator=g, dtype=torch.float64) for _ in range(2))
    if isinstance(scale, float):
        q, k, k2 = q * scale, k * scale, k2 * scale
    q, k, v, k2, v2 = (t.to(dtype) for t in (q, k, v, k2, v2))
    pos = torch.arange(5)
    oa, la = blocks.block_forward(q, k, v, pos, pos, "full", 0.5)
    ob, lb = blocks.block_forward(q, k2, v2, pos, pos, "full", 0.5)
    if scale == "0/100":
        la, lb = torch.zeros_like(la), torch.full_like(lb, 100.0)
    if empty in ("a", "both"):
        oa, la = torch.zeros_like(oa), torch.full_like(la, -math.inf)
    if empty in ("b", "both"):
        ob, lb = torch.zeros_like(ob), torch.full_like(lb, -math.inf)
    if isinstance(empty, tuple):   # (seed, share): single rows that saw no key, in a, b or both
        rows = torch.Generator().manual_seed(empty[0])
        for o, l in ((oa, la), (ob, lb)):
            off = torch.rand(l.shape, generator=rows) < empty[1]
            o[off], l[off] = 0.0, -math.inf
    return oa, la, ob, lb


def _both_empty_message(lse, out, rows):
    """What a merge gave for rows where neither block saw a key (``rows``: a bool mask)."""
    got_l, got_o = lse[rows], out[rows]
    if bool(torch.isnan(got_l).any() | torch.isnan(got_o).any()):
        return ("got nan: -inf - (-inf) is nan, so take the max first and handle a max of -inf "
                "(torch.where on the rows where it is -inf)")
    bad = got_l[got_l != -math.inf]
    if bad.numel():
        return (f"got lse = {float(bad[0]):.4g}, finite: a stand-in for -inf is not -inf — the "
                "merged result must keep lse = -inf so the next merge and the caller see an empty row")
    return f"got out with |values| up to {float(got_o.abs().max()):.3g}: expected out = 0"


def _merge_check(fn, case):
    name, seed, scale, dtype, empty = case
    oa, la, ob, lb = _partials(seed, scale, dtype, empty)
    want_o, want_l = blocks.merge(oa.double(), la.double(), ob.double(), lb.double())
    try:
        got = fn(oa.clone(), la.clone(), ob.clone(), lb.clone())
    except RuntimeError as e:
        if "must match the size" not in str(e):
            raise
        return "shape", (f"{e} — the weights exp(lse_x - lse) are [b, h, s] and out_x is [b, h, s, d]: "
                "broadcast the weights over d with [..., None] (unsqueeze(-1))")
    if not (isinstance(got, tuple) and len(got) == 2 and all(isinstance(t, torch.Tensor) for t in got)):
        return "shape", f"expected a tuple (out, lse) of two tensors, got {type(got).__name__}"
    out, lse = got
    if out.dtype != oa.dtype or lse.dtype != la.dtype:
        return "shape", (f"expected out and lse in the inputs' dtype ({oa.dtype}), got {out.dtype} "
                         f"and {lse.dtype}: compute in the dtype you were given (a float32 merge "
                         "of float64 inputs loses digits the ring needs)")
    if out.shape != oa.shape or lse.shape != la.shape:
        return "shape", (f"expected out {tuple(oa.shape)} and lse {tuple(la.shape)}, got "
                f"{tuple(out.shape)} and {tuple(lse.shape)}")
    both = (la == -math.inf) & (lb == -math.inf)
    if bool(both.any()):
        rows = both.clone()
        ok = (lse[rows] == -math.inf).all() and (out[rows] == 0).all()
        if not bool(ok):
            where = ("in every row" if bool(both.all()) else
                     f"in the {int(both.sum())} row(s) of {both.numel()} that neither block saw")
            return "empty", (f"with both lse -inf {where} the merge must give lse = -inf and out = 0 "
                             "there: " + _both_empty_message(lse, out, rows))
    if not (torch.isfinite(out).all() and (torch.isfinite(lse) | torch.isinf(want_l)).all()):
        if isinstance(empty, tuple):
            return "empty", ("nan or inf in a row where one block saw no key (lse -inf, out 0): "
                             "exp(-inf - lse) must be 0 and lse the other block's — handle the "
                             "empty rows one by one, not only whole tensors")
        if empty is not None:
            other = "b" if empty == "a" else "a"
            return "empty", (f"nan or inf where one block saw no key: with lse_{empty} = -inf, "
                    f"exp(lse_{empty} - lse) must be 0 and lse = lse_{other} (log-add-exp with -inf "
                    "is the identity; -inf - (-inf) is nan, so handle it)")
        return "stable", ("overflow: the merge is not finite for large log-sum-exps — "
                "log(exp(a) + exp(b)) overflows once a score passes ~88 in fp32, and "
                "log(1 + exp(b - a)) once the difference does; write log-add-exp as "
                "max + log1p(exp(-|a - b|))")
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    scale_l = max(1.0, float(want_l.abs().max()))
    err_l = float((lse.double() - want_l).abs().max()) / scale_l
    if err_l > tol:
        if torch.allclose(lse.double(), torch.maximum(la, lb).double()) and \
                not torch.allclose(want_l, torch.maximum(la, lb).double()):
            return "lse", "lse is max(lse_a, lse_b): the log of a sum of exponentials is more than its max"
        return "lse", f"lse wrong by {err_l:.2e} (relative): it is log(exp(lse_a) + exp(lse_b))"
    err_o = float((out.double() - want_o).abs().max())
    if err_o > tol * max(1.0, float(want_o.abs().max())):
        plain = (oa + ob).double()
        if torch.allclose(out.double(), plain):
            return "weights", "out is out_a + out_b: weight each by its share exp(lse_x - lse) of the total"
        if torch.allclose(out.double(), plain / 2):
            return "weights", ("out is the average of out_a and out_b: the blocks' shares are "
                               "exp(lse_a - lse) and exp(lse_b - lse), equal only when lse_a = lse_b")
        lse_d = want_l.unsqueeze(-1)
        swapped = (torch.exp(lb.double().unsqueeze(-1) - lse_d).nan_to_num(0.0) * oa.double()
                   + torch.exp(la.double().unsqueeze(-1) - lse_d).nan_to_num(0.0) * ob.double())
        if torch.allclose(out.double(), swapped):
            return "weights", ("the weights are swapped: out_a takes exp(lse_a - lse), its own "
                               "block's share, and out_b exp(lse_b - lse)")
        return "weights", f"out wrong by {err_o:.2e}: out = exp(lse_a - lse)·out_a + exp(lse_b - lse)·out_b"
    return None


# (name, seed, scale, dtype, (seed, share)): random partial results whose single rows saw no key
MERGE_INPUTS = st.tuples(st.just("generated"), st.integers(0, 2**16),
                         st.sampled_from([1.0, 70.0, "0/100"]),
                         st.sampled_from([torch.float64, torch.float32]),
                         st.tuples(st.integers(0, 2**16), st.sampled_from([0.0, 0.3, 0.7])))


def _describe_merge(case):
    _, seed, scale, dtype, (rows, share) = case
    scores = {1.0: "random scores", 70.0: "scores of order 1e4", "0/100": "lse 0 and 100"}[scale]
    return (f"{scores}, {str(dtype).removeprefix('torch.')} (seed {seed}), each row of each block "
            f"empty with probability {share} (seed {rows})")


def grade_merge(fn, total: float = 2) -> Report:
    """``fn(out_a, lse_a, out_b, lse_b) -> (out, lse)`` against the library's merge."""
    report = Report("Part A: merging two partial attention results", total=total,
                    rules=MERGE_RULES)
    for case in MERGE_CASES:
        report.check(case[0], lambda c=case: _merge_check(fn, c))
    generated_check(report, "rows of random blocks, some empty", MERGE_INPUTS,
                    lambda c: _merge_check(fn, c), max_examples=60, describe=_describe_merge,
                    crash_rule="shape")
    return report


def _variants(seq_len, world, rank):
    parts = torch.arange(seq_len).tensor_split(2 * world)
    out = {}
    if world + rank < 2 * world:
        out["chunks r and W + r"] = torch.cat([parts[rank], parts[world + rank]])
    out["chunks r and 2W - r"] = torch.cat([parts[rank], parts[(2 * world - rank) % (2 * world)]])
    out["a contiguous split"] = torch.arange(seq_len).tensor_split(world)[rank]
    return out


def _which_chunks(got, seq_len, world):
    """``(i, j)``, i < j, when ``got`` is chunks i and j of ``tensor_split(2W)`` in order, else None."""
    parts = torch.arange(seq_len).tensor_split(2 * world)
    for i in range(2 * world):
        for j in range(i + 1, 2 * world):
            if got.numel() == len(parts[i]) + len(parts[j]) and \
                    torch.equal(got, torch.cat([parts[i], parts[j]])):
                return i, j
    return None


def _zigzag_check(fn, seq_len, world):
    got_all = []
    for rank in range(world):
        try:
            got = fn(seq_len, world, rank)
        except IndexError as e:   # an index past the chunks: torch.chunk's fewer pieces, or 2W - r
            where = f"rank {rank}, S = {seq_len}, W = {world}: IndexError ({e})"
            if len(torch.arange(seq_len).chunk(2 * world)) < 2 * world:
                return "uneven", (f"{where} — if you cut with torch.chunk: it returns fewer than "
                                  f"{2 * world} pieces here (torch.chunk returns fewer pieces when "
                                  "S does not divide evenly); cut with torch.arange(seq_len)"
                                  ".tensor_split(2 * world), always 2W pieces")
            return "pairing", (f"{where} — an index past the last of the {2 * world} chunks "
                               f"(0 … {2 * world - 1}): rank r holds chunks r and 2W-1-r")
        if not isinstance(got, torch.Tensor):
            return "order", f"rank {rank}: expected a tensor of positions, got {type(got).__name__}"
        got_all.append(got.reshape(-1).long())
    variants = [_variants(seq_len, world, r) for r in range(world)]
    pairing = ("the wrong chunk pairing; rank r holds chunks r and 2W-1-r of 2W (here {} and "
               "{}), so the early and the late chunks pair up and every rank gets the same "
               "causal work")
    for rank, got in enumerate(got_all):
        want = sharding.positions("zigzag", seq_len, world, rank)
        if torch.equal(got, want):
            continue
        text = f"rank {rank}: expected {want.tolist()}, got {got.tolist()}"
        for name, v in variants[rank].items():   # named only when every rank made that mistake
            if torch.equal(got, v) and all(name in vr and torch.equal(g, vr[name])
                                           for g, vr in zip(got_all, variants)):
                return "pairing", f"{text} — {name}: " + pairing.format(rank, 2 * world - 1 - rank)
        if (pair := _which_chunks(got, seq_len, world)) is not None:
            return "pairing", (f"{text} — chunks {pair[0]} and {pair[1]} of {2 * world}: "
                               + pairing.format(rank, 2 * world - 1 - rank))
        if seq_len % (2 * world) and got.numel() != want.numel():
            return "uneven", (f"{text} — {seq_len} does not divide into {2 * world} equal chunks: cut with "
                    "torch.arange(seq_len).tensor_split(2 * world)")
        if len(set(got.tolist())) < got.numel():
            return "order", f"{text} — a position appears twice: the two chunks must be different"
        if sorted(got.tolist()) == want.tolist():
            return "order", f"{text} — the right positions in the wrong order: return them increasing"
        if seq_len % (2 * world) and _right_when_even(fn, world):
            return "uneven", (f"{text} — right when 2W divides S, wrong here: {seq_len} does not divide "
                    f"into {2 * world} equal chunks; cut with torch.arange(seq_len).tensor_split(2 * world)")
        return "pairing", text
    return None


def _right_when_even(fn, world) -> bool:
    """Does ``fn`` give every rank's zigzag positions when 2W divides S (S = 2W, 4W, 6W)?"""
    try:
        return all(torch.equal(torch.as_tensor(fn(s, world, r)).reshape(-1).long(),
                               sharding.positions("zigzag", s, world, r))
                   for s in (2 * world, 4 * world, 6 * world) for r in range(world))
    except Exception:  # noqa: BLE001 - a crash there is not this check's to explain
        return False


def grade_zigzag(fn, total: float = 2) -> Report:
    """``fn(seq_len, world, rank)`` against :func:`minidist.context_parallel.sharding.positions`."""
    report = Report("Part B: the zigzag split", total=total, rules=ZIGZAG_RULES)
    for s, w in ZIGZAG_CASES:
        report.check(f"S = {s}, W = {w}", lambda s=s, w=w: _zigzag_check(fn, s, w))
    generated_check(report, "S and W", st.tuples(st.integers(0, 200), st.integers(1, 8)),
                    lambda c: _zigzag_check(fn, *c), max_examples=80,
                    describe=lambda c: "S = {}, W = {}".format(*c), crash_rule="uneven")
    return report


def _ring_rank(rank, world, merge_fn, positions_fn, seq_len, scale):
    """A ring-attention forward: the library's blocks and transfers, the learner's merge/split."""
    from minidist.comm import p2p
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, seq_len, 4, generator=g) for _ in range(3))
    q, k = q * scale, k * scale
    mine = [positions_fn(seq_len, world, r).reshape(-1).long() for r in range(world)]
    qs, kv = q[:, :, mine[rank]], torch.stack([k[:, :, mine[rank]], v[:, :, mine[rank]]])
    out = torch.zeros_like(qs)
    lse = torch.full(qs.shape[:-1], -math.inf)
    for t in range(world):
        src = (rank - t) % world
        kind = sharding.block_kind(mine[rank], mine[src])
        if kind != "skipped":
            o, l = blocks.block_forward(qs, kv[0], kv[1], mine[rank], mine[src], kind, 0.5)
            out, lse = merge_fn(out, lse, o, l)
        if t < world - 1:
            incoming = torch.empty(2, 1, 2, len(mine[(src - 1) % world]), 4)
            p2p.exchange(kv.contiguous(), (rank + 1) % world, incoming, (rank - 1) % world)
            kv = incoming
    return mine[rank], out


def _coverage(positions_fn, seq_len, world):
    """A message when the ranks' positions are not the whole sequence, each once (else None)."""
    held = torch.cat([torch.as_tensor(positions_fn(seq_len, world, r)).reshape(-1).long()
                      for r in range(world)]).tolist()
    if sorted(held) == list(range(seq_len)):
        return None
    missing = sorted(set(range(seq_len)) - set(held))
    twice = sorted({p for p in held if held.count(p) > 1})
    return (f"S = {seq_len}, W = {world}: the ranks hold {len(held)} positions; missing "
            f"{missing[:8]}, held twice {twice[:8]} — every position on exactly one rank")


def _ring_check(merge_fn, positions_fn, world, seq_len, scale):
    from minidist.launch import run
    if msg := _coverage(positions_fn, seq_len, world):
        return "cover", msg
    got = run(_ring_rank, world, merge_fn, positions_fn, seq_len, scale, timeout=60)
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, seq_len, 4, generator=g) for _ in range(3))
    ref, ref_lse = blocks.attention_reference((q * scale).double(), (k * scale).double(),
                                              v.double(), scale=0.5)
    # fp32; at scores ~1e4 the lse is only known to eps·|lse| (tests/library/context_parallel/test_context_parallel.py)
    tol = 1e-5 if scale == 1.0 else 8 * torch.finfo(torch.float32).eps * float(ref_lse.abs().max())
    for rank, (pos, out) in enumerate(got):
        if not torch.isfinite(out).all():
            return "finite", (f"rank {rank}: non-finite output — your merge gives inf or nan (the ring starts "
                    "from lse = -inf, and scores can be large: see Part A)")
        err = float((out.double() - ref[:, :, pos]).abs().max())
        if err > tol:
            return "equal", (f"rank {rank} (positions {pos.tolist()}): output differs from full attention "
                    f"by {err:.2e}")
    return None


def _ring_rank_check(rank, world, merge_fn, positions_fn, case):
    """One generated case on this rank: its output against full attention, or a message."""
    seq_len, scale = case
    if msg := _coverage(positions_fn, seq_len, world):
        return tagged(RING_RULES, "cover", msg)
    pos, out = _ring_rank(rank, world, merge_fn, positions_fn, seq_len, scale)
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, seq_len, 4, generator=g) for _ in range(3))
    ref, ref_lse = blocks.attention_reference((q * scale).double(), (k * scale).double(),
                                              v.double(), scale=0.5)
    tol = 1e-5 if scale == 1.0 else 8 * torch.finfo(torch.float32).eps * float(ref_lse.abs().max())
    if not torch.isfinite(out).all():
        return tagged(RING_RULES, "finite", "non-finite output (see Part A: lse -inf at the "
                                            "start, large scores)")
    err = float((out.double() - ref[:, :, pos]).abs().max()) if pos.numel() else 0.0
    if err > tol:
        return tagged(RING_RULES, "equal", f"positions {pos.tolist()}: output differs from full "
                                           f"attention by {err:.2e}")
    return None


def grade_ring(merge_fn, positions_fn, total: float = 2) -> Report:
    """Ring attention with the learner's ``merge`` and ``zigzag_positions`` on 1–4 ranks."""
    report = Report("Part C: ring attention from your merge and split", total=total,
                    rules=RING_RULES, default_rule="equal")
    for world, seq_len, scale in ((1, 6, 1.0), (2, 12, 1.0), (3, 13, 1.0), (4, 16, 1.0),
                                  (4, 16, 70.0)):
        name = (f"W = {world}, S = {seq_len}" +
                (", scores of order 1e4" if scale != 1.0 else "") + " vs full attention")
        report.check(name, lambda w=world, s=seq_len, c=scale: _ring_check(merge_fn, positions_fn,
                                                                          w, s, c))
    generated_on_ranks(report, "S = 1-64, scores of order 1 or 1e4", _ring_rank_check,
                       st.tuples(st.integers(1, 64), st.sampled_from([1.0, 70.0])), 8,
                       args=(merge_fn, positions_fn), timeout=60,
                       describe=lambda c: f"S = {c[0]}" + (", scores of order 1e4" if c[1] != 1.0 else ""))
    return report
