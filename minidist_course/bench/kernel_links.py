"""Two nodes joined by a kernel-shaped link: fit alpha-beta per link class, and check that the
software shaper (:mod:`minidist.comm.topology`) picks the same winner as the real links.

``tools/two-node-links.sh up MBIT`` puts two network namespaces on this machine ("nodes"), each
with its own address; traffic between them crosses veths whose ``tbf`` qdiscs limit each
direction to MBIT Mbit/s, traffic inside one stays on its loopback. Four ranks run here, two in
each namespace (plain processes, ``GLOO_SOCKET_IFNAME=eth0``, rendezvous on node 1's address), as
torchrun would start them on two machines. Each rank:

1. **ping-pong** with torch's gloo send/recv between rank 0 and rank 1 (same node) and rank 0 and
   rank 2 (other node), at several sizes: the one-way time ``t(n) = alpha + n / bandwidth`` is fitted
   per link class (least squares on the medians, :func:`fit_link`);
2. **all-reduce** of a few sizes by minidist's flat ring and by ``algorithm="hierarchical"`` (the
   topology installed with both links unshaped: it only tells the algorithm which ranks share a
   node), and torch's gloo ``dist.all_reduce``, in a balanced order, medians.

:func:`software_twin` then runs the same all-reduces on loopback with the software shaper set to
the fitted inter-node link, so the two can be compared size by size. The kernel cannot add delay
(no ``netem`` here): the inter link's alpha is loopback's plus the veth's queueing.

Needs root (integration tier). Source of the method: Hockney 1994, "The communication challenge
for MPP: Intel Paragon and Meiko CS-2" (the alpha-beta model); Linux ``tc-tbf(8)``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from .alpha_beta import _nonneg_lstsq

__all__ = ["SIZES", "PING_SIZES", "fit_link", "pingpong", "run_two_nodes", "software_twin", "main"]

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "two-node-links.sh"
PING_SIZES = (1 << 14, 1 << 18, 1 << 20, 1 << 22)      # 16 KiB .. 4 MiB
SIZES = (1 << 16, 1 << 20, 1 << 22)                    # all-reduce: 64 KiB, 1 MiB, 4 MiB
NODE_ADDR = ("10.78.0.11", "10.78.0.12")


def fit_link(samples: dict[int, float], relative: bool = False) -> tuple[float, float]:
    """``(alpha seconds, bandwidth bytes/s)`` of ``t = alpha + n / bandwidth`` fitted to
    ``{bytes: one-way seconds}`` by least squares with alpha, beta >= 0 (the alpha-beta bench's
    solver, :mod:`.alpha_beta`: where alpha would be negative, beta is refitted through the origin
    rather than kept from the unconstrained fit). Unweighted, the large sizes decide the fit;
    ``relative``: each time's residual divided by the time, so that every size counts alike and
    alpha follows the small messages (whose time is alpha; an unweighted fit's intercept moves by
    the large sizes' noise, tens of times alpha on a shared machine).

    Raises:
        ValueError: fewer than two sizes, or times that do not grow with size.
    """
    if len(samples) < 2:
        raise ValueError(f"fit_link: needs two sizes at least, got {len(samples)}")
    n = torch.tensor([float(k) for k in samples], dtype=torch.float64)
    t = torch.tensor([float(v) for v in samples.values()], dtype=torch.float64)[None, :]
    scale = float(n.max())          # solve for beta·scale: both columns O(1)
    a, b, _, _ = _nonneg_lstsq(torch.ones_like(n), n / scale, t,
                               1 / t if relative else torch.ones_like(t))
    if not float(b) > 0:
        raise ValueError(f"fit_link: times do not grow with size: {samples}")
    return float(a), scale / float(b)


def pingpong(peer: int, nbytes: int, reps: int, lead: bool, pause: float = 0.0) -> float:
    """Median one-way seconds of ``reps`` round trips of ``nbytes`` (at least 4) with ``peer``
    (torch's gloo send/recv; the ``lead`` rank sends first; a first, untimed exchange sets the pair
    up). ``pause``: seconds each side sleeps before it sends (the lead before each round trip, the
    other between its receive and its reply), as a pipeline stage computes between messages: a
    message that wakes a sleeping process costs more than one between two that spin (on 2 shared
    cores, 352 B: ~60 us without a pause, ~210 us after 10 ms). The reply carries how long the
    other side held the message, and the lead takes it off the round trip."""
    import torch.distributed as dist
    if nbytes < 4:
        raise ValueError(f"pingpong: needs 4 bytes at least (the reply carries the hold time), "
                         f"got {nbytes}")
    buf = torch.zeros(nbytes // 4)
    times = []
    for i in range(reps + 1):
        if lead:
            if pause:
                time.sleep(pause)
            t0 = time.perf_counter()
            dist.send(buf, peer)
            dist.recv(buf, peer)
            one_way = (time.perf_counter() - t0 - float(buf[0])) / 2
        else:
            t0 = time.perf_counter()
            dist.recv(buf, peer)
            held = time.perf_counter()
            if pause:
                time.sleep(pause)
            buf[0] = time.perf_counter() - held
            dist.send(buf, peer)
            one_way = (time.perf_counter() - t0) / 2
        if i:   # the first exchange sets the pair up
            times.append(one_way)
    return statistics.median(times)


def _allreduces(rank: int, sizes, reps: int) -> dict:
    import torch.distributed as dist

    from minidist import collectives as C
    from .collectives import balanced_order
    runs = {"ring": lambda t: C.all_reduce(t, algorithm="ring"),
            "hierarchical": lambda t: C.all_reduce(t, algorithm="hierarchical"),
            "torch": lambda t: dist.all_reduce(t)}
    out: dict = {}
    for nbytes in sizes:
        t = torch.ones(nbytes // 4)
        times: dict = {k: [] for k in runs}
        for i in range(reps + 1):
            for k in balanced_order(list(runs), i):
                dist.barrier()
                t0 = time.perf_counter()
                runs[k](t)
                if i:
                    times[k].append(time.perf_counter() - t0)
        out[nbytes] = {k: statistics.median(v) for k, v in times.items()}
    return out


def _worker(rank: int, world: int, out: str, reps: int) -> None:
    """One rank of the kernel-shaped run (a process inside its node's namespace)."""
    import torch.distributed as dist

    from minidist.comm import topology
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    topology.install(topology.Topology(2, world // 2))   # layout only: both links unshaped
    result: dict = {"ping": {}}
    for cls, (a, b) in (("intra", (0, 1)), ("inter", (0, 2))):
        result["ping"][cls] = {}
        if rank in (a, b):   # warm the pair up (gloo connects it at its first message)
            pingpong(b if rank == a else a, 1 << 12, 3, rank == a)
        for nbytes in PING_SIZES:
            dist.barrier()
            if rank in (a, b):
                result["ping"][cls][nbytes] = pingpong(b if rank == a else a, nbytes, reps,
                                                        rank == a)
    result["allreduce"] = _allreduces(rank, SIZES, reps)
    dist.barrier()
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def run_two_nodes(mbit: int, reps: int = 5, timeout: float = 300.0) -> dict:
    """Bring the two nodes up at ``mbit`` Mbit/s, run the four ranks, bring them down.

    Returns ``{"mbit", "ping": {class: {bytes: s}}, "fit": {class: (alpha, bandwidth)},
    "allreduce": {bytes: {algorithm: s}}}``.

    Raises:
        RuntimeError: the links could not be made (not root, no tbf), or a rank failed or timed
            out (its output is in the message; every rank is killed first).
    """
    up = subprocess.run(["bash", str(SCRIPT), "up", str(mbit)], capture_output=True, text=True)
    if up.returncode:
        raise RuntimeError(f"two-node links: {up.stderr.strip() or up.stdout.strip()}")
    procs = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "result.json")
            env = {**os.environ, "MASTER_ADDR": NODE_ADDR[0], "MASTER_PORT": "29611",
                   "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1",
                   "PYTHONPATH": str(SCRIPT.parents[1])}
            env.pop("MINIDIST_TOPOLOGY", None)
            for rank in range(4):
                cmd = ["ip", "netns", "exec", f"md2n{rank // 2 + 1}", sys.executable, "-m",
                       "minidist_course.bench.kernel_links", "worker", str(rank), "4", out,
                       str(reps)]
                procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                              stderr=subprocess.STDOUT, text=True))
            deadline = time.monotonic() + timeout
            for p in procs:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            logs = [p.stdout.read() if p.stdout else "" for p in procs]
            bad = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode]
            if bad:
                raise RuntimeError(f"two-node run: rank {bad[0][0]} exited {bad[0][1]}:\n"
                                   + logs[bad[0][0]][-3000:])
            result = json.loads(Path(out).read_text())
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"two-node run: not finished after {timeout:.0f} s") from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        subprocess.run(["bash", str(SCRIPT), "down"], capture_output=True)
    ping = {c: {int(k): v for k, v in d.items()} for c, d in result["ping"].items()}
    return {"mbit": mbit, "ping": ping, "fit": {c: fit_link(d) for c, d in ping.items()},
            "allreduce": {int(k): v for k, v in result["allreduce"].items()}}


