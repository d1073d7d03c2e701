"""Zero-bubble schedules as data, their simulation, and the B/W split of one stage (one process).

The split is checked exactly in float64 against one fused ``backward`` (the same products, in the
same order per parameter: tolerance 1e-12 for rounding only).
"""

import pytest
import torch
from torch import nn

from minidist.pipeline_parallel import (Op, PipelineDeadlock, Schedule, ScheduleError, make_schedule,
                                        message_order_mismatches, one_f_one_b, peak_bytes,
                                        simulate, validate, zb_h1, zb_v, dualpipe_v)
from minidist.pipeline_parallel.split_backward import backward_input, backward_weight

D = torch.float64


@pytest.mark.parametrize("P", [2, 4, 8])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_zb_h1_bubble_is_a_third_of_1f1b(P, k):
    """Equal F, B, W (t_f=1, t_b=2, t_w=1), M = kP >= P: 1F1B takes 3(M+P-1), ZB-H1 3M+P-1."""
    M = k * P
    f = simulate(one_f_one_b(P, M), 1.0, 2.0, t_w=1.0)
    h = simulate(zb_h1(P, M), 1.0, 2.0, t_w=1.0)
    assert f.makespan == 3 * (M + P - 1) and h.makespan == 3 * M + P - 1
    idle_f, idle_h = 3 * P * (P - 1), P * (P - 1)  # summed idle time over the ranks
    assert f.makespan * P - 3 * M * P == idle_f and h.makespan * P - 3 * M * P == idle_h
    assert f.bubble == pytest.approx((P - 1) / (M + P - 1), rel=1e-12)
    assert h.bubble == pytest.approx((P - 1) / (3 * M + P - 1), rel=1e-12)
    # as a share of compute, (p-1)/(3m): the paper's ZB-H1 figure
    assert (h.makespan - 3 * M) / (3 * M) == pytest.approx((P - 1) / (3 * M), rel=1e-12)


@pytest.mark.parametrize("P,M", [(2, 2), (2, 3), (4, 4), (4, 5), (4, 8), (4, 12), (8, 16), (4, 1)])
def test_zb_h1_keeps_1f1b_peak_memory(P, M):
    f, h = one_f_one_b(P, M), zb_h1(P, M)
    assert simulate(h).peak_inflight == {s: min(P, M) for s in range(P)}
    assert max(simulate(h).peak_inflight.values()) == max(simulate(f).peak_inflight.values())


@pytest.mark.parametrize("P,M", [(2, 4), (2, 5), (4, 8), (4, 12), (8, 24), (8, 17)])
def test_v_schedules_halve_zb_h1_idle_time(P, M):
    h = simulate(zb_h1(P, M), 1.0, 2.0, t_w=1.0)
    for s in (zb_v(P, M), dualpipe_v(P, M)):
        v = simulate(s, 1.0, 2.0, t_w=1.0)  # each chunk op half a unit
        assert v.bubble < h.bubble
        assert v.makespan == pytest.approx(3 * M + (P - 1) / 2), s.name
        assert h.makespan - 3 * M == P - 1
        # peak: 2P chunk micro-batches on the first stage = P rank-shares, 1F1B's peak
        assert v.peak_inflight[0] == 2 * P and max(v.peak_inflight.values()) == 2 * P


def test_dualpipe_v_pairs_directions_and_refuses_small_m():
    s = dualpipe_v(4, 8)
    row = s[1]  # rank 1: c0 = stage 1 (down), c1 = stage 6 (up)
    steady = [i for i in range(len(row) - 1) if row[i].kind == "F" and row[i + 1].kind == "B"
              and row[i].stage != row[i + 1].stage]
    assert len(steady) >= 2 * (8 - 8 + 1 + 1)  # F of one direction next to B of the other
    with pytest.raises(ScheduleError, match="dualpipe-v needs at least 2P micro-batches"):
        dualpipe_v(4, 7)


