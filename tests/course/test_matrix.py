"""The composition matrix (``minidist matrix``): the covering array covers every pair, the checker
rejects each plausible wrong result by name, and the configurations run as expected — the
default tier runs the strength-1 subset (every value once) in chapter 12's section 4.6 under
nbval; the integration tier runs it here and the whole array."""

import os
import subprocess
import sys

import pytest

from minidist.models.gpt import GPTConfig
from minidist_course.matrix import format_table, strength_three
from minidist_course.matrix.covering import (DIMENSIONS, UNREACHABLE, covering_array, cp_size,
                                             feasible, pair_refused, pairs_of, refusal,
                                             strength_one, world_size)
from minidist_course.matrix.resume import run_resume
from minidist_course.matrix.run import check, run_matrix
from minidist_course.references import hybrid as ref_hybrid


def test_the_array_covers_every_pair_within_the_limits_and_is_reproducible():
    array = covering_array(0)
    assert array == covering_array(0) and array != covering_array(1)
    covered = set().union(*(pairs_of(c) for c in array))
    dims = list(DIMENSIONS)
    every = {((a, x), (b, y)) for i, a in enumerate(dims) for b in dims[i + 1:]
             for x in DIMENSIONS[a] for y in DIMENSIONS[b]}
    assert covered >= every - UNREACHABLE        # (a refused configuration may hold one too)
    assert all(feasible(c) for c in array)       # at most 8 ranks, EP dividing DP x CP
    runnable = set().union(*(pairs_of(c) for c in array if refusal(c) is None))
    assert {p for p in every if not pair_refused(p)} - UNREACHABLE <= runnable   # by one that runs
    assert {p for p in every if pair_refused(p)}                   # and some are refused
    assert len(array) < 100                       # a few dozen, not the 77,760 of the product
    quick = strength_one(array)
    assert {(d, c[d]) for c in quick for d in DIMENSIONS} == {(d, v) for d in DIMENSIONS
                                                               for v in DIMENSIONS[d]}


def test_the_array_is_the_same_in_every_process_and_builds_for_every_seed():
    """Regression: the array once depended on the order of a set (Python's hash seed): chapter 12's
    table differed between two runs of the same commit, and some seeds raised RuntimeError."""
    code = ("import hashlib; from minidist_course.matrix.covering import covering_array as a; "
            "print(hashlib.md5(repr([a(s) for s in range(3)]).encode()).hexdigest())")
    digests = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              env={**os.environ, "PYTHONHASHSEED": str(h)}).stdout for h in (1, 2)}
    assert len(digests) == 1, digests


def _config(**kw):
    base = {"schedule": "1f1b", "dp_mode": "flat", "recompute": "none", "cp": "1", "tp": "1",
            "loss": "sum", "dp": 2, "tie": False, "moe": "none", "precision": "fp32",
            "microbatches": 4}
    return {**base, **kw}


def _results(ref, bump=0.0, replica_off=False):
    """Two DP replicas of a one-stage 'grid' that returns the reference's own numbers."""
    out = []
    for d in range(2):
        grads = {k: v.clone() for k, v in ref["grads"].items()}
        if d == 1 and replica_off:
            k = next(iter(grads))
            grads[k] = grads[k] + 1e-12
        out.append({"coords": (d, 0, 0), "loss": ref["loss"] * (1 + bump),
                    "grad_norm": ref["grad_norm"], "grads": grads})
    return out


