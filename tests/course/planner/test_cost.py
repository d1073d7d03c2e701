"""minidist_course.planner.cost against published numbers, hand-computed values, and a seeded simulation of
interrupted runs (the independent reference for the spot model)."""

import math
import random

import pytest

from minidist_course.planner import calc, cost

A100 = calc.GPUS["A100-80GB"]["peak_flops"]
H100 = calc.GPUS["H100-80GB"]["peak_flops"]


# --------------------------------------------------------------------------- FLOPs
def test_gpt3_training_flops_table_d1():
    # Brown et al. 2020, Table D.1: GPT-3 175B (174,600M parameters), 300B tokens: 3.14e23 FLOPs,
    # 3.64e3 PF-days (attention left out, as in the table)
    f = cost.training_flops(174.6e9, 300e9)
    assert round(f / 1e23, 2) == 3.14
    assert round(f / (1e15 * 86400) / 1e3, 2) == 3.64
    assert f == calc.training_flops(174.6e9, 300e9)  # 6·N·D comes from calc, not a copy


def test_attention_term_conventions_by_hand():
    # one layer, n_ctx 10, d_attn 7: forward QK^T = 2·10·7 = 140; + attention·V = 280; x3 training
    assert cost.attention_flops_per_token(1, 10, 7, "kaplan") == 3 * 140
    assert cost.attention_flops_per_token(1, 10, 7, "palm") == 3 * 280
    assert cost.attention_flops_per_token(1, 10, 7, "chinchilla") == 3 * 280
    # PaLM App. B: 6N + 12·L·H·Q·T per token (H heads of Q dims, sequence length T)
    L, H, Q, T, N = 118, 48, 256, 2048, 540.35e9
    per_token = cost.training_flops(N, 1.0, L, T, H * Q)
    assert per_token == pytest.approx(6 * N + 12 * L * H * Q * T)


def test_kaplan_context_term_is_small_when_d_model_exceeds_n_ctx_over_12():
    # Kaplan §2.1: with N ≈ 12·n_layer·d_model², the context term 2·n_layer·n_ctx·d_model is
    # n_ctx / (12·d_model) of the 2N term: small when d_model > n_ctx / 12
    layers, d, ctx = 24, 1024, 2048
    n = 12 * layers * d * d
    ratio = cost.attention_flops_per_token(layers, ctx, d, "kaplan") / (6 * n)
    assert ratio == pytest.approx(ctx / (12 * d))
    assert ratio < 1 and cost.attention_flops_per_token(layers, 24 * d, d, "kaplan") / (6 * n) == 2


def test_attention_needs_the_whole_shape():
    with pytest.raises(ValueError, match="all of n_layer, n_ctx and d_attn"):
        cost.training_flops(7e9, 2e12, n_layer=32)
    with pytest.raises(ValueError, match="convention"):
        cost.attention_flops_per_token(1, 1, 1, "gpt")


def test_llama2_7b_gpu_hours_imply_about_40_percent_mfu():
    # Touvron et al. 2023 (Llama 2), Table 2: the 7B model took 184,320 A100-80GB hours for 2T tokens
    tokens_per_gpu_second = 2e12 / (184320 * 3600)
    u = cost.mfu(tokens_per_gpu_second, 6 * 7e9, A100)
    assert 0.40 < u < 0.41
    assert cost.gpu_hours(cost.training_flops(7e9, 2e12), A100, u) == pytest.approx(184320)


# --------------------------------------------------------------------------- time, GPUs, MFU
def test_gpu_hours_by_hand_and_mfu_50_to_30():
    assert cost.gpu_hours(1e21, 1e15, 0.5) == pytest.approx(2e6 / 3600)
    assert cost.gpu_hours(1e21, 1e15, 0.3) / cost.gpu_hours(1e21, 1e15, 0.5) == pytest.approx(5 / 3)