@pytest.mark.parametrize("name", ["zb-h1", "zb-v", "dualpipe-v"])
@pytest.mark.parametrize("P", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("M", [1, 2, 3, 5, 8, 16])
def test_zero_bubble_schedules_finish(name, P, M):
    if name == "dualpipe-v" and M < 2 * P:
        return
    s = make_schedule(name, P, M)
    r = simulate(s, 1.0, 2.0, t_comm=0.1, t_w=0.7)
    kinds = [e.kind for e in r.events]
    assert kinds.count("F") == kinds.count("B") == M * s.n_stages
    n_w = kinds.count("W")  # every backward split (DualPipe-V: only those of the cool-down)
    assert n_w == M * s.n_stages if name != "dualpipe-v" else 0 < n_w < M * s.n_stages
    assert 0.0 <= r.bubble < 1.0
    assert message_order_mismatches(s) == [] or name != "zb-h1"  # the V ones need gloo's tags


def test_zb_v_places_stages_in_a_v():
    s = zb_v(4, 4)
    assert [s.stages_of(r) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [s.owner(st) for st in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]


def test_w_before_its_b_is_rejected():
    good = zb_h1(2, 2)
    row = list(good.ops[1])
    i, j = row.index(Op("B", 0, 1)), row.index(Op("W", 0, 1))
    row[i], row[j] = row[j], row[i]
    with pytest.raises(ScheduleError, match=r"rank 1: W0@s1 \(weight gradient\) comes before its B0@s1"):
        validate(Schedule("w-first", 2, 2, 1, (good.ops[0], tuple(row))))
    with pytest.raises(ScheduleError, match="appears twice"):
        validate(Schedule("w-twice", 2, 2, 1, (good.ops[0], good.ops[1] + (Op("W", 0, 1),))))


def test_late_b_result_is_a_deadlock_or_a_bubble():
    # rank 1 delays B0 (whose gradient rank 0 waits for) behind B1's input gradient
    late = validate(Schedule("late-b", 2, 2, 1, (
        (Op("F", 0, 0), Op("F", 1, 0), Op("B", 0, 0), Op("W", 0, 0), Op("B", 1, 0), Op("W", 1, 0)),
        (Op("F", 0, 1), Op("F", 1, 1), Op("B", 1, 1), Op("W", 1, 1), Op("B", 0, 1), Op("W", 0, 1)))))
    on_time = zb_h1(2, 2)
    assert simulate(late, 1, 2, t_w=1).bubble > simulate(on_time, 1, 2, t_w=1).bubble
    # and when the two ranks disagree on which backward comes first, it is a circular wait
    circular = validate(Schedule("circular", 2, 2, 1, (
        (Op("F", 0, 0), Op("B", 0, 0), Op("F", 1, 0), Op("B", 1, 0), Op("W", 0, 0), Op("W", 1, 0)),
        (Op("F", 0, 1), Op("F", 1, 1), Op("B", 0, 1), Op("W", 0, 1), Op("B", 1, 1), Op("W", 1, 1)))))
    with pytest.raises(PipelineDeadlock, match="rank 0 .* stuck at B0@s0, waiting for B0@s1"):
        simulate(circular)


def test_simulator_costs_messages_and_bytes():
    s = zb_h1(2, 2)
    r = simulate(s, 1.0, 2.0, t_w=0.5)
    dur = {(e.kind, e.mb, e.stage): e.duration for e in r.events}
    assert dur[("F", 0, 0)] == 1.0 and dur[("B", 0, 0)] == 1.5 and dur[("W", 0, 0)] == 0.5
    assert simulate(one_f_one_b(2, 2), 1.0, 2.0).events[2].duration == 2.0  # fused B: t_b
    assert [m[1:] for m in r.messages] == [(0, 1, "act", 0, 0), (0, 1, "act", 1, 0),
                                           (1, 0, "grad", 0, 1), (1, 0, "grad", 1, 1)]
    assert peak_bytes(s, lambda mb, st: 100 + mb) == {0: 201, 1: 201}
    with pytest.raises(ValueError, match="t_w <= t_b"):
        simulate(s, 1.0, 1.0, t_w=2.0)


# ---- the B/W split of one stage, one process ------------------------------------------------

class Tied(nn.Module):
    """One weight used by three ops on the input path (shared edge targets), and an unused layer."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 6, dtype=D))
        self.lin = nn.Linear(6, 6, dtype=D)
        self.unused = nn.Linear(2, 2, dtype=D)

    def forward(self, x):
        return self.lin(torch.tanh(x @ self.w) @ self.w) + x @ self.w


class Norm(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.lin = nn.LayerNorm(6, dtype=D), nn.Linear(6, 6, dtype=D)
        self.scale = nn.Parameter(torch.ones(1, dtype=D))

    def forward(self, x):
        return self.lin(self.ln(x)) * self.scale * self.scale + self.ln(x)


def _mlp():
    return nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh()).to(D)


@pytest.mark.parametrize("make,x_grad,loss", [(_mlp, True, False), (_mlp, False, False),
                                              (_mlp, True, True), (Tied, True, False),
                                              (Norm, True, False), (Norm, False, True)])
def test_split_backward_equals_fused(make, x_grad, loss):
    torch.manual_seed(0)
    m = make()
    x = torch.randn(5, 6, dtype=D)
    dy = None if loss else torch.randn(5, 6, dtype=D)

    def out(inp):
        y = m(inp)
        return y.square().mean() if loss else y

    xr = x.clone().requires_grad_(x_grad)
    out(xr).backward(dy)
    ref = {k: p.grad.clone() for k, p in m.named_parameters() if p.grad is not None}
    m.zero_grad(set_to_none=True)
    xs = x.clone().requires_grad_(x_grad)
    dx, wg = backward_input(out(xs), dy, xs, m.parameters())
    assert all(p.grad is None for p in m.parameters()), "B must not touch weight gradients"
    if x_grad:
        torch.testing.assert_close(dx, xr.grad, rtol=0, atol=1e-12)
    else:
        assert dx is None
    backward_weight(wg)
    got = {k: p.grad for k, p in m.named_parameters() if p.grad is not None}
    assert set(got) == set(ref)  # an unused parameter keeps grad None, as in one process
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=0, atol=1e-12, msg=lambda s: f"{k}: {s}")


def test_b_runs_no_weight_gradient_matmul():
    """B of a Linear computes dX only: autograd is asked for no edge towards the weight."""
    lin = nn.Linear(6, 6, dtype=D)
    x = torch.randn(3, 6, dtype=D, requires_grad=True)
    seen = []
    lin.weight.register_hook(lambda g: seen.append("dW"))
    dx, wg = backward_input(lin(x), torch.ones(3, 6, dtype=D), x, lin.parameters())
    assert seen == [] and lin.weight.grad is None
    torch.testing.assert_close(dx, torch.ones(3, 6, dtype=D) @ lin.weight.detach(), rtol=0, atol=0)
    backward_weight(wg)
    assert seen == ["dW"]
    torch.testing.assert_close(lin.weight.grad, torch.ones(3, 6, dtype=D).T @ x.detach(), rtol=0, atol=1e-12)


def test_optimizer_sync_costs_zero_bubble_schedules_more():
    """A global synchronization before the step (clipping's norm, a NaN check): every rank waits
    for the last one plus t_sync; the same unit costs a larger share of a zero-bubble step."""
    rise = {}
    for name in ("1f1b", "zb-h1", "zb-v"):
        s = make_schedule(name, 4, 8)
        a, b = simulate(s, 1, 2, t_w=1), simulate(s, 1, 2, t_w=1, t_sync=1.0)
        assert b.makespan == a.makespan + 1.0
        ends = {r: max(e.end for e in a.events if e.rank == r) for r in range(4)}
        sync = {e.rank: e for e in b.events if e.kind == "sync"}
        assert all(sync[r].start == ends[r] and sync[r].end == b.makespan for r in range(4))
        rise[name] = b.bubble / a.bubble
    assert rise["1f1b"] < rise["zb-h1"] < rise["zb-v"]


def test_dualpipe_v_pairs_hide_exposed_communication():
    """DualPipe's premise in the simulator: communication exposed inside each F/B (t_exposed) is
    hidden when an F and a B of another stage run as one overlapped pair on a rank."""
    P, M = 4, 16
    for name in ("1f1b", "zb-h1", "zb-v"):  # no cross-stage F-B pairs: overlap changes nothing
        s = make_schedule(name, P, M)
        assert simulate(s, 1, 2, t_w=1, t_exposed=1.0, overlap_pairs=True).makespan == \
            simulate(s, 1, 2, t_w=1, t_exposed=1.0).makespan
    d, v = dualpipe_v(P, M), zb_v(P, M)
    assert simulate(d, 1, 2, t_w=1, t_exposed=0.0, overlap_pairs=True).makespan == \
        simulate(d, 1, 2, t_w=1).makespan == 3 * M + (P - 1) / 2
    paired = simulate(d, 1, 2, t_w=1, t_exposed=1.0, overlap_pairs=True).makespan
    assert simulate(d, 1, 2, t_w=1, t_exposed=1.0).makespan > simulate(v, 1, 2, t_w=1,
                                                                        t_exposed=1.0).makespan
    assert paired < simulate(v, 1, 2, t_w=1, t_exposed=1.0).makespan
    assert paired < simulate(zb_h1(P, M), 1, 2, t_w=1, t_exposed=1.0).makespan
