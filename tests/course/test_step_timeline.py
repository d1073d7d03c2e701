"""The per-rank timeline of one 3-D step (minidist_course.diagrams.step_timeline): what each rank did, by kind.

Deterministic checks only (no timing asserts): on a (dp, tp, pp) = (2, 2, 2) step every rank has
compute, TP, PP and DP events, in each DP mode; on (1, 2, 2) every rank has compute, TP and PP
events and no DP event (one replica: nothing to average). The TP events are the region crossings
the accounting counts (2 all-reduces per block per pass, plus the embedding's and the head's), the
chart has one row per rank with a legend entry per kind present, and recording leaves the step's
result (loss, gradients) unchanged.
"""

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402

import minidist  # noqa: E402
from minidist.grid import ProcessGrid  # noqa: E402
from minidist.hybrid import HybridGPT, make_optimizer, train_step, wrap_stages  # noqa: E402
from minidist_course.diagrams import step_timeline as T  # noqa: E402
from minidist.models.gpt import GPTConfig  # noqa: E402
from minidist.trace import Event  # noqa: E402

CFG = dict(vocab_size=29, block_size=8, n_layer=4, n_head=2, n_embd=16)
B, M = 8, 2


def _rank(rank, world, dp, tp, pp, mode, tie=False, sp=False):
    grid = ProcessGrid(dp, pp, tp)
    model = HybridGPT(GPTConfig(**CFG, tie_embeddings=tie), grid, sequence_parallel=sp, seed=0)
    modules = wrap_stages(model, mode)
    opt = make_optimizer(model, mode, torch.optim.SGD, lr=0.1)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CFG["vocab_size"], (B, CFG["block_size"]), generator=g)
    targets = torch.randint(0, CFG["vocab_size"], (B, CFG["block_size"]), generator=g)
    plain = train_step(model, None, modules, ids, targets, M, dp_mode=mode, max_norm=1.0,
                       step=False)
    out, events = T.record_step(model, opt, modules, ids, targets, M, dp_mode=mode, max_norm=1.0)
    return grid.rank, plain.loss, out.loss, events, model.n_stages


def _check_kinds(results, want_dp: bool):
    for rank, plain_loss, loss, events, _ in results:
        assert loss == pytest.approx(plain_loss, rel=1e-6)   # recording changes nothing
        kinds = {T.kind_of(e) for e in events}
        assert {"compute", "tp", "pp"} <= kinds, (rank, kinds)
        assert ("dp" in kinds) == want_dp, (rank, kinds)
        assert {e.rank for e in events} == {rank}
        assert all(e.end >= e.start for e in events)


@pytest.mark.parametrize("mode", ["flat", "bucketed", "zero1"])
def test_every_kind_on_every_rank_222(mode):
    results = minidist.run(_rank, 8, 2, 2, 2, mode, mode == "flat", mode == "zero1", timeout=240)
    _check_kinds(results, want_dp=True)
    names = {e.name for r in results for e in r[3]}
    want = {"flat": "dp_sync", "zero1": "zero1 all-gather", "bucketed": "all-reduce b0"}[mode]
    assert want in names
    if mode == "flat":
        assert "tied grads" in names            # first and last stage sum the tied embedding
    if mode == "zero1":
        assert "sp grads" in names
    if mode == "bucketed":                      # the bucket all-reduces ran on the comm thread
        assert {e.lane for r in results for e in r[3] if e.name.startswith("all-reduce")} == {"comm"}


def test_one_replica_122_has_no_dp_events_and_counts_tp_crossings():
    results = minidist.run(_rank, 4, 1, 2, 2, "flat", timeout=240)
    _check_kinds(results, want_dp=False)
    for rank, _, _, events, _ in results:
        tp = [e for e in events if e.name.startswith("tp ")]
        # stage with 2 blocks: per micro-batch 2 all-reduces forward + 2 backward per block;
        # stage 0 adds the embedding's all-reduce (forward), the last stage the head's f (backward)
        assert len(tp) == M * (2 * 4 + 1), (rank, [e.name for e in tp])
        assert {e.name for e in tp} == {"tp all_reduce"}
        # a TP collective runs inside a forward or backward bar of the same rank
        compute = [e for e in events if e.name in ("F", "B")]
        assert all(any(c.start <= e.start and e.end <= c.end for c in compute) for e in tp)


def test_align_kinds_and_plot():
    per_rank = [[Event("F", 10.0, 10.5), Event("tp all_reduce", 10.1, 10.2)],
                [Event("B", 10.2, 10.8, rank=1), Event("all-reduce b0", 10.3, 10.4, "comm", 1),
                 Event("recv", 10.8, 10.9, rank=1)]]
    flat = T.align(per_rank)
    assert min(e.start for e in flat) == 0.0 and [e.rank for e in flat] == [0, 0, 1, 1, 1]
    by = T.time_by_kind(per_rank)
    assert by[0]["compute"] == pytest.approx(0.5) and by[0]["tp"] == pytest.approx(0.1)
    assert by[1]["dp"] == pytest.approx(0.1) and by[1]["pp"] == pytest.approx(0.1)
    assert [T.kind_of(n) for n in ("F", "sp grads", "send wait", "ddp wait", "clip", "zero1 all-gather")] \
        == ["compute", "tp", "pp", "dp", "other", "dp"]
    ax = T.plot_step_timeline(per_rank, title="t")
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 1", "rank 0"]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["forward", "backward", "TP comm", "PP comm", "DP comm"]
    # the background thread's all-reduce is a thin bar; main-thread ones fill the row
    heights = sorted({round(p.get_paths()[0].get_extents().height, 2) for p in ax.collections})
    assert heights == [0.16, 0.84]


def test_lesson_step_timeline_aligned_over_ranks():
    from minidist_course.lessons.hybrid_timeline import step_timeline
    events = step_timeline(1, 2, 2, model=CFG, batch=B, microbatches=M, dp_mode="bucketed")
    assert min(e.start for e in events) == 0.0
    assert {e.rank for e in events} == {0, 1, 2, 3}
    by = T.time_by_kind(events)
    assert all(by[r]["compute"] > 0 and by[r]["tp"] > 0 and by[r]["pp"] > 0 and by[r]["dp"] == 0
               for r in range(4))
