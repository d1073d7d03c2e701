"""minidist.plan: the formulas it cites, its validity rules, the CPU mode and its errors.

Deterministic: every number is computed, nothing is timed.
"""

import json
import math

import pytest
import torch

from minidist_course import cli
from minidist_course.planner import calc
from minidist_course import planner as P
from minidist.models.gpt import GPT, GPTConfig

GPT3 = P.ModelSpec(layers=96, hidden=12288, heads=96, vocab=51200, seq_len=2048)
TINY = GPTConfig(vocab_size=96, block_size=32, n_layer=4, n_head=4, n_embd=32)


def _predict(model, cfg, batch, **kw):
    kw = dict(flop_rate=1e12, device_memory=80e9) | kw
    return P.predict(model, cfg, batch, **kw)


@pytest.mark.parametrize("tied", [False, True])
def test_parameter_count_equals_the_torch_model(tied):
    cfg = GPTConfig(vocab_size=96, block_size=32, n_layer=3, n_head=4, n_embd=32, tie_embeddings=tied)
    model = GPT(cfg)
    expected = sum(p.numel() for p in model.parameters())   # a tied weight is counted once
    assert P.ModelSpec.from_gpt_config(cfg).params == expected


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_model_states_of_pure_data_parallelism_are_zeros_formulas(stage):
    """t = p = 1: weights + grads + optimizer = calc.zero_memory (ZeRO §5), plus, for stage 3, the
    one gathered layer the planner adds."""
    m = P.ModelSpec(layers=4, hidden=256, heads=4, vocab=1000, seq_len=64)
    q = _predict(m, P.Config(dp=8, tp=1, pp=1, microbatches=1, zero=stage), 8)
    states = q.memory["weights"] + q.memory["grads"] + q.memory["optimizer"]
    gathered = 2 * m.layer_params if stage == 3 else 0
    assert states - gathered == pytest.approx(calc.zero_memory(m.params, 8, stage, "bf16"))


@pytest.mark.parametrize("t,sp,expected_per_layer", [
    (1, False, 34 + 80), (8, False, 10 + 24 / 8 + 80 / 8), (8, True, 34 / 8 + 80 / 8)])
def test_activation_memory_is_korthikanti_table_2(t, sp, expected_per_layer):
    """GPT-3: 5as/h = 80 (Korthikanti et al. 2022, §4.2); one stage, one micro-batch of 1:
    L layers of sbh(...) plus the fp32 logits 4sbV/t (§4.3)."""
    q = _predict(GPT3, P.Config(dp=1, tp=t, pp=1, microbatches=1), 1, sequence_parallel=sp)
    sbh = 2048 * 12288
    assert q.memory["activations"] == pytest.approx(96 * sbh * expected_per_layer + 4 * 2048 * 51200 / t)


def test_recomputation_keeps_the_layer_inputs_and_selective_drops_the_attention_term():
    cfg = dict(dp=1, tp=8, pp=8, microbatches=8)
    full = _predict(GPT3, P.Config(**cfg, recompute="full"), 8)
    sel = _predict(GPT3, P.Config(**cfg, recompute="selective"), 8)
    none = _predict(GPT3, P.Config(**cfg), 8)
    sbh = 2048 * 12288
    # first stage: 12 layers x 8 in flight x 2sbh, + one layer's full set while recomputing
    assert full.memory["activations"] == pytest.approx(12 * 8 * 2 * sbh + sbh * (10 + 3 + 10))
    assert sel.memory["activations"] == pytest.approx(12 * 8 * sbh * (10 + 3))
    assert none.memory["activations"] == pytest.approx(12 * 8 * sbh * (10 + 3 + 10))
    assert full.time["compute"] > sel.time["compute"] > none.time["compute"]


@pytest.mark.parametrize("p,m,v,in_flight", [(4, 8, 1, 4), (4, 2, 1, 2), (4, 8, 2, 4 * (1 + 3 / 8)),
                                              (1, 8, 1, 1)])
def test_1f1b_in_flight_micro_batches(p, m, v, in_flight):
    q = _predict(GPT3, P.Config(dp=1, tp=8, pp=p, microbatches=m, v=v), 8)
    assert q.in_flight == pytest.approx(in_flight)


