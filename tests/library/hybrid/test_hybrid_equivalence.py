"""DP x TP x PP on the tiny GPT equals one process on the full global batch (issue 12, core).

For each grid (dp, tp, pp) — with 1F1B or interleaved 1F1B, with and without sequence parallelism,
with each DP mode (the engine's flat average, bucketed DDP per chunk, ZeRO-1), each loss
reduction, and a tied embedding — one ``train_step`` (no optimizer step) gives:

* the global batch's loss, on every rank, within 1e-6 relative of one process;
* the global gradient norm within 1e-6 relative of ``torch.nn.utils.clip_grad_norm_`` (clipping
  is active: max_norm 0.25 is below every reference norm);
* every clipped gradient, gathered over TP shards and pipeline stages, covering every parameter:
  ||Δ|| <= 1e-6·||ref|| over the whole model, and per tensor <= 2e-6·||ref_tensor|| (fp32; the
  measured worst per-tensor values, LayerNorm gradients summed over 256 tokens in another order,
  are 5e-7 to 9e-7);
* DP replicas and the tied embedding's two copies bitwise equal.

The model: 8 layers, 4 heads, width 32, sequence 16, vocabulary 93 (padded at every tp > 1).
"""

import pytest
import torch
import torch.nn.functional as F

import minidist
from minidist.trace import Timeline
from minidist.grid import ProcessGrid
from minidist.hybrid import HybridGPT, make_optimizer, train_step, wrap_stages
from minidist.models.gpt import GPT, GPTConfig

BASE = dict(vocab_size=93, block_size=16, n_layer=8, n_head=4, n_embd=32)
B, MAX_NORM, TOL_MODEL, TOL_TENSOR = 16, 0.25, 1e-6, 2e-6

# (dp, tp, pp, chunks, sequence_parallel, dp_mode, microbatches, loss_reduction, tie)
CONFIGS = [
    (2, 2, 2, 1, False, "flat", 2, "mean", False),
    (1, 2, 4, 1, False, "bucketed", 4, "per_token", False),
    (4, 1, 2, 1, False, "zero1", 2, "sum", False),
    (2, 4, 1, 1, True, "bucketed", 2, "mean", False),
    (8, 1, 1, 1, False, "bucketed", 2, "mean", False),
    (1, 1, 8, 1, False, "flat", 8, "per_token", True),
    (2, 2, 2, 2, True, "flat", 2, "per_token", True),       # interleaved + SP + tied
    (1, 2, 2, 2, False, "zero1", 4, "mean", True),          # interleaved, ZeRO-1, tied
    (2, 1, 2, 2, False, "bucketed", 2, "sum", False),       # interleaved, bucketed
    (2, 2, 1, 2, False, "flat", 2, "mean", True),           # two chunks on one rank, tied
    (2, 2, 2, 1, True, "zero1", 2, "mean", True),           # ZeRO-1 slices mix TP-sharded,
]                                                           # TP-replicated and tied params


def cfg_of(tie):
    return GPTConfig(**BASE, tie_embeddings=tie)


def batch(ignore, n=B):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, BASE["vocab_size"], (n, BASE["block_size"]), generator=g)
    targets = torch.randint(0, BASE["vocab_size"], (n, BASE["block_size"]), generator=g)
    if ignore:  # about 30% of the positions ignored, unevenly over micro-batches
        targets[torch.rand(targets.shape, generator=g) < 0.3] = -100
    return ids, targets


def _rank(rank, world, dp, tp, pp, v, sp, mode, M, reduction, tie, n=B, schedule=None,
          recompute="none"):
    grid = ProcessGrid(dp, pp, tp)
    placement = "v" if schedule in ("zb-v", "dualpipe-v") else "loop"
    model = HybridGPT(cfg_of(tie), grid, chunks=v, sequence_parallel=sp, seed=0, placement=placement,
                      recompute=recompute)
    modules = wrap_stages(model, mode)
    # ZeRO-1 averages the gradients itself (reduce-scatter) and clips its slices
    opt = make_optimizer(model, mode, torch.optim.SGD, lr=0.0) if mode == "zero1" else None
    ids, targets = batch(reduction == "per_token", n)
    out = train_step(model, opt, modules, ids, targets, M, schedule=schedule, dp_mode=mode,
                     loss_reduction=reduction, max_norm=MAX_NORM, step=False)
    if opt is not None:
        opt.full_gradients_()    # all-gather the averaged, clipped slices into p.grad
    grads = model.gather(grads=True)
    return (grid.dp_rank, grid.pp_rank, grid.tp_rank), out.loss, out.grad_norm, grads


def reference(reduction, tie, n=B):
    torch.manual_seed(0)
    model = GPT(cfg_of(tie))
    ids, targets = batch(reduction == "per_token", n)
    logits, _ = model(ids)
    loss = F.cross_entropy(logits.reshape(-1, BASE["vocab_size"]), targets.reshape(-1),
                           reduction="sum" if reduction == "sum" else "mean")
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item()
    return loss.item(), norm, {k: p.grad.clone() for k, p in model.named_parameters()}


