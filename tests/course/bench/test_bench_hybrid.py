"""``minidist bench 3d`` and the MFU arithmetic (minidist_course.bench.hybrid, minidist_course.bench.mfu).

No timing asserts: the MFU formula is checked against a hand count and against two independent
counts (the parameters of the GPT's Linear layers; the planner's compute FLOPs), and the bench runs
end to end with tiny settings and produces every field of the table and of its JSON.
"""

import json

import pytest
import torch

from minidist_course.bench import hybrid as H, mfu as U
from minidist.models.gpt import GPT, GPTConfig
from minidist_course.planner.search import Config, ModelSpec, predict

TINY = dict(vocab_size=10, block_size=4, n_layer=2, n_head=2, n_embd=8)


def test_model_flops_hand_count():
    cfg = GPTConfig(**TINY)
    # N = L·12h² + V·h = 2·12·64 + 10·8 = 1616; 6N = 9696; attention 12·L·s·h = 12·2·4·8 = 768
    assert U.matmul_params(cfg) == 1616
    assert U.model_flops_per_token(cfg) == 9696 + 768
    assert U.model_flops_per_step(cfg, 3) == 3 * 4 * 10464          # 3 sequences of 4 tokens
    assert U.model_flops_per_token(cfg, seq_len=2) == 9696 + 384
    # 125568 FLOPs in 2 s on a 1 MFLOP/s peak: 6.2784 %
    assert U.mfu(cfg, 3, 2.0, 1e6) == pytest.approx(0.062784, rel=1e-12)
    assert U.cpu_peak_flops(1e9, 8, cores=2) == 2e9               # 8 ranks share 2 cores
    assert U.cpu_peak_flops(1e9, 1, cores=2) == 1e9
    with pytest.raises(ValueError, match="ranks >= 1"):
        U.cpu_peak_flops(1e9, 0)
    with pytest.raises(ValueError, match="global_batch"):
        U.model_flops_per_step(cfg, 0)


def test_matmul_params_are_the_gpts_linear_weights():
    cfg = GPTConfig(vocab_size=93, block_size=16, n_layer=3, n_head=4, n_embd=32)
    linear = sum(m.weight.numel() for m in GPT(cfg).modules() if isinstance(m, torch.nn.Linear))
    assert U.matmul_params(cfg) == linear


def test_model_flops_equal_the_planners_compute():
    cfg = GPTConfig(vocab_size=93, block_size=16, n_layer=3, n_head=4, n_embd=32)
    q = predict(ModelSpec.from_gpt_config(cfg), Config(1, 1, 1, 1), 8, flop_rate=1.0,
                device_memory=float("inf"), precision="fp32", act_bytes=4)
    assert q.time["compute"] == pytest.approx(U.model_flops_per_step(cfg, 8), rel=1e-12)


def test_microbatches_and_config_errors():
    assert H.microbatches_for(16, 2, 4) == 4
    assert H.microbatches_for(16, 8, 4) == 2
    assert H.microbatches_for(12, 1, 5) == 4      # a divisor of 12 that is <= 5
    with pytest.raises(ValueError, match="does not split over dp=3"):
        H.microbatches_for(16, 3, 4)
    with pytest.raises(ValueError, match="not the world size 4"):
        H.bench_3d(configs={4: [(2, 1, 1)]}, flop_rate=1e9, link=(1e-5, 1e-9), calibrate=False,
                   progress=False)
    with pytest.raises(SystemExit):
        H.main(["--configs", "2,x,1"])


FIELDS = {"world_size", "dp", "tp", "pp", "microbatches", "measured_s", "min_s", "max_s", "times",
          "tokens_per_s", "mfu", "predicted", "calibrated", "contended", "measured_parts"}


