"""algorithm="auto" (minidist.comm.tuner): the models against the traffic counters, auto bitwise
equal to the algorithm it picked, the choice following the table (synthetic tables force each
algorithm), the fallbacks (missing / corrupt / incomplete machine table), the ranks' agreement,
the debug print, and the strategies' default (DDP, ZeRO-2, FSDP) recording auto's choice.

Every launch loops over its cases inside the ranks; no test times anything.
"""

import contextlib
import io
import json
import os
import warnings

import pytest
import torch

import minidist
from minidist import collectives as C
from minidist.comm import bucket_size, p2p, tuner

OPS = tuple(tuner.CANDIDATES)
MIB = 1 << 20


def _table(path, fits, fmt=tuner.FORMAT, points=None):
    """A ``minidist-alpha-beta/1`` file of ``fits``; ``points``: {(op, alg, W): [(bytes, median s)]}."""
    path.write_text(json.dumps({"format": fmt, "fits": [
        dict(op=o, algorithm=a, world_size=w, alpha=al, beta=be,
             points=[dict(bytes=n, median_s=t) for n, t in (points or {}).get((o, a, w), [])])
        for (o, a, w), (al, be) in fits.items()]}))
    return str(path)


def forcing(op, algorithm):
    """Fits at W=2 for every candidate: ``algorithm`` free (alpha = beta = 0), the rest 1 s, 1 s/B."""
    return {(o, a, 2): ((0.0, 0.0) if (o, a) == (op, algorithm) else (1.0, 1.0))
            for o, algs in tuner.CANDIDATES.items() for a in algs}


@pytest.fixture
def forcing_tables(tmp_path):
    return {(op, a): _table(tmp_path / f"{op}-{a}.json", forcing(op, a))
            for op, algs in tuner.CANDIDATES.items() for a in algs}


# --- the models, counted against what the implementations send ------------------------------