def test_the_checker_rejects_each_wrong_result_by_name():
    config = _config()
    refs = {}
    cfg = GPTConfig(**{**vars(ref_hybrid.CFG), "tie_embeddings": False})
    ref = refs[(False, "sum", "fp32")] = ref_hybrid.reference(ref_hybrid.MAX_NORM, cfg, 8, 0.0, "sum")
    assert check(config, _results(ref), refs)[0] == "✓"
    assert check(config, _results(ref, bump=1e-5), refs)[0] == "✗"  # loss 1e-5 relative off
    bf16 = _config(precision="bf16")      # mixed precision: bf16's tolerance, its own reference
    refs[(False, "sum", "bf16")] = ref
    assert check(bf16, _results(ref, bump=1e-2), refs)[0] == "✓"
    assert check(bf16, _results(ref, bump=1e-1), refs)[0] == "✗"
    assert check(config, _results(ref, replica_off=True), refs)[0] == "✗"   # replicas not bitwise
    missing = _results(ref)
    for r in missing:
        r["grads"].pop("ln_f.weight")
    assert check(config, missing, refs)[0] == "✗"                    # a parameter nobody returned
    # refusals: must happen on every rank, must name the features, must not happen elsewhere
    hsdp_ep = _config(dp_mode="hsdp", moe="ep2")
    words = "dp_mode='hsdp' with expert parallelism (ep=2) is not supported"
    assert check(hsdp_ep, [{"refused": words}] * 2, refs)[0] == "refused"
    assert check(hsdp_ep, [{"refused": "dp_mode='hsdp' is off"}] * 2, refs)[0] == "✗"
    assert check(hsdp_ep, _results(ref), refs)[0] == "✗"            # ran: should be refused
    assert check(hsdp_ep, [{"refused": words}, _results(ref)[1]], refs)[0] == "✗"   # one rank only
    assert check(config, [{"refused": "no"}] * 2, refs)[0] == "✗"    # refused, should run
    table = format_table([{**config, "world": 4, "status": "✓", "detail": ""},
                          {**hsdp_ep, "world": 8, "status": "✗", "detail": "loss 1e-3"}])
    assert "✗ schedule=1f1b" in table and "loss 1e-3" in table


@pytest.mark.exhaustive   # the default tier runs the same subset in chapter 12 (section 4.6)
@pytest.mark.timeout(300)
def test_every_value_once_runs_as_expected():
    rows = run_matrix(strength_one(covering_array(0)), timeout=240)
    bad = [r for r in rows if r["status"] == "✗"]
    assert not bad, format_table(rows)
    assert {r["status"] for r in rows} <= {"✓", "refused"} and "✓" in {r["status"] for r in rows}


@pytest.mark.exhaustive
@pytest.mark.serial        # launches of up to 8 ranks: beside other process trees, theirs starve
@pytest.mark.timeout(1800)
def test_every_triple_runs_as_expected():
    """The 3-wise array (every triple of values that holds no refused pair: every runnable pair
    too) and the pairwise array's refused configurations: ``minidist matrix --strength 3``."""
    configs = strength_three(0)
    assert len(configs) > 250
    rows = run_matrix(configs, timeout=900)
    table = format_table(rows)
    print(table)
    assert not [r for r in rows if r["status"] == "✗"], table
    all_row = next(line for line in table.splitlines() if line.startswith("all "))
    # no ✗; not run: at most the pairs no configuration within the limits can hold
    assert all_row.split()[-2] == "0" and int(all_row.split()[-1]) <= len(UNREACHABLE), all_row
    assert {r["status"] for r in rows} == {"✓", "refused"}


@pytest.mark.timeout(300)
def test_resume_matrix_on_four_ranks_is_bitwise(tmp_path):
    """The default tier's share of the resume matrix: the every-value-once configurations of 4
    ranks (schedules, DP modes, recomputation, CP methods, TP with SP), stopped after step 2,
    resumed in a new launch from another seed, bitwise equal (dropout on: the generators too)."""
    configs = [c for c in strength_one(covering_array(0)) if world_size(c) == 4]
    rows = run_resume(configs, str(tmp_path), timeout=240)
    assert len(rows) >= 4 and all(r["status"] == "✓" for r in rows), rows


@pytest.mark.exhaustive
@pytest.mark.serial        # twice the launches of the composition matrix
@pytest.mark.timeout(2400)
def test_every_configuration_resumes_bitwise(tmp_path):
    rows = run_resume(covering_array(0), str(tmp_path), timeout=600)
    bad = [r for r in rows if r["status"] != "✓"]
    assert len(rows) > 30 and not bad, bad


