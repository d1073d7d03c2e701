"""minidist.plan against published large runs (sources in minidist_course/planner/published.py).

* Narayanan et al. 2021 (Megatron-LM, SC'21), Table 1: the model sizes, and the (t, p) each row
  ran with on 80 GB A100s, 8 per node. The planner is given the paper's setting — mixed-precision
  Adam as Megatron keeps it (20 bytes/parameter, no optimizer sharding: ZeRO-0), full activation
  recomputation, 1F1B — and must rank the paper's (t, p) among its top 2 distinct (t, p), within
  6 % of its best predicted step, with t = 8 (a whole node) chosen from 76B up. Why top-2 and not
  top-1: where they differ, the planner either packs a shorter pipeline or smaller t closer to
  80 GB (3.6B, 7.5B, 310B, 530B: 76-79 GB, less bubble or TP traffic) where the paper keeps headroom
  (its choices need 49-58 GB here), or trades t = 8 for t = 4 and a deeper pipeline (18B, 39B);
  the paper's choice is then 0.3-6 % slower as predicted. Top-1 for 1.7B, 76B, 146B and 1T.
* BLOOM-176B (BigScience 2022): the published memory per GPU, 60 GB, for TP=4, PP=12, DP=8,
  micro-batch 2, ZeRO-1 (BF16_Optimizer), full recomputation: the planner's total for that exact
  configuration must be within 20 %.
"""

import pytest

from minidist_course import planner as P
from minidist_course.planner.published import BLOOM, BLOOM_MEMORY_PER_GPU, MEGATRON_TABLE1

A100 = dict(device_memory=80e9, flop_rate=0.5 * 312e12, devices_per_node=8)


def _megatron(row):
    billions, heads, hidden, layers, t, p, gpus, batch, _ = row
    return P.ModelSpec(layers, hidden, heads, 51200, 2048), (t, p), gpus, batch, billions


@pytest.mark.parametrize("row", MEGATRON_TABLE1, ids=[f"{r[0]}B" for r in MEGATRON_TABLE1])
def test_megatron_table1_parameter_counts(row):
    model, _, _, _, billions = _megatron(row)
    assert model.params / 1e9 == pytest.approx(billions, abs=0.05)


@pytest.mark.parametrize("row", MEGATRON_TABLE1, ids=[f"{r[0]}B" for r in MEGATRON_TABLE1])
def test_megatron_table1_choice_is_in_the_planners_top_two(row):
    model, paper, gpus, batch, billions = _megatron(row)
    preds = P.plan(model, batch, gpus, zero_stages=(0,), recompute=("full",),
                   precision="megatron-fp16", **A100)
    best = {}
    for q in preds:                           # best configuration of each (t, p), in plan order
        best.setdefault((q.config.tp, q.config.pp), q)
    ranked = list(best)
    assert paper in ranked[:2], f"paper {paper}, planner {ranked[:4]}"
    mine = best[paper]
    assert mine.fits and mine.step_s <= 1.06 * preds[0].step_s
    if billions >= 76:
        assert preds[0].config.tp == 8


def test_bloom_memory_per_gpu_within_20_percent_of_the_published_60_gb():
    b = BLOOM
    model = P.ModelSpec(b["layers"], b["hidden"], b["heads"], b["vocab"], b["seq_len"])
    assert model.params / 1e9 == pytest.approx(176.2, abs=0.2)     # "176,247M" (BLOOM paper)
    m = b["global_batch"] // (b["dp"] * b["micro_batch"])
    cfg = P.Config(b["dp"], b["tp"], b["pp"], m, b["zero"], b["recompute"])
    q = P.predict(model, cfg, b["global_batch"], 150e12, b["device_memory"],
                  devices_per_node=b["devices_per_node"], precision=b["precision"])
    assert q.micro_batch == b["micro_batch"] and q.in_flight == b["pp"]
    assert q.memory["total"] == pytest.approx(BLOOM_MEMORY_PER_GPU, rel=0.20)
    assert q.fits
    # and BLOOM's (4, 12) is a configuration the planner lists, fitting, among its top 5 (t, p)
    preds = P.plan(model, b["global_batch"], b["n_devices"], b["device_memory"], 150e12,
                   zero_stages=(1,), recompute=("full",), precision=b["precision"])
    ranked = list(dict.fromkeys((x.config.tp, x.config.pp) for x in preds))
    assert (b["tp"], b["pp"]) in ranked[:5]
