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