# pairs the matrix used to refuse (name: configuration), each now equal to one process
WERE_REFUSED = {
    # torchtitan runs TP with SP beside CP
    "sp x ring/zigzag": _config(tp="2+sp", dp=1, loss="mean", cp="ring/zigzag", schedule="zb-v",
                                dp_mode="zero1"),
    "sp x ulysses": _config(tp="2+sp", dp=1, loss="per_token", cp="ulysses", tie=True),
    "sp x ring/contiguous": _config(tp="2+sp", dp=1, loss="mean", cp="ring/contiguous",
                                    precision="bf16", recompute="torch"),
    # experts left out of the buckets / sharded over their own expert-DP group. Field reports:
    # expert gradients ep times too large without a divide factor (pytorch#160285, fixed in
    # torchtitan#1551; Megatron-LM#5956), and world-size times when the expert-DP group is one
    # rank (pytorch#167178): dp=2 x ep=2 below is that case
    "bucketed x ep2": _config(dp_mode="bucketed", moe="ep2", schedule="interleaved", tie=True),
    "zero1 x ep2/drop": _config(dp_mode="zero1", moe="ep2/drop", loss="per_token", tie=True),
    # each expert a fully_shard unit over its expert-DP group, under the stage's (torchtitan)
    "zero3 x ep2": _config(dp_mode="zero3", moe="ep2", schedule="zb-h1", recompute="minidist"),
    "zero3/keep x ep2/drop": _config(dp_mode="zero3/keep", moe="ep2/drop", schedule="interleaved"),
    # the weight pass W gathers the unit before it and reduce-scatters after it (pytorch#134052;
    # a W that bypasses autograd's hooks leaves DDP's gradients unreduced: pytorch#144530)
    "zero3 x zb-h1": _config(dp_mode="zero3", schedule="zb-h1", tie=True),
    "zero3/keep x zb-v": _config(dp_mode="zero3/keep", schedule="zb-v", recompute="minidist"),
    "hsdp x dualpipe-v": _config(dp_mode="hsdp", schedule="dualpipe-v", dp=1, cp="ring/zigzag",
                                 recompute="torch"),
    # experts under SP: each TP rank routes its own positions
    "sp x ep2": _config(tp="2+sp", moe="ep2", dp=2, loss="mean", schedule="zb-h1"),
    # ZeRO-2 under a pipeline: a reduce-scatter after every backward into the slices, added to
    # what the earlier ones left. Field reports: a ZeRO-2 that treats every backward as the
    # boundary keeps only the last micro-batch (allenai/open-instruct#1498), or copies instead
    # of adding after the first step (deepspeedai/DeepSpeed#6550): 4 and 6 micro-batches here,
    # and the 4-rank ones resume after step 2
    "zero2 x zb-v x sp": _config(dp_mode="zero2", schedule="zb-v", tp="2+sp", tie=True,
                                 loss="per_token"),
    "zero2 x interleaved x ep2": _config(dp_mode="zero2", schedule="interleaved", moe="ep2",
                                         tie=True, loss="sum"),
    # a capacity with CP or SP: one process drops among each rank's tokens, in the rank's order
    "ring/striped x ep2/drop": _config(cp="ring/striped", moe="ep2/drop", dp=1, loss="mean"),
    "sp x ep2/drop": _config(tp="2+sp", moe="ep2/drop", dp=2, loss="per_token"),
}


@pytest.mark.timeout(300)
def test_pairs_that_were_refused_now_equal_one_process_and_resume_bitwise(tmp_path):
    """Regression for the pairs the matrix used to refuse: each equal to one process (two
    launches, 4 and 8 ranks); the 4-rank ones also stopped after step 2 and resumed bitwise."""
    assert WERE_REFUSED["zero3 x ep2"]["dp"] * cp_size(WERE_REFUSED["zero3 x ep2"]) == 2  # ep=2:
    rows = run_matrix(list(WERE_REFUSED.values()), timeout=240)        # expert-DP of one rank
    assert [r["status"] for r in rows] == ["✓"] * len(rows), format_table(rows)
    four = [c for c in WERE_REFUSED.values() if world_size(c) == 4]
    resumed = run_resume(four, str(tmp_path), timeout=240)
    assert len(resumed) == len(four) and all(r["status"] == "✓" for r in resumed), resumed


def test_sequence_parallelism_with_context_parallelism_needs_each_cp_share_divisible_by_tp():
    from minidist.hybrid.stages import check_grid
    cfg = GPTConfig(**vars(ref_hybrid.CFG))
    check_grid(cfg, 1, 2, 4, sequence_parallel=True, rank=0, seq_len=16, cp=2)   # 8 per CP rank
    with pytest.raises(ValueError, match="the 6 positions each CP rank holds divisible by tp=4"):
        check_grid(cfg, 1, 2, 4, sequence_parallel=True, rank=0, seq_len=12, cp=2)
