"""Two nodes joined by a kernel-shaped link (issue: the two-level cluster, its kernel half).

``tools/two-node-links.sh up 200`` makes two network namespaces whose traffic between them is
limited to 200 Mbit/s each way by ``tbf``; four ranks (two per namespace) fit alpha-beta per link
class with gloo's send/recv, and time minidist's flat ring against ``algorithm="hierarchical"``.
Checked: the fitted inter-node bandwidth recovers the shaped rate; the intra-node link is much
faster; the software shaper set to the fitted link picks the same winner at every size, and the
ring (one rank per node sending across at a time) takes the same time on both.

Measured (2026-12-04, 2 cores): inter 24.2 MB/s fitted for 25.0 shaped, intra 3.2 GB/s; all-reduce
4 MiB: kernel ring 268 ms, hierarchical 182 ms; software ring 269 ms, hierarchical 99 ms. The
software hierarchical is faster because the shaper gives every rank its own inter-node link (a
NIC per GPU, as in a DGX node) while the veth is one link per node that both ranks' inter steps
share. Needs root, iproute2 and the tbf qdisc; otherwise skipped with the reason.
"""

import subprocess

import pytest

from minidist_course.bench import kernel_links as K

pytestmark = [pytest.mark.serial, pytest.mark.timeout(600)]   # timing: the machine alone


def _can() -> str | None:
    r = subprocess.run(["bash", str(K.SCRIPT), "check"], capture_output=True, text=True)
    return None if r.returncode == 0 else (r.stderr.strip() or "two-node links not possible")


@pytest.fixture(scope="module")
def runs():
    why = _can()
    if why:
        pytest.skip(why)
    kernel = K.run_two_nodes(200, reps=7)
    return kernel, K.software_twin(*kernel["fit"]["inter"], reps=5)


def test_the_fitted_inter_node_link_is_the_shaped_rate(runs):
    kernel, _ = runs
    _, inter_bw = kernel["fit"]["inter"]
    shaped = 200e6 / 8
    assert 0.8 * shaped <= inter_bw <= 1.05 * shaped, kernel["fit"]   # TCP/IP headers: below
    _, intra_bw = kernel["fit"]["intra"]
    assert intra_bw > 10 * inter_bw, kernel["fit"]


def test_the_software_shaper_picks_the_kernels_winner_at_every_size(runs):
    kernel, software = runs
    small, large = min(K.SIZES), max(K.SIZES)
    for name, by_size in (("kernel", kernel["allreduce"]), ("software", software)):
        # 4 MiB: the ring sends 3/4 of the buffer across per sending rank, hierarchical 1/4
        assert by_size[large]["hierarchical"] < 0.85 * by_size[large]["ring"], (name, by_size)
        # 64 KiB: latency; hierarchical's extra steps do not pay
        assert by_size[small]["hierarchical"] > by_size[small]["ring"] * 0.9, (name, by_size)
    # the ring: one rank per node sends across at a time, so one NIC per rank or per node agree
    k, s = kernel["allreduce"][large]["ring"], software[large]["ring"]
    assert 0.75 < s / k < 1.33, (k, s)


def test_bad_rates_are_refused_by_the_script():
    r = subprocess.run(["bash", str(K.SCRIPT), "up", "fast"], capture_output=True, text=True)
    assert r.returncode != 0 and "rate in Mbit/s" in r.stderr