def test_bench_end_to_end_tiny(tmp_path, capsys):
    out = tmp_path / "b3d.json"
    args = ["--configs", "2,1,1", "1,1,2", "--steps", "1", "--warmup", "0", "--batch", "4",
            "--microbatches", "2", "--rounds", "2", "--flop-rate", "1e9", "--link", "1e-5,1e-9",
            "--breakdown", "--no-progress",
            "--json", str(out)] + [x for k, v in TINY.items() for x in (f"--{k.replace('_', '-')}",
                                                                         str(v))]
    from minidist_course import cli
    assert cli.main(["bench", "3d", *args]) == 0
    text = capsys.readouterr().out
    assert "measured ms" in text and "Spearman" in text and "within 30%" in text
    assert "where the time goes" in text
    res = json.loads(out.read_text())
    assert res["format"] == H.FORMAT and res["model"] == TINY and res["flop_rate"] == 1e9
    assert res["link"] == {"2": {"alpha": 1e-5, "beta": 1e-9}} and res["layer_overhead"] >= 0
    assert [(r["dp"], r["tp"], r["pp"], r["microbatches"]) for r in res["rows"]] == \
        [(2, 1, 1, 2), (1, 1, 2, 2)]
    for r in res["rows"]:
        assert set(r) == FIELDS and r["measured_s"] > 0 and len(r["times"]) == 2   # 2 rounds
        assert r["tokens_per_s"] == pytest.approx(4 * 4 / r["measured_s"])
        parts = r["measured_parts"]      # tp = 1: no TP; one replica (dp = 1): no DP; pp = 1: no PP
        assert set(parts) == {"compute", "tp", "pp", "dp", "other", "optimizer"} and parts["compute"] > 0
        assert 0 < parts["optimizer"] <= parts["other"]
        assert parts["tp"] == 0 and (parts["dp"] > 0) == (r["dp"] > 1) and (parts["pp"] > 0) == (r["pp"] > 1)
        peak = U.cpu_peak_flops(1e9, 2, res["cores"])
        assert r["mfu"] == pytest.approx(U.model_flops_per_step(GPTConfig(**TINY), 4)
                                         / r["measured_s"] / peak)
        for p in ("predicted", "calibrated", "contended"):
            assert r[p]["ratio"] == pytest.approx(r["measured_s"] / r[p]["step_s"])
            assert r[p]["within"] == (abs(r[p]["ratio"] - 1) <= 0.3)
            assert set(r[p]["parts"]) == {"compute", "bubble", "tp", "pp", "dp", "optimizer"}
        assert r["contended"]["parts"]["optimizer"] > 0 == r["calibrated"]["parts"]["optimizer"]
    assert res["group_links"] == {"2": {"2": {"alpha": 1e-5, "beta": 1e-9}}}  # n = W: the link
    assert 0 < res["optimizer_s"] and res["contended_layer_overhead"] >= 0
    s = res["summary"]["2"]["predicted"]
    assert set(s) == {"within", "spearman", "best_measured", "best_predicted", "best_agree",
                      "worst_measured", "worst_predicted", "worst_agree"}
    assert abs(s["spearman"]) == pytest.approx(1.0)  # two configurations: ranks agree or swap
    assert s["best_agree"] == (s["spearman"] > 0)


def test_summary_on_known_rows():
    def row(c, measured, predicted):
        return dict(world_size=4, dp=c[0], tp=c[1], pp=c[2], measured_s=measured,
                    predicted=dict(step_s=predicted, within=abs(measured / predicted - 1) <= 0.3))
    rows = [row((4, 1, 1), 1.0, 1.1), row((2, 2, 1), 3.0, 2.0), row((1, 1, 4), 2.0, 5.0)]
    s = H.summarize(rows)[4]["predicted"]
    assert s["within"] == pytest.approx(1 / 3)
    assert s["spearman"] == pytest.approx(0.5)                 # ranks (1,3,2) vs (1,2,3)
    assert s["best_measured"] == s["best_predicted"] == (4, 1, 1) and s["best_agree"]
    assert (s["worst_measured"], s["worst_predicted"], s["worst_agree"]) == ((2, 2, 1), (1, 1, 4), False)


def test_group_links_measure_every_group_size_at_once():
    links = H.measure_group_links(4, sizes=(1024, 4096), reps=2, timeout=120)
    assert sorted(links) == [2, 4]       # two groups of 2 at once, then one group of 4
    assert all(a >= 0 and b >= 0 and a + b > 0 for a, b in links.values())
    with pytest.raises(ValueError, match="group size 3"):
        H.measure_group_links(4, group_sizes=[3])