def _twin_rank(rank, world, reps):
    torch.set_num_threads(1)
    return _allreduces(rank, SIZES, reps)


def software_twin(alpha: float, bandwidth: float, reps: int = 5, timeout: float = 300.0) -> dict:
    """The same all-reduces on loopback (``minidist.run``, 4 ranks, 2 x 2) with the software
    shaper's inter-node link set to ``alpha`` seconds and ``bandwidth`` bytes/s, intra unshaped:
    ``{bytes: {algorithm: s}}``. torch's row is not shaped (it does not use the p2p layer)."""
    import minidist
    from minidist.comm import topology
    spec = topology.Topology(2, 2, inter=topology.Link(alpha, bandwidth))
    with topology.use(spec):
        return minidist.run(_twin_rank, 4, reps, timeout=timeout)[0]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "worker":
        _worker(int(argv[1]), int(argv[2]), argv[3], int(argv[4]))
        return 0
    mbit = int(argv[0]) if argv else 200
    k = run_two_nodes(mbit)
    for cls, d in k["ping"].items():
        print(f"{cls} one-way: " + ", ".join(f"{n >> 10} KiB {t * 1e3:.2f} ms" for n, t in d.items()))
    for cls, (alpha, bw) in k["fit"].items():
        print(f"{cls}: alpha {alpha * 1e6:.0f} us, bandwidth {bw / 1e6:.1f} MB/s"
              + (f" (shaped {mbit / 8:.1f} MB/s)" if cls == "inter" else ""))
    twin = software_twin(*k["fit"]["inter"])
    for nbytes in SIZES:
        kk, ss = k["allreduce"][nbytes], twin[nbytes]
        print(f"{nbytes >> 10:5d} KiB  kernel ring {kk['ring'] * 1e3:7.1f} ms, hierarchical "
              f"{kk['hierarchical'] * 1e3:7.1f} ms | software ring {ss['ring'] * 1e3:7.1f} ms, "
              f"hierarchical {ss['hierarchical'] * 1e3:7.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
