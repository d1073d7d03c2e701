"""Two nodes joined by a kernel-shaped link (issue: the two-level cluster, its kernel half).

``tools/two-node-links.sh up 200`` makes two network namespaces whose traffic between them is
limited to 200 Mbit/s each way by ``tbf``; four ranks (two per namespace) fit alpha-beta per link
class with gloo's send/recv, and time minidist's flat ring against ``algorithm="hierarchical"``.
Checked: the fitted inter-node bandwidth recovers the shaped rate; the intra-node link is much
faster; at the sizes the bandwidth term decides (1 and 4 MiB) the software shaper set to the
fitted link picks the kernel's winner (hierarchical); at 64 KiB, where latency and the scheduling
of four processes on two cores decide, the two algorithms tie within noise on both (measured
2026-12-04/05, four runs: hierarchical/ring 0.66-1.49 in the kernel, 0.77-1.50 in software, so
neither side names a winner there); and the ring (one rank per node sending across at a time)
takes the same time on both.

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
    # medians of 15: a run late in CI's serial half once had 64 KiB's hierarchical median at
    # 9.9 ms against the ring's 3.7 (2.66x, outside the tie band) and passed four times alone
    kernel = K.run_two_nodes(200, reps=15)
    return kernel, K.software_twin(*kernel["fit"]["inter"], reps=5)


def test_the_fitted_inter_node_link_is_the_shaped_rate(runs):
    kernel, _ = runs
    _, inter_bw = kernel["fit"]["inter"]
    shaped = 200e6 / 8
    assert 0.8 * shaped <= inter_bw <= 1.05 * shaped, kernel["fit"]   # TCP/IP headers: below
    _, intra_bw = kernel["fit"]["intra"]
    assert intra_bw > 10 * inter_bw, kernel["fit"]


def test_the_software_shaper_picks_the_kernels_winner_where_bandwidth_decides(runs):
    kernel, software = runs
    small = min(K.SIZES)
    for name, by_size in (("kernel", kernel["allreduce"]), ("software", software)):
        for nbytes in K.SIZES:
            ratio = by_size[nbytes]["hierarchical"] / by_size[nbytes]["ring"]
            if nbytes > small:
                # 1 and 4 MiB: the ring sends 3/4 of the buffer across per sending rank,
                # hierarchical 1/4 (both ranks of a node share the veth: 1/2 of the ring's time)
                assert ratio < 0.85, (name, nbytes, by_size)
            else:
                # 64 KiB: a tie within noise; a broken hierarchical path (an extra round trip
                # across, a serialised step) would be far outside it
                assert 0.4 < ratio < 2.5, (name, nbytes, by_size)
    # the ring: one rank per node sends across at a time, so one NIC per rank or per node agree
    large = max(K.SIZES)
    k, s = kernel["allreduce"][large]["ring"], software[large]["ring"]
    assert 0.75 < s / k < 1.33, (k, s)


def test_bad_rates_are_refused_by_the_script():
    r = subprocess.run(["bash", str(K.SCRIPT), "up", "fast"], capture_output=True, text=True)
    assert r.returncode != 0 and "rate in Mbit/s" in r.stderr
