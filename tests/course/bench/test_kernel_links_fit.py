"""The alpha-beta fit of the kernel-shaped two-node run (the run itself is in the integration
tier: tests/integration/test_two_level_kernel.py)."""

import pytest

from minidist_course.bench.kernel_links import fit_link


def test_fit_recovers_alpha_and_bandwidth():
    alpha, bw = 2e-4, 25e6
    alpha_fit, bw_fit = fit_link({n: alpha + n / bw for n in (1 << 14, 1 << 18, 1 << 20, 1 << 22)})
    assert alpha_fit == pytest.approx(alpha, rel=1e-6) and bw_fit == pytest.approx(bw, rel=1e-9)


def test_fit_refuses_what_it_cannot_fit():
    with pytest.raises(ValueError, match="two sizes at least"):
        fit_link({1024: 1e-3})
    with pytest.raises(ValueError, match="do not grow with size"):
        fit_link({1024: 2e-3, 4096: 1e-3})


def test_a_negative_intercept_refits_the_bandwidth_through_the_origin():
    """Times whose free fit has alpha < 0 (a shaped link with no added delay measured with a
    little noise): alpha is 0 and the bandwidth is the fit through the origin, not the free fit's
    slope with its intercept dropped."""
    samples = {1 << 14: 0.40e-3, 1 << 18: 10.2e-3, 1 << 20: 41.8e-3, 1 << 22: 167.9e-3}   # free: -0.27 ms
    alpha_fit, bw_fit = fit_link(samples)
    through_origin = sum(n * n for n in samples) / sum(n * t for n, t in samples.items())
    assert alpha_fit == 0.0 and bw_fit == pytest.approx(through_origin, rel=1e-9)


def test_a_relative_fit_gives_alpha_the_small_messages_time():
    """A ping-pong whose large sizes are noisy (shared cores): unweighted, their noise moves the
    intercept far from the small message's time; with relative errors alpha stays near it (what a
    pipeline's 352-byte messages cost, the prediction's only use of the fit)."""
    samples = {352: 300e-6, 1 << 14: 310e-6, 1 << 20: 900e-6, 1 << 22: 1.7e-3}
    alpha_plain, _ = fit_link(samples)
    alpha_relative, _ = fit_link(samples, relative=True)
    assert abs(alpha_plain - 300e-6) > 50e-6
    assert alpha_relative == pytest.approx(300e-6, rel=0.05)


def _pingpong_rank(rank, world, pause):
    from minidist_course.bench.kernel_links import pingpong
    return pingpong(1 - rank, 1024, 3, rank == 0, pause=pause)


def test_a_paused_ping_pong_takes_the_pause_off_the_round_trip():
    """Each side sleeps 50 ms before it sends: the lead before its clock starts, the other between
    its receive and its reply, which carries that hold for the lead to subtract (kept in the round
    trip, the one-way time would be at least 25 ms)."""
    from minidist import run
    one_way = run(_pingpong_rank, 2, 0.05, timeout=120)[0]
    assert 0 < one_way < 0.02
