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