def test_gpus_for_deadline():
    day = 86400.0
    flops = 8 * day * 1e15 * 0.5                   # exactly 8 GPUs for one day
    assert cost.gpus_for_deadline(flops, day, 1e15, 0.5) == 8
    assert cost.gpus_for_deadline(flops, day, 1e15, 0.5, gpus_per_node=8) == 8
    assert cost.gpus_for_deadline(flops * 1.001, day, 1e15, 0.5, gpus_per_node=8) == 16
    assert cost.gpus_for_deadline(flops, 2 * day, 1e15, 0.5) == 4
    assert cost.gpus_for_deadline(1.0, day, 1e15, 0.5, gpus_per_node=8) == 8  # at least a node
    assert cost.gpus_for_deadline(flops, day, 1e15, 0.3) == 14                # 8 · 5/3 = 13.3
    # the primer-sized model: 1.2e24 FLOPs in 90 days on H100s at 40% MFU: 390.1 -> 49 nodes
    assert cost.gpus_for_deadline(1.2e24, 90 * day, H100, 0.4, 8) == 392


@pytest.mark.parametrize("call,match", [
    (lambda: cost.gpus_for_deadline(1e21, 0, 1e15, 0.5), "deadline must be a positive number"),
    (lambda: cost.gpus_for_deadline(1e21, 1, 1e15, 0.0), r"mfu must be in \(0, 1\]"),
    (lambda: cost.gpus_for_deadline(1e21, 1, 1e15, 50), "0.4 for 40%"),
    (lambda: cost.gpus_for_deadline(1e21, 1, 1e15, 0.5, 0), "gpus_per_node must be a whole number"),
    (lambda: cost.gpu_hours(1e21, 1e15, 1.5), "mfu"),
    (lambda: cost.estimate(1e21, 0, 4.0, 1e15, 0.5), "n_gpus must be a whole number >= 1, got 0: the run needs at least one GPU"),
    (lambda: cost.estimate(1e21, 2.5, 4.0, 1e15, 0.5), "n_gpus"),
    (lambda: cost.estimate(1e21, 8, -1.0, 1e15, 0.5), "price_per_gpu_hour must be >= 0, got -1.0: prices are not negative"),
    (lambda: cost.estimate(1e21, 8, 4.0, 1e15, -0.1), "mfu"),
    (lambda: cost.storage_cost(1e9, 10, -0.02), "price_per_gb_month"),
    (lambda: cost.network_cost(1e9, -0.09), "price_per_gb"),
    (lambda: cost.mfu(0, 1, 1), "tokens_per_second"),
    (lambda: cost.price("B200"), "add it to the dict"),
    (lambda: cost.price("H100-80GB", "free"), "pricing must be one of"),
    (lambda: cost.young_interval(60, 0), "mtbf"),
    (lambda: cost.spot_wall_time(3600, -1, 600), "interruptions_per_hour must be >= 0"),
    (lambda: cost.spot_wall_time(3600, 1, 0), "checkpoint_interval"),
])
def test_bad_input_says_what_to_change(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# --------------------------------------------------------------------------- interruptions
def test_expected_lost_work_and_spot_wall_time_by_hand():
    assert cost.expected_lost_work(3600, 600) == 2400
    assert cost.expected_lost_work(3600) == 1800
    # no interruptions: only the checkpoint writes, 60 s every hour
    assert cost.spot_wall_time(360000, 0, 3600, 60, 600) == pytest.approx(360000 * 61 / 60)
    # 0.1 an hour of running, each losing 1800 s of work (λτ/2 = 0.05) and a 600 s restart
    # (λR = 1/60): W = work · 61/60 / 0.95 · 61/60
    assert cost.spot_wall_time(360000, 0.1, 3600, 60, 600) == pytest.approx(
        360000 * 61 / 60 / 0.95 * 61 / 60)
    # the restarts add exactly λ·R of the running time
    assert cost.spot_wall_time(360000, 0.1, 3600, 60, 600) / cost.spot_wall_time(
        360000, 0.1, 3600, 60, 0) == pytest.approx(1 + 0.1 * 600 / 3600)


def test_a_run_that_loses_work_as_fast_as_it_makes_it_never_finishes():
    with pytest.raises(ValueError, match="never finishes.*Young's interval"):
        cost.spot_wall_time(360000, 2, 3600)          # 2/h · 1800 s = 1
    assert cost.spot_wall_time(360000, 2, 600) > 360000  # checkpointing more often rescues it


def _simulate(work, per_hour, interval, ckpt, restart, runs, seed):
    """Discrete-event simulation: Poisson interruptions; after one, the run waits ``restart`` and
    resumes from its last checkpoint. Returns the mean wall time."""
    rng = random.Random(seed)
    rate, total = per_hour / 3600, 0.0
    for _ in range(runs):
        done = wall = 0.0
        while done < work:
            segment = min(interval, work - done) + ckpt     # work, then write the checkpoint
            t = rng.expovariate(rate) if rate else math.inf
            if t >= segment:
                wall, done = wall + segment, done + segment - ckpt
            else:
                wall += t + restart                         # the segment's work is lost
        total += wall
    return total / runs


@pytest.mark.parametrize("per_hour,interval,ckpt,restart", [
    (0.1, 3600, 60, 600),      # rare interruptions, hourly checkpoints
    (1.0, 1200, 30, 300),      # one an hour, every 20 minutes
    (0.5, 300, 5, 60),
])
def test_spot_wall_time_matches_a_simulation(per_hour, interval, ckpt, restart):
    work = 100 * 3600.0
    model = cost.spot_wall_time(work, per_hour, interval, ckpt, restart)
    sim = _simulate(work, per_hour, interval, ckpt, restart, runs=400, seed=0)
    assert model == pytest.approx(sim, rel=0.02), (model, sim)
    assert model > work


def test_young_and_daly_near_the_models_optimum():
    c, mtbf, restart = 60.0, 86400.0, 600.0
    assert cost.young_interval(c, mtbf) == pytest.approx(math.sqrt(2 * 60 * 86400))   # 3220 s
    # minimising W(τ) ∝ (1 + C/τ) / (1 - τ/2M) gives τ² + 2Cτ = 2CM (the restart does not move it)
    exact = -c + math.sqrt(c * c + 2 * c * mtbf)
    grid = [exact * (0.5 + i / 1000) for i in range(1001)]
    best = min(grid, key=lambda t: cost.spot_wall_time(1e6, 3600 / mtbf, t, c, restart))
    assert best == pytest.approx(exact, rel=2e-3)
    assert cost.young_interval(c, mtbf) == pytest.approx(exact, rel=0.03)
    assert abs(cost.daly_interval(c, mtbf) - exact) < abs(cost.young_interval(c, mtbf) - exact)
    assert cost.daly_interval(100, 40) == 40          # C >= 2M: checkpoint every MTBF


# --------------------------------------------------------------------------- money
def test_checkpoint_storage_and_network_by_hand():
    assert cost.checkpoint_bytes(7e9) == 98e9                      # 2 + 12 bytes per parameter
    assert cost.checkpoint_bytes(1, "fp32") == 4 + 8
    assert cost.storage_cost(1e12, cost.MONTH, 0.023) == pytest.approx(23.0)
    assert cost.storage_cost(1e12, cost.MONTH / 2, 0.023) == pytest.approx(11.5)
    assert cost.network_cost(1e12, 0.09) == pytest.approx(90.0)
    assert cost.data_parallel_traffic(14e9, 1, 2) == pytest.approx(28e9)          # 2 nodes x 14 GB
    assert cost.data_parallel_traffic(14e9, 10, 4) == pytest.approx(2 * 3 / 4 * 14e9 * 4 * 10)
    assert cost.data_parallel_traffic(14e9, 10, 1) == 0


def test_estimate_lines_add_up():
    flops = 64 * 3600 * 1e15 * 0.5                  # 64 GPU-hours of work
    e = cost.estimate(flops, 8, 4.0, 1e15, 0.5)
    assert e.wall_time == pytest.approx(8 * 3600) and e.gpu_hours == pytest.approx(64)
    assert e.lines["compute"] == pytest.approx(256) and e.total == pytest.approx(256)
    # a 30-day reservation for an 8-hour job: the rest of the month is paid, unused
    r = cost.estimate(flops, 8, 2.5, 1e15, 0.5, commitment=30 * 86400)
    assert r.lines["unused reservation"] == pytest.approx(8 * 2.5 * (30 * 24 - 8))
    assert r.gpu_hours == pytest.approx(8 * 30 * 24) and r.total > e.total
    s = cost.estimate(flops, 8, 2.0, 1e15, 0.5, interruptions_per_hour=0.1, checkpoint_interval=3600,
                      checkpoint_time=60, restart_time=600, network_bytes=1e12, price_per_gb_moved=0.09,
                      storage_bytes=1e12, storage_time=cost.MONTH, price_per_gb_month=0.023)
    wall = cost.spot_wall_time(8 * 3600, 0.1, 3600, 60, 600)
    assert s.wall_time == pytest.approx(wall)
    assert s.total == pytest.approx(wall / 3600 * 8 * 2.0 + 90 + 23)
    assert s.lines["checkpoint writes"] == pytest.approx(8 * 60 / 3600 * 8 * 2.0)
    assert "total" in str(s) and "GPU-hours billed" in str(s)


def test_prices_are_marked_illustrative_and_cover_calc_gpus():
    assert cost.PRICES["as_of"].startswith("2026") and "not fetched" in cost.PRICES["source"]
    assert "edit these" in cost.PRICES["source"]
    assert set(cost.PRICES["gpu_hour"]) == set(calc.GPUS)
    for gpu, p in cost.PRICES["gpu_hour"].items():
        assert p["spot"] < p["reserved"] < p["on_demand"] == cost.price(gpu)
    mine = {"gpu_hour": {"H100-80GB": {"on_demand": 9.0}}}
    assert cost.price("H100-80GB", prices=mine) == 9.0


# --------------------------------------------------------------------------- exercise 13's grader
# One plausible wrong solution per rule the exercise teaches: the grader must reject it and say why.
from minidist_course import grading  # noqa: E402


def _spot(lost_fraction=0.5, checkpoints=True, restarts=True, per_second=False):
    def fn(work, per_hour, tau, c, r):
        rate = per_hour if per_second else per_hour / 3600
        if rate * tau * lost_fraction >= 1:
            raise ValueError("never finishes")
        run = work * (1 + (c / tau if checkpoints else 0)) / (1 - rate * tau * lost_fraction)
        return run * (1 + (rate * r if restarts else 0))
    return fn


def test_ex13_grader_accepts_the_library_and_rejects_each_slip():
    g = grading.cost
    assert g.grade_gpus_for_deadline(cost.gpus_for_deadline).passed
    assert g.grade_spot_wall_time(cost.spot_wall_time).passed
    assert g.grade_young_interval(cost.young_interval).passed
    assert g.grade_spot_wall_time(_spot()).passed                       # the model, written out

    def no_nodes(flops, deadline, peak, mfu, per_node):
        cost._mfu(mfu)
        if deadline <= 0:
            raise ValueError
        return math.ceil(flops / (deadline * peak * mfu))
    rep = g.grade_gpus_for_deadline(no_nodes)
    assert not rep.passed and "round up to whole nodes of 8 GPUs" in str(rep), str(rep)
    rounds_down = lambda *a: int(cost.gpus_for_deadline(*a) * 0.9) if a[1] > 0 and 0 < a[3] <= 1 \
        else cost.gpus_for_deadline(*a)  # noqa: E731
    rep = g.grade_gpus_for_deadline(rounds_down)
    assert not rep.passed and "miss the deadline" in str(rep), str(rep)
    no_checks = lambda f, d, p, m, n: max(n, math.ceil(f / (d * p * m) / n) * n)  # noqa: E731
    rep = g.grade_gpus_for_deadline(no_checks)
    assert not rep.passed and "expected ValueError" in str(rep), str(rep)
    assert [r.passed for r in rep.results][:5] == [True] * 5

    for slip, needle in [(_spot(lost_fraction=1.0), "not a whole one"),
                         (_spot(checkpoints=False), "checkpoint writes are missing"),
                         (_spot(restarts=False), "restarts are missing"),
                         (_spot(per_second=True), "divide by 3600")]:
        rep = g.grade_spot_wall_time(slip)
        assert not rep.passed and needle in str(rep), (needle, str(rep))

    rep = g.grade_young_interval(lambda c, m: math.sqrt(c * m))
    assert not rep.passed and "the 2 is missing" in str(rep), str(rep)


def test_ex13_forgotten_restart_is_named_as_such_on_every_case():
    # a learner trial: with C/τ = λR (60 s every 3600 s, 0.1/h, 600 s restarts) forgetting the
    # restart gave the same number as forgetting the checkpoint writes, and the grader blamed the
    # checkpoints. The graded cases now tell the two apart; a tie names both.
    rep = grading.cost.grade_spot_wall_time(_spot(restarts=False))
    failed = [r for r in rep.results if not r.passed and "generated" not in r.name]
    assert len(failed) == 3 and not rep.passed, str(rep)       # the cases with interruptions
    (drawn,) = [r for r in rep.results if "generated" in r.name]
    assert not drawn.passed and drawn.rule in ("restarts", "checkpoints"), str(rep)  # a tie names both
    for r in failed:
        assert "restarts are missing" in r.message and "checkpoint writes" not in r.message, str(rep)
    rep = grading.cost.grade_spot_wall_time(_spot(checkpoints=False))
    for r in (r for r in rep.results if "generated" not in r.name):
        assert r.passed or ("checkpoint writes are missing" in r.message
                            and "restarts" not in r.message), str(rep)
    tie = (360000.0, 0.1, 3600.0, 60.0, 600.0)                  # C/τ = λR = 1/60
    rule, text = grading.cost._spot_check(_spot(restarts=False), tie)
    assert rule in ("restarts", "checkpoints")
    assert "cannot tell which" in text and "restarts are missing" in text
    assert "checkpoint writes are missing" in text, text


def test_ex13_cases_that_must_raise_say_so_when_they_pass():
    for rep in (grading.cost.grade_gpus_for_deadline(cost.gpus_for_deadline),
                grading.cost.grade_spot_wall_time(cost.spot_wall_time)):
        raising = [line for line in str(rep).splitlines() if "raises ValueError" in line]
        assert raising and all(line.strip().startswith("✓") for line in raising), str(rep)
    lines = str(grading.cost.grade_gpus_for_deadline(cost.gpus_for_deadline)).splitlines()
    assert sum("raises ValueError" in line for line in lines) == 3   # deadline 0, MFU 0, MFU 50
    lines = str(grading.cost.grade_spot_wall_time(cost.spot_wall_time)).splitlines()
    assert [line for line in lines if "raises ValueError" in line] == [
        "  ✓ 100 h of work, 2 interruptions/h, a 60 s checkpoint every 3600 s, 600 s restarts "
        "(λτ/2 = 1): raises ValueError"]


def test_ex13_unwritten_exercise_fails_without_running_every_case():
    def todo(*args):
        raise NotImplementedError()
    rep = grading.cost.grade_spot_wall_time(todo)
    assert not rep.passed and rep.score == 0
    assert "not written yet" in str(rep) and "not run" in str(rep)