@pytest.mark.parametrize("p,m,v", [(1, 4, 1), (4, 4, 1), (4, 16, 1), (4, 16, 2), (8, 8, 4)])
def test_bubble_is_p_minus_1_over_v_m_of_the_compute(p, m, v):
    q = _predict(GPT3, P.Config(dp=1, tp=8, pp=p, microbatches=m, v=v), 16)
    assert q.time["bubble"] == pytest.approx((p - 1) / (v * m) * q.time["compute"])
    t = q.time
    assert q.step_s == pytest.approx(t["compute"] + t["bubble"] + t["exposed"])
    assert q.tokens_per_s == pytest.approx(16 * 2048 / q.step_s)


def test_compute_is_the_flop_count_over_the_rate():
    """Forward 24bsh² + 4bs²h per layer + 2bshV, backward twice that (Narayanan et al. 2021, §5.1)."""
    q = _predict(GPT3, P.Config(dp=1, tp=1, pp=1, microbatches=1), 1, flop_rate=1e15)
    b, s, h, L, V = 1, 2048, 12288, 96, 51200
    flops = 3 * (L * (24 * b * s * h * h + 4 * b * s * s * h) + 2 * b * s * h * V)
    assert q.time["compute"] == pytest.approx(flops / 1e15)


def test_tensor_parallel_all_reduces_follow_calc_comm_time():
    links = P.Links(P.Link(1e-5, 1e-9), P.Link(1, 1))
    q = _predict(GPT3, P.Config(dp=1, tp=2, pp=1, microbatches=2), 2, links=links)
    one = calc.comm_time("all_reduce", 2048 * 12288 * 2, 2, 1e-5, 1e-9)
    small = calc.comm_time("all_reduce", 4 * 2048, 2, 1e-5, 1e-9)
    assert q.time["tp"] == pytest.approx(2 * ((96 * 4 + 2) * one + 3 * small))


def test_zero_3_moves_more_than_zero_0_and_overlap_hides_it():
    m = P.ModelSpec(layers=4, hidden=256, heads=4, vocab=1000, seq_len=64)
    z0, z3 = (_predict(m, P.Config(dp=4, tp=1, pp=1, microbatches=2, zero=z), 8, flop_rate=1e9,
                       overlap=0.0) for z in (0, 3))
    assert z3.time["dp"] > z0.time["dp"] > 0
    assert z0.time["overlapped"] == 0 and z0.time["exposed"] == pytest.approx(z0.time["dp"])
    hidden = _predict(m, P.Config(dp=4, tp=1, pp=1, microbatches=2, zero=0), 8, flop_rate=1e9)
    assert hidden.time["exposed"] < z0.time["exposed"]
    # ZeRO-1 as minidist.hybrid runs it: all-reduce the gradients, then all-gather the weights
    links = P.Links(P.Link(1e-5, 1e-9), P.Link(1e-5, 1e-9))
    z1 = _predict(m, P.Config(dp=4, tp=1, pp=1, microbatches=2, zero=1), 8, links=links,
                  precision="fp32", zero1_all_reduce=True)
    n = m.params * 4
    assert z1.time["dp"] == pytest.approx(calc.comm_time("all_reduce", n, 4, 1e-5, 1e-9)
                                          + calc.comm_time("all_gather", n, 4, 1e-5, 1e-9))


def test_pipeline_messages_and_the_tied_embedding_all_reduce():
    links = P.Links(P.Link(1e-5, 1e-9), P.Link(1e-5, 1e-9))
    for tied in (False, True):
        m = P.ModelSpec(layers=4, hidden=64, heads=4, vocab=100, seq_len=16, tied=tied)
        q = _predict(m, P.Config(dp=1, tp=1, pp=2, microbatches=4, v=2), 8, links=links)
        msg = 1e-5 + 2 * 16 * 64 * 2 * 1e-9                   # b = 2, bsh 16-bit activations
        emb = calc.comm_time("all_reduce", 100 * 64 * 2, 2, 1e-5, 1e-9) if tied else 0
        assert q.time["pp"] == pytest.approx(2 * (2 * 4 + 2 - 1) * msg + emb)