def compare(results, reduction, tie, n=B):
    ref_loss, ref_norm, ref = reference(reduction, tie, n)
    assert ref_norm > MAX_NORM, "clipping must be active for this check to mean something"
    by_stage = {}
    for (d, p, t), loss, norm, grads in results:
        assert loss == pytest.approx(ref_loss, rel=1e-6), f"rank ({d},{p},{t}) loss"
        assert norm == pytest.approx(ref_norm, rel=1e-6), f"rank ({d},{p},{t}) grad norm"
        if (p, t) in by_stage:   # DP replicas (and TP ranks, after gathering): bitwise equal
            other = by_stage[(p, t)]
            assert other.keys() == grads.keys()
            for k in grads:
                assert torch.equal(other[k], grads[k]), f"replicas differ on {k}"
        by_stage[(p, t)] = grads
    got = {}
    for grads in by_stage.values():
        got.update(grads)
    if tie and "head.weight" in got:   # the last stage's copy of the tied embedding
        assert torch.equal(got.pop("head.weight"), got["tok_emb.weight"]), "tied copies differ"
    assert set(got) == set(ref), f"missing {set(ref) - set(got)}, extra {set(got) - set(ref)}"
    diff = torch.cat([(got[k] - ref[k]).reshape(-1) for k in ref]).norm()
    whole = torch.cat([ref[k].reshape(-1) for k in ref]).norm()
    per_tensor = max(((got[k] - ref[k]).norm() / ref[k].norm()).item() for k in ref)
    assert diff / whole <= TOL_MODEL, f"model-wide relative error {diff / whole:.2e}"
    assert per_tensor <= TOL_TENSOR, f"worst per-tensor relative error {per_tensor:.2e}"
    return float(diff / whole), per_tensor


@pytest.mark.timeout(240)
@pytest.mark.parametrize("dp,tp,pp,v,sp,mode,M,reduction,tie", CONFIGS,
                         ids=[f"dp{c[0]}-tp{c[1]}-pp{c[2]}-v{c[3]}{'-sp' if c[4] else ''}-{c[5]}-"
                              f"{c[7]}{'-tied' if c[8] else ''}" for c in CONFIGS])
def test_one_step_equals_one_process(dp, tp, pp, v, sp, mode, M, reduction, tie):
    results = minidist.run(_rank, dp * tp * pp, dp, tp, pp, v, sp, mode, M, reduction, tie,
                           timeout=180)
    model_err, tensor_err = compare(results, reduction, tie)
    print(f"dp{dp} tp{tp} pp{pp} v{v} sp{sp} {mode} {reduction} tie{tie}: "
          f"model {model_err:.1e}, worst tensor {tensor_err:.1e}")