def _counted(rank, world, numel):
    out = {}
    for op, algs in tuner.CANDIDATES.items():
        for a in algs:
            p2p.reset_traffic()
            x = torch.ones(numel)
            if op == "all_reduce":
                C.all_reduce(x, algorithm=a)
            elif op == "reduce_scatter":
                C.reduce_scatter(torch.empty(numel // world), x, algorithm=a)
            elif op == "all_gather":
                C.all_gather(x, torch.ones(numel // world), algorithm=a)
            else:
                C.broadcast(x, 0, algorithm=a)
            t = p2p.traffic(f"{op}/{a}")
            out[(op, a)] = (t.msgs_sent, t.bytes_sent, t.msgs_recv, t.bytes_recv)
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_coefficients_count_what_each_algorithm_sends(world):
    numel = 2 * tuner.RING_BROADCAST_SEGMENT + 4   # divisible by 2, 3, 4; 3 ring-broadcast segments
    n = 4 * numel
    per_rank = minidist.run(_counted, world, numel, timeout=90)
    ranks = range(world)
    for (op, a) in per_rank[0]:
        ca, cb = tuner.coefficients(op, a, world, n)
        sent = [per_rank[r][(op, a)] for r in ranks]
        if a == "ring" and op != "broadcast" or (a == "recursive_doubling" and world != 3):
            # every rank sends c_alpha messages, c_beta * n bytes, one after another
            assert all(m == ca and b == pytest.approx(cb * n) for m, b, _, _ in sent), (op, a, sent)
        elif a == "recursive_doubling":  # W=3: rank 0 folds into rank 1, which hands back the result
            assert sent[0][0] + sent[1][0] == ca == 3 and sent[0][1] + sent[1][1] == cb * n
        elif (op, a) == ("all_reduce", "naive"):   # rank 0 receives W-1 buffers, then sends W-1
            m_s, b_s, m_r, b_r = sent[0]
            assert m_s + m_r == ca and b_s + b_r == cb * n
        elif a == "naive" and op != "broadcast":   # W-1 pieces posted at once: one latency
            assert ca == 1 and all(m == world - 1 and b == cb * n for m, b, _, _ in sent)
        elif (op, a) == ("broadcast", "tree"):     # the root's link carries ceil(log2 W) copies
            assert sent[0][0] == ca and sent[0][1] == cb * n
        elif (op, a) == ("broadcast", "naive"):
            assert ca == 1 and sent[0][:2] == (world - 1, cb * n)
        else:   # ring broadcast: S segments down a chain of W-1 hops: W-2+S dependent messages
            segments = sent[0][0]
            assert segments == 3 and sent[-1][2] == segments and ca == world - 2 + segments
            assert sent[0][1] == n and cb == pytest.approx(ca / segments)


def test_coefficients_and_prediction_basics():
    assert tuner.coefficients("all_reduce", "ring", 1) == (0.0, 0.0)
    assert tuner.coefficients("all_reduce", "recursive_doubling", 8) == (3.0, 3.0)
    assert tuner.coefficients("all_reduce", "recursive_doubling", 6) == (4.0, 4.0)  # 2 + fold, back
    assert tuner.coefficients("broadcast", "tree", 5) == (3.0, 3.0)
    assert tuner.predict("all_reduce", "ring", 4, 1000, 1e-5, 1e-9) == pytest.approx(6e-5 + 1.5e-6)
    with pytest.raises(ValueError, match="no alpha-beta model for reduce/tree"):
        tuner.coefficients("reduce", "tree", 4)


# --- the choice follows the table -----------------------------------------------------------

def test_synthetic_tables_force_every_algorithm(tmp_path):
    for op, algs in tuner.CANDIDATES.items():
        for a in algs:
            t = tuner.load_table(_table(tmp_path / "t.json", forcing(op, a)))
            for w in (2, 3, 4, 8):
                for n in (0, 4, 4096, 1 << 26):
                    assert t.choose(op, w, n) == a, (op, a, w, n)
            assert t.choose(op, 1, 4096) == algs[0]   # one rank: nothing moves, the default


def test_choice_is_the_argmin_of_the_predictions_and_crosses_over(tmp_path):
    fits = {("all_reduce", "ring", 4): (50e-6, 1e-9), ("all_reduce", "recursive_doubling", 4): (50e-6, 1e-9),
            ("all_reduce", "naive", 4): (50e-6, 1e-9)}
    t = tuner.load_table(_table(tmp_path / "m.json", fits))
    assert t.sources["all_reduce"].endswith("m.json") and t.sources["broadcast"] == "default"
    chosen = [t.choose("all_reduce", 4, 1 << k) for k in range(8, 28)]
    for k, a in zip(range(8, 28), chosen):
        times = {b: t.predict("all_reduce", b, 4, 1 << k) for b in tuner.CANDIDATES["all_reduce"]}
        assert times[a] == min(times.values())
    # 6a + 1.5nb = 2a + 2nb at n = 8a/b = 400 kB: recursive doubling below, the ring above
    assert chosen[0] == "recursive_doubling" and chosen[-1] == "ring"
    assert t.choose("all_reduce", 4, 300_000) == "recursive_doubling"
    assert t.choose("all_reduce", 4, 500_000) == "ring"
    assert t.alpha_beta("all_reduce", "ring", 3) == (50e-6, 1e-9)   # nearest measured W


def test_default_table_is_complete_and_sane():
    t = tuner.load_table(tuner.DEFAULT_TABLE)
    for op, algs in tuner.CANDIDATES.items():
        for a in algs:
            for w in (2, 4):
                alpha, beta = t.alpha_beta(op, a, w)
                assert 0 <= alpha < 0.1 and 0 <= beta < 1e-6, (op, a, w, alpha, beta)
                # beta may be clamped to 0 where the model's columns are nearly collinear (the
                # ring broadcast's segments grow with n), but every line must grow with size
                assert t.model(op, a, w, 64 * MIB) > t.model(op, a, w, 1024), (op, a, w, alpha, beta)


# --- predictions from the measured medians --------------------------------------------------
# W=2 fits of this library's machine, and its medians at 16 and 64 MiB: the lines predict naive
# 55.5 ms and the ring 55.7 ms at 64 MiB, where the ring measured 47.6 ms and naive 62.3 ms
_LINES = {"ring": (5e-4, 8.151e-10), "recursive_doubling": (3.21e-4, 8.893e-10), "naive": (1.65e-4, 4.110e-10)}
_MEDIANS = {"ring": [(16 * MIB, 13.0e-3), (64 * MIB, 47.6e-3)],
            "recursive_doubling": [(16 * MIB, 15.0e-3), (64 * MIB, 63.0e-3)],
            "naive": [(16 * MIB, 14.5e-3), (64 * MIB, 62.3e-3)]}


def _with_points(tmp_path, points=True):
    fits = {("all_reduce", a, 2): ab for a, ab in _LINES.items()}
    pts = {("all_reduce", a, 2): m for a, m in _MEDIANS.items()} if points else None
    return tuner.load_table(_table(tmp_path / f"p{points}.json", fits, points=pts))


def test_the_measured_medians_decide_where_the_lines_cross_wrongly(tmp_path):
    lines, t = _with_points(tmp_path, False), _with_points(tmp_path)
    assert lines.predict("all_reduce", "naive", 2, 64 * MIB) == pytest.approx(55.5e-3, rel=1e-3)
    assert lines.predict("all_reduce", "ring", 2, 64 * MIB) == pytest.approx(55.7e-3, rel=1e-3)
    assert lines.choose("all_reduce", 2, 64 * MIB) == "naive"        # the lines alone: wrong
    for n in (16 * MIB, 24 * MIB, 40 * MIB, 64 * MIB, 80 * MIB):
        assert t.choose("all_reduce", 2, n) == "ring", n               # the medians: right


def test_predict_interpolates_the_medians_in_log_log_and_scales_the_model_beyond_them(tmp_path):
    t = _with_points(tmp_path)
    ring = lambda w, n: t.predict("all_reduce", "ring", w, n)          # noqa: E731
    model = lambda w, n: t.model("all_reduce", "ring", w, n)           # noqa: E731
    assert ring(2, 16 * MIB) == pytest.approx(13.0e-3, rel=1e-12)      # exact at a measured size
    assert ring(2, 64 * MIB) == pytest.approx(47.6e-3, rel=1e-12)
    assert ring(2, 32 * MIB) == pytest.approx((13.0e-3 * 47.6e-3) ** 0.5, rel=1e-12)   # log-log midpoint
    assert ring(2, 128 * MIB) == pytest.approx(model(2, 128 * MIB) * 47.6e-3 / model(2, 64 * MIB), rel=1e-12)
    assert ring(2, 1024) == pytest.approx(model(2, 1024) * 13.0e-3 / model(2, 16 * MIB), rel=1e-12)
    assert ring(2, 0) == pytest.approx(model(2, 0) * 13.0e-3 / model(2, 16 * MIB), rel=1e-12)
    assert ring(4, 32 * MIB) == model(4, 32 * MIB)                     # no medians at W=4: the model
    assert ring(1, 32 * MIB) == 0.0                                    # one rank: nothing moves
    again = tuner.Table.from_json(json.loads(json.dumps(t.to_json())))  # what ranks broadcast
    assert again.points == t.points and again.predict("all_reduce", "ring", 2, 32 * MIB) == ring(2, 32 * MIB)
    # the bucket rule weighs latency in the model's terms: alpha's share of the line
    ca, cb = tuner.coefficients("all_reduce", "ring", 2)
    a, b = _LINES["ring"]
    assert bucket_size.latency_share(t, 2, 64 * MIB) == pytest.approx(ca * a / (ca * a + cb * 64 * MIB * b))
    # a machine table replaces an op's medians with its own (none here), other ops keep the default's
    only = {k: v for k, v in forcing("all_reduce", "naive").items() if k[0] == "all_reduce"}
    forced = tuner.load_table(_table(tmp_path / "f.json", only))
    assert not any(k[0] == "all_reduce" for k in forced.points)
    assert any(k[0] == "broadcast" for k in forced.points)


def test_the_default_tables_medians_cover_every_size_auto_is_benchmarked_at():
    t = tuner.load_table(tuner.DEFAULT_TABLE)
    for op, algs in tuner.CANDIDATES.items():
        for a in algs:
            for w in (2, 4):
                pts = t.points[(op, a, w)]
                assert pts[0][0] <= 1024 and pts[-1][0] >= 64 * MIB, (op, a, w, pts[0], pts[-1])


# --- fallbacks ------------------------------------------------------------------------------

def test_missing_corrupt_or_incomplete_machine_table_falls_back_to_the_default(tmp_path, monkeypatch):
    default = tuner.load_table(tuner.DEFAULT_TABLE).fits
    monkeypatch.setenv(tuner.ENV, str(tmp_path / "nowhere.json"))
    with pytest.warns(RuntimeWarning, match="no alpha-beta table at .*nowhere.json"):
        assert tuner.load_table().fits == default
    bad = {"not json": "{", "another format": json.dumps({"format": "x/1", "fits": []}),
           "no fits": json.dumps({"format": tuner.FORMAT}),
           "negative": json.dumps({"format": tuner.FORMAT, "fits": [dict(
               op="all_reduce", algorithm="ring", world_size=2, alpha=-1.0, beta=1e-9)]}),
           "zero median": json.dumps({"format": tuner.FORMAT, "fits": [dict(
               op="all_reduce", algorithm="ring", world_size=2, alpha=1e-4, beta=1e-9,
               points=[dict(bytes=1024, median_s=0.0)])]}),
           "one size twice": json.dumps({"format": tuner.FORMAT, "fits": [dict(
               op="all_reduce", algorithm="ring", world_size=2, alpha=1e-4, beta=1e-9,
               points=[dict(bytes=1024, median_s=1e-3), dict(bytes=1024, median_s=2e-3)])]})}
    for what, text in bad.items():
        path = tmp_path / "bad.json"
        path.write_text(text)
        monkeypatch.setenv(tuner.ENV, str(path))
        with pytest.warns(RuntimeWarning, match="not a usable alpha-beta table"):
            assert tuner.load_table().fits == default, what
    # the default place, absent: the normal state of a fresh install, no warning
    monkeypatch.delenv(tuner.ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert tuner.machine_table_path() == tmp_path / "cache" / "minidist" / "alpha_beta.json"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tuner.load_table().fits == default
    # incomplete: only the ring of all-reduce measured -> every op stays on the default
    partial = {("all_reduce", "ring", 2): (1.0, 1.0)}
    t = tuner.load_table(_table(tmp_path / "partial.json", partial))
    assert t.fits == default and set(t.sources.values()) == {"default"}
    # "default" ignores a machine table that exists
    _table(tuner.machine_table_path().parent.mkdir(parents=True) or tuner.machine_table_path(),
           forcing("all_reduce", "naive"))
    assert tuner.load_table().choose("all_reduce", 4, 1 << 20) == "naive"
    monkeypatch.setenv(tuner.ENV, "default")
    assert tuner.load_table().fits == default


def test_bench_json_merges_into_the_machine_table_and_reset_removes_it(tmp_path, monkeypatch, capsys):
    from minidist_course.bench import alpha_beta_bench
    from minidist_course.bench.alpha_beta import AlphaBetaFit

    monkeypatch.setenv(tuner.ENV, str(tmp_path / "mine.json"))
    fit = lambda a, alpha: AlphaBetaFit("all_reduce", a, 2, alpha, 1e-9, (alpha, alpha), (1e-9, 1e-9))  # noqa: E731
    alpha_beta_bench.write_machine_table([fit("ring", 1e-4), fit("naive", 2e-4)])
    alpha_beta_bench.write_machine_table([fit("naive", 3e-4), fit("recursive_doubling", 5e-5)])
    t = tuner.load_table()
    assert t.fits[("all_reduce", "ring", 2)] == (1e-4, 1e-9)              # kept
    assert t.fits[("all_reduce", "naive", 2)] == (3e-4, 1e-9)             # replaced
    assert t.sources["all_reduce"] == str(tmp_path / "mine.json")         # complete: used
    assert alpha_beta_bench.main(["--reset"]) == 0
    assert not (tmp_path / "mine.json").exists() and "removed" in capsys.readouterr().out


# --- auto on the ranks ----------------------------------------------------------------------

def _run_op(op, algorithm, x, rank, world):
    if op == "all_reduce":
        return C.all_reduce(x.clone(), algorithm=algorithm)
    if op == "reduce_scatter":
        pieces = list(x.clone().tensor_split(world))
        out = torch.empty_like(pieces[rank])
        return C.reduce_scatter(out, pieces, algorithm=algorithm)
    if op == "all_gather":
        outs = [torch.empty_like(c) for c in x.tensor_split(world)]
        C.all_gather(outs, x.tensor_split(world)[rank].clone(), algorithm=algorithm)
        return torch.cat(outs)
    return C.broadcast(x.clone(), world - 1, algorithm=algorithm)


def _auto_rank(rank, world, tables, sizes):
    seen = []
    for (op, forced), path in [((None, None), None)] + list(tables.items()):
        os.environ[tuner.ENV] = path or "default"
        tuner.reset_cache()
        for forced_op in ([op] if op else OPS):
            for n in sizes:
                x = torch.randn(n, generator=torch.Generator().manual_seed(rank * 1000 + n))
                chosen = tuner.table().choose(forced_op, world, 4 * n)
                p2p.reset_traffic()
                got = _run_op(forced_op, "auto", x, rank, world)
                names = set(p2p.traffic())
                want = _run_op(forced_op, chosen, x, rank, world)
                seen.append((forced_op, forced, n, chosen, torch.equal(got, want),
                             names <= {f"{forced_op}/{chosen}"}))
    return seen


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_auto_is_bitwise_the_algorithm_it_picked(world, forcing_tables):
    rows = minidist.run(_auto_rank, world, forcing_tables, (0, 1, 5, 13, 1000), timeout=150)
    for rank_rows in rows:
        for op, forced, n, chosen, equal, named in rank_rows:
            assert equal, (op, forced, n, chosen)
            assert named, f"{op} n={n}: the counters must name {chosen}"
            if forced is not None and world > 1:
                assert chosen == forced, (op, forced, n, chosen)
    assert rows[0] == rows[-1]                        # every rank chose the same


def _disagree(rank, world, tables):
    # rank 1's machine measured another table: rank 0's is used by all (no deadlock, same choice)
    os.environ[tuner.ENV] = tables[("all_reduce", "naive" if rank == 0 else "ring")]
    tuner.reset_cache()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        p2p.reset_traffic()
        C.all_reduce(torch.ones(1000), algorithm="auto", debug=True)
    return sorted(p2p.traffic()), err.getvalue()


@pytest.mark.timeout(60)
def test_ranks_agree_on_rank_zeros_table_and_debug_prints_the_choice(forcing_tables):
    rows = minidist.run(_disagree, 2, forcing_tables, timeout=45)
    for names, err in rows:
        assert names == ["all_reduce/naive"]
        assert "minidist auto: all_reduce of 4000 B on 2 ranks -> naive (predicted ring " in err
        assert "naive 0 us; fits from " in err and err.rstrip().endswith("all_reduce-naive.json)")


# --- the strategies' default ----------------------------------------------------------------

def _strategies_rank(rank, world, tables):
    from torch import nn

    from minidist.data_parallel import BucketedDDP
    from minidist.sharding import ShardedOptimizer, fully_shard

    out = {}
    for name, key in (("rd", ("all_reduce", "recursive_doubling")),
                      ("naive", ("reduce_scatter", "naive"))):
        os.environ[tuner.ENV] = tables[key]
        tuner.reset_cache()
        torch.manual_seed(0)
        x = torch.randn(4, 8)
        for kind, algorithm in (("ddp", None), ("ddp", "ring"), ("zero2", None), ("fsdp", None)):
            model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
            kw = {} if algorithm is None else {"algorithm": algorithm}
            p2p.reset_traffic()
            if kind == "ddp":
                ddp = BucketedDDP(model, **kw)
                p2p.reset_traffic()
                ddp(x).sum().backward()
                ddp.close()
            elif kind == "zero2":
                opt = ShardedOptimizer(model.parameters(), torch.optim.SGD, stage=2, lr=0.1, **kw)
                model(x).sum().backward()
                opt.step()
            else:
                m = fully_shard(model, **kw)
                m(x).sum().backward()
            out[(name, kind, algorithm)] = sorted(k for k, v in p2p.traffic().items() if v.msgs_sent)
    return out


@pytest.mark.timeout(120)
def test_ddp_zero_and_fsdp_default_to_auto_and_the_counters_name_its_choice(forcing_tables):
    got = minidist.run(_strategies_rank, 4, forcing_tables, timeout=100)[0]
    assert got[("rd", "ddp", None)] == ["all_reduce/recursive_doubling"]
    assert got[("rd", "ddp", "ring")] == ["all_reduce/ring"]           # an explicit one still wins
    # the table that frees the naive reduce-scatter leaves all-gather on the cheaper of ring/naive
    assert "reduce_scatter/naive" in got[("naive", "zero2", None)]
    assert "reduce_scatter/naive" in got[("naive", "fsdp", None)]
    assert not any("ring" in k for k in got[("naive", "zero2", None)] if k.startswith("reduce"))


def test_bucket_cap_grows_only_where_latency_dominates(tmp_path):
    mib = 1 << 20

    def table(alpha):
        fits = {("all_reduce", a, 2): (alpha, 1e-9) for a in tuner.CANDIDATES["all_reduce"]}
        return tuner.load_table(_table(tmp_path / f"{alpha}.json", fits))

    fast, slow, very_slow = table(1e-6), table(1e-3), table(1.0)
    assert bucket_size.bucket_cap_bytes(fast, 4) == bucket_size.BUCKET_FLOOR            # bandwidth-bound: 25 MiB
    cap = bucket_size.bucket_cap_bytes(slow, 4)
    assert bucket_size.BUCKET_FLOOR < cap < 4 * bucket_size.BUCKET_FLOOR
    assert bucket_size.latency_share(slow, 4, cap) <= 0.05 < bucket_size.latency_share(slow, 4, cap - mib)
    assert bucket_size.bucket_cap_bytes(very_slow, 4) == 4 * bucket_size.BUCKET_FLOOR   # the ceiling
    assert bucket_size.bucket_cap_bytes(slow, 1) == bucket_size.BUCKET_FLOOR


def _bucket_default(rank, world):
    from torch import nn

    from minidist.data_parallel import BucketedDDP
    ddp = BucketedDDP(nn.Linear(4, 2))
    fixed = BucketedDDP(nn.Linear(4, 2), algorithm="ring")
    out = (ddp.bucket_cap_mb, fixed.bucket_cap_mb,
           bucket_size.bucket_cap_bytes(tuner.table(), world) / 2**20)
    ddp.close()
    fixed.close()
    return out


@pytest.mark.timeout(60)
def test_bucketed_ddp_takes_its_default_bucket_size_from_the_model():
    for auto, fixed, model in minidist.run(_bucket_default, 2, timeout=45):
        assert auto == model and fixed == 25.0


def test_bench_has_an_auto_row_naming_what_it_ran():
    from minidist_course import bench
    rows = bench.run_bench(ops=("all_reduce", "broadcast"), algorithms=("torch", "auto"),
                           world_sizes=(2,), sizes=[1024, 4096], iters=1, progress=False)
    auto = [r for r in rows if r["algorithm"] == "auto"]
    assert len(auto) == 4 and not any(r["wrong"] for r in rows)
    for r in auto:
        assert r["chosen"] == tuner.table().choose(r["op"], 2, r["bytes"])
    table = bench.format_table(rows)
    assert f"auto:{'rd' if auto[0]['chosen'] == 'recursive_doubling' else auto[0]['chosen']}" in table
    assert "auto:X: algorithm='auto' ran X" in table


def test_a_bad_algorithm_name_is_a_clear_error():
    from minidist.communicator import check_algorithm
    assert check_algorithm("auto") == "auto" and check_algorithm("tree") == "tree"
    with pytest.raises(ValueError, match="algorithm must be 'auto' or one of .*'recursive_doubling'"):
        check_algorithm("rign")


def _choices_rank(rank, world, tables):
    out = []
    for key in (("all_reduce", "naive"), ("all_reduce", "recursive_doubling")):
        os.environ[tuner.ENV] = tables[key]
        tuner.reset_cache()
        for _ in range(2):      # the second call is answered from the remembered choice
            p2p.reset_traffic()
            C.all_reduce(torch.ones(1000), algorithm="auto")
            out.append(sorted(p2p.traffic()))
    return out


@pytest.mark.timeout(60)
def test_remembered_choices_follow_a_new_table_after_reset_cache(forcing_tables):
    got = minidist.run(_choices_rank, 2, forcing_tables, timeout=45)
    assert got[0] == got[1] == [["all_reduce/naive"]] * 2 + [["all_reduce/recursive_doubling"]] * 2