def test_plan_lists_only_valid_configurations_sorted_best_first():
    m = P.ModelSpec(layers=4, hidden=96, heads=6, vocab=100, seq_len=32)
    preds = P.plan(m, 12, 8, 1e9, 1e9, devices_per_node=4, interleave=(1, 2))
    assert preds
    for q in preds:
        c = q.config
        assert c.dp * c.tp * c.pp == 8 and 6 % c.tp == 0 and c.tp <= 4
        assert c.pp * c.v <= 4 and 12 % c.dp == 0 and (12 // c.dp) % c.microbatches == 0
        assert c.v == 1 or c.microbatches % c.pp == 0
        assert c.dp > 1 or c.zero == 0
    assert {q.config.tp for q in preds} == {1, 2}            # 4 does not divide 6 heads
    keys = [(not q.fits, q.step_s) for q in preds]
    assert keys == sorted(keys)
    assert len({q.config for q in preds}) == len(preds)


def test_configurations_that_do_not_fit_are_marked_or_filtered():
    preds = P.plan(GPT3, 8, 8, 80e9, 1e14)
    assert not any(q.fits for q in preds)                    # 175B on 8 GPUs: never
    with pytest.raises(ValueError, match="no configuration fits.*smallest needs"):
        P.plan(GPT3, 8, 8, 80e9, 1e14, only_fits=True)


@pytest.mark.parametrize("kw,match", [
    (dict(n_devices=0), "n_devices must be an int >= 1"),
    (dict(global_batch=2, n_devices=8), "no \\(dp, tp, pp\\).*global batch 2.*tp in \\[1\\].*heads=3"),
    (dict(recompute=("sometimes",)), "recompute must be among"),
    (dict(precision="fp8"), "precision must be one of"),
])
def test_impossible_inputs_say_what_to_change(kw, match):
    m = P.ModelSpec(layers=2, hidden=24, heads=3, vocab=100, seq_len=16)   # tp can only be 1
    args = dict(model=m, global_batch=4, n_devices=4, device_memory=1e9, flop_rate=1e9) | kw
    with pytest.raises(ValueError, match=match):
        P.plan(**args)


def test_this_machine_shares_the_cores_between_ranks():
    link = P.Link(5e-5, 1e-9)
    spec = P.ModelSpec.from_gpt_config(TINY)
    four = P.this_machine(spec, 8, 4, 1e9, link, cores=2, memory=1e9)
    q = next(x for x in four if x.config == P.Config(4, 1, 1, 1))
    alone = P.predict(spec, q.config, 8, 0.5e9, 1e9, P.Links(link, link), 4, precision="fp32",
                      act_bytes=4, overlap=0.0)
    assert q.step_s == pytest.approx(alone.step_s)           # 1e9 x min(1, 2/4)
    secs = P.predict_step_seconds(TINY, 8, 4, 1e9, link, cores=2, memory=1e9)
    assert secs[q.config] == pytest.approx(q.step_s) and len(secs) == len(four)
    assert {c.tp for c in secs} == {1, 2, 4} and all(v > 0 for v in secs.values())


def test_layer_overhead_is_per_layer_per_pass_and_one_measured_step_calibrates_it():
    spec = P.ModelSpec.from_gpt_config(TINY)                 # 4 layers (+ the head: 5 blocks)
    cfg = P.Config(1, 1, 1, 2)
    q0, q1 = (P.predict(spec, cfg, 8, 1e9, 1e9, layer_overhead=x) for x in (0.0, 1e-4))
    assert q1.time["compute"] - q0.time["compute"] == pytest.approx(2 * 3 * 5 * 1e-4)
    measured = P.predict(spec, cfg, 8, 1e9, 1e9, precision="fp32", act_bytes=4,
                         layer_overhead=3e-4).step_s
    assert P.calibrate_overhead(spec, 8, measured, 1e9, microbatches=2) == pytest.approx(3e-4)
    assert P.calibrate_overhead(spec, 8, 1e-12, 1e9) == 0.0  # FLOPs alone are slower: no negative
    with pytest.raises(ValueError, match="measured_step_s must be > 0"):
        P.calibrate_overhead(spec, 8, 0.0, 1e9)
    # four ranks on two cores: each rank's overhead (like its FLOP rate) stretches by 4/2
    link = P.Link(0.0, 0.0)
    four = P.this_machine(spec, 8, 4, 1e9, link, cores=2, memory=1e9, layer_overhead=1e-4)
    q = next(x for x in four if x.config == P.Config(4, 1, 1, 1))
    same = P.predict(spec, q.config, 8, 0.5e9, 1e9, P.Links(link, link), 4, precision="fp32",
                     act_bytes=4, overlap=0.0, layer_overhead=2e-4)
    assert q.step_s == pytest.approx(same.step_s)


def test_load_link_reads_the_alpha_beta_file(tmp_path):
    path = tmp_path / "ab.json"
    fits = [dict(op="all_reduce", algorithm="ring", world_size=4, alpha=9.0, beta=9.0),
            dict(op="all_reduce", algorithm="torch", world_size=2, alpha=1e-4, beta=2e-9),
            dict(op="all_reduce", algorithm="torch", world_size=4, alpha=2e-4, beta=3e-9)]
    path.write_text(json.dumps({"format": "minidist-alpha-beta/1", "fits": fits}))
    assert P.load_link(path, world_size=4) == P.Link(2e-4, 3e-9)
    assert P.load_link((1e-5, 1e-10)) == P.Link(1e-5, 1e-10)
    assert P.load_link("ib-hdr").beta == pytest.approx(1 / 25e9)
    (tmp_path / "empty.json").write_text("{}")
    with pytest.raises(ValueError, match="no alpha-beta fits"):
        P.load_link(tmp_path / "empty.json")


def test_spearman_against_the_rank_formula():
    assert P.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert P.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # no ties: 1 - 6 Σd² / (n(n² - 1)); ranks differ by 1 in two places -> 1 - 12/60
    assert P.spearman([1, 2, 3, 4, 5], [1, 3, 2, 4, 5]) == pytest.approx(0.9)
    a, b = torch.tensor([3.0, 1.0, 2.0, 2.0]), [1, 2, 3, 3]       # ties: average ranks
    ra, rb = torch.tensor([4, 1, 2.5, 2.5]), torch.tensor([1, 2, 3.5, 3.5])
    pearson = ((ra - ra.mean()) * (rb - rb.mean())).sum() / math.sqrt(
        ((ra - ra.mean()) ** 2).sum() * ((rb - rb.mean()) ** 2).sum())
    assert P.spearman(a.tolist(), b) == pytest.approx(pearson.item())
    with pytest.raises(ValueError, match="equal length"):
        P.spearman([1, 2], [1])


def test_cli_prints_a_table_and_reports_bad_input(capsys):
    assert cli.main(["plan", "--layers", "4", "--hidden", "256", "--heads", "8", "--vocab", "1000",
                     "--seq-len", "128", "--global-batch", "16", "--devices", "8", "--top", "5"]) == 0
    out = capsys.readouterr().out
    lines = out.strip().splitlines()   # header, assumptions, table head and rule, 5 rows, legend
    assert "dp  tp  pp" in out and "step s" in out and len(lines) == 2 + 2 + 5 + 1
    assert lines[1].startswith("assumed per device: 1.56e+14 FLOP/s (50% of the A100-80GB's peak")
    assert "nvlink3 (alpha 5 µs, 300 GB/s)" in lines[1] and "ib-hdr (alpha 10 µs, 25 GB/s)" in lines[1]
    assert lines[-1] == P.LEGEND and "v = model chunks per pipeline rank" in P.LEGEND
    assert all(f"{k} = " in P.LEGEND for k in ("m", "b", "infl"))
    assert cli.main(["plan", "--devices", "0"]) == 2
    assert "n_devices must be an int >= 1" in capsys.readouterr().err
    assert cli.main(["plan", "--this-machine", "--devices", "4"]) == 2
    assert "--this-machine needs the measured --flop-rate" in capsys.readouterr().err
    assert cli.main(["plan", "--this-machine", "--devices", "4", "--layers", "2", "--hidden", "32",
                     "--heads", "4", "--vocab", "96", "--seq-len", "32", "--global-batch", "8",
                     "--flop-rate", "2e9", "--intra", "5e-5,1e-9", "--memory", "1e9"]) == 0
    out = capsys.readouterr().out
    assert "yes" in out and "assumed per rank: 2e+09 FLOP/s (--flop-rate)" in out
    assert "one link between all ranks: 5e-5,1e-9 (alpha 50 µs, 1 GB/s)" in out