# The zero-bubble schedules (split backward: B now, the weight pass W later) under every DP mode.
# Bucketed DDP fills its buckets from the parameters' post-accumulate-grad hooks: until the weight
# pass went through autograd for every parameter, the biases (an edge straight into their
# AccumulateGrad) were written by hand past the hooks, and the DDP wrapper called them unused.
# Recomputation walks each block's graph twice under the split (B, then W): minidist's checkpoint
# refused the second walk until it recomputed once per backward call, as torch's does.
# (schedule, dp, tp, pp, chunks, sp, dp mode, micro-batches, loss reduction, tied, recompute)
ZERO_BUBBLE = [
    ("zb-h1", 2, 1, 2, 1, False, "bucketed", 2, "mean", False, "minidist"),
    ("zb-v", 2, 1, 2, 2, False, "bucketed", 2, "per_token", True, "none"),  # rank 0: both copies
    ("dualpipe-v", 1, 2, 2, 2, True, "zero1", 4, "sum", True, "torch"),
    ("zb-v", 2, 2, 2, 2, False, "flat", 2, "mean", False, "minidist"),
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("schedule,dp,tp,pp,v,sp,mode,M,reduction,tie,recompute", ZERO_BUBBLE,
                         ids=[f"{c[0]}-dp{c[1]}-tp{c[2]}-pp{c[3]}-{c[6]}-recompute-{c[10]}"
                              for c in ZERO_BUBBLE])
def test_zero_bubble_schedules_equal_one_process(schedule, dp, tp, pp, v, sp, mode, M, reduction,
                                                 tie, recompute):
    results = minidist.run(_rank, dp * tp * pp, dp, tp, pp, v, sp, mode, M, reduction, tie, B,
                           schedule, recompute, timeout=180)
    compare(results, reduction, tie)


def test_a_schedule_that_does_not_fit_the_model_is_refused_naming_both():
    """No silent switch: a V-shaped schedule on a model built for the loop placement (or the
    other way round) is a ValueError naming the schedule and the model's chunks and placement."""
    def fn(rank, world, schedule, chunks):
        model = HybridGPT(cfg_of(False), ProcessGrid(1, 2, 1), chunks=chunks, seed=0)
        ids, targets = batch(False)
        with pytest.raises(ValueError, match=rf"schedule '{schedule}' runs .* placement='loop'"):
            train_step(model, None, wrap_stages(model), ids, targets, 4, schedule=schedule,
                       step=False)
        return True
    assert minidist.run(fn, 2, "zb-v", 2, timeout=60) == [True, True]
    assert minidist.run(fn, 2, "zb-h1", 2, timeout=60) == [True, True]


def every_grid(max_world=8):
    """Every (dp, tp, pp) with dp·tp·pp <= max_world that divides the model (tp | 4 heads, pp <= 8
    layers), with a DP mode, loss reduction, SP and tying that rotate over the list."""
    grids = [(dp, tp, pp) for w in range(1, max_world + 1) for tp in (1, 2, 4) for pp in range(1, 9)
             for dp in range(1, 9) if dp * tp * pp == w]
    modes, reductions = ("flat", "bucketed", "zero1"), ("mean", "sum", "per_token")
    return [(dp, tp, pp, tp > 1 and i % 2 == 0, modes[i % 3], reductions[(i // 3) % 3],
             pp > 1 and i % 2 == 1) for i, (dp, tp, pp) in enumerate(grids)]


@pytest.mark.exhaustive   # 31 grids, 1 to 8 ranks each: ~5 min on 2 busy cores; CONFIGS above
@pytest.mark.timeout(240)  # are the default tier's representative subset
@pytest.mark.parametrize("dp,tp,pp,sp,mode,reduction,tie", every_grid(),
                         ids=[f"dp{g[0]}-tp{g[1]}-pp{g[2]}" for g in every_grid()])
def test_every_grid_up_to_8_ranks(dp, tp, pp, sp, mode, reduction, tie):
    """Every combination up to 8 ranks (world sizes 3, 5, 6, 7 included) runs and equals one
    process; the global batch is 2·max(pp, 1) samples per replica, pp micro-batches."""
    n = dp * max(2, pp)
    results = minidist.run(_rank, dp * tp * pp, dp, tp, pp, 1, sp, mode, pp, reduction, tie, n,
                           timeout=180)
    compare(results, reduction, tie, n)


@pytest.mark.timeout(120)
def test_bucketed_ddp_really_syncs_once_per_chunk():
    """BucketedDDP inside the pipeline: of the 4 micro-batches' backwards of each chunk, only the
    last synchronises (one bucketed backward per chunk and step, every bucket launched once)."""
    def fn(rank, world):
        grid = ProcessGrid(2, 2, 1)
        model = HybridGPT(cfg_of(False), grid, chunks=2, seed=0)
        modules = wrap_stages(model, "bucketed")
        synced = {s: 0 for s in modules}
        for s, m in modules.items():
            def counting(m=m, s=s, original=m._start_backward):
                synced[s] += 1
                original()
            m._start_backward = counting
        ids, targets = batch(False)
        for _ in range(2):
            train_step(model, None, modules, ids, targets, 4, dp_mode="bucketed", step=False)
        return {s: (len(m.buckets), len(m.launch_log), synced[s]) for s, m in modules.items()}
    for stages in minidist.run(fn, 4, timeout=90):
        assert len(stages) == 2
        for s, (n_buckets, launched, synced) in stages.items():
            assert n_buckets > 1, "the bucket cap should give several buckets"
            assert launched == n_buckets, f"stage {s}: {launched} launches for {n_buckets} buckets"
            assert synced == 2, f"stage {s}: {synced} synchronised backwards in 2 steps"


@pytest.mark.timeout(120)
def test_timeline_is_recorded_and_changes_nothing():
    """An observed step (the per-rank Gantt chart's input) on a 3-D grid: every F and B op of the
    rank's stages appears once, the transport's and the DP sync's spans too, and the gradients are
    bitwise those of an unobserved step."""
    def fn(rank, world):
        grid = ProcessGrid(1, 2, 2)
        model = HybridGPT(cfg_of(False), grid, chunks=2, seed=0)
        modules = wrap_stages(model, "flat")
        ids, targets = batch(False)
        tl = Timeline()
        with tl.observe():
            out = train_step(model, None, modules, ids, targets, 2, step=False)
        recorded = model.gather(grads=True)
        train_step(model, None, modules, ids, targets, 2, step=False)
        plain = model.gather(grads=True)
        ops = sorted((e.kind, e.mb, e.stage) for e in out.result.events if e.kind in "FB")
        kinds = {e.kind for e in out.result.events + tl.events}
        return sorted(model.stages), ops, kinds, all(torch.equal(recorded[k], plain[k])
                                                     for k in plain)
    for stages, ops, kinds, same in minidist.run(fn, 4, timeout=90):
        assert ops == sorted((k, m, s) for k in "FB" for m in range(2) for s in stages)
        assert {"send", "recv", "dp_sync"} <= kinds
        assert same
