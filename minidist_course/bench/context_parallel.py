"""``minidist bench cp``: ring attention's time against one process and Ulysses, and how much of
the ring's communication is hidden behind the block compute.

Per configuration (``W`` ranks, causal attention of ``[b, h, S, d]`` in fp32, zigzag split):

* **one process**: :func:`~minidist.context_parallel.blocks.attention_reference` on the whole
  sequence, forward + backward (a 1-rank launch, so it runs under the same conditions);
* **ring**: :func:`~minidist.context_parallel.ring.ring_attention` forward + backward, the slowest
  rank's median over repetitions;
* **Ulysses**: :func:`~minidist.context_parallel.ulysses.ulysses_attention`, the same;
* **communication hidden**: the ring's per-step waits after the compute
  (:func:`~minidist.context_parallel.ring.recording`) against the same transfers timed alone
  (W-1 K/V exchanges forward; W-1 K/V plus W dK/dV backward):
  ``hidden = 1 - waited / alone`` (clamped to [0, 1]; the median over ranks).

On a shared CPU machine ranks compete for the same cores, so the times say what this machine does,
not what W GPUs would; the hidden share is the meaningful figure.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from minidist.launch import run

__all__ = ["bench_cp", "format_cp", "main"]


def _data(b, h, s, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, s, d, generator=g) for _ in range(4)]


def _one_process(rank, world, b, h, s, d, reps):
    from minidist.context_parallel import attention_reference
    times = []
    for _ in range(reps + 1):
        q, k, v, do = _data(b, h, s, d)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        t0 = time.perf_counter()
        out, _ = attention_reference(q, k, v)
        out.backward(do)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def _parallel(rank, world, b, h, s, d, reps):
    import torch.distributed as dist

    from minidist.comm import p2p
    from minidist.context_parallel import ring_attention, shard, ulysses_attention
    from minidist.trace import Timeline
    out = {"ring": [], "ulysses": [], "fwd_wait": [], "bwd_wait": [], "fwd_alone": [],
           "bwd_alone": []}
    for i in range(reps + 1):
        for name, fn in (("ring", ring_attention), ("ulysses", ulysses_attention)):
            q, k, v, do = (shard(t, "zigzag", world, rank, dim=2) for t in _data(b, h, s, d))
            q, k, v = (t.requires_grad_() for t in (q, k, v))
            dist.barrier()
            tl = Timeline()
            with tl.observe():
                t0 = time.perf_counter()
                o, _ = fn(q, k, v, split="zigzag", seq_len=s)
                o.backward(do)
                dt = time.perf_counter() - t0
            events = tl.events
            if i:
                out[name].append(dt)
                if name == "ring":
                    fwd, bwd = events[: 2 * world], events[2 * world:]   # W steps each
                    out["fwd_wait"].append(sum(e.duration for e in fwd if e.name == "wait"))
                    out["bwd_wait"].append(sum(e.duration for e in bwd if e.name == "wait"))
        # the same transfers, alone
        kv = torch.empty(2, b, h, s // world, d)
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        for key, n in (("fwd_alone", world - 1), ("bwd_alone", 2 * world - 1)):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(n):
                p2p.exchange(kv, nxt, torch.empty_like(kv), prv)
            if i:
                out[key].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in out.items()}


def bench_cp(world: int = 4, seq_len: int = 1024, heads: int = 4, head_dim: int = 32,
             batch: int = 1, reps: int = 3) -> dict:
    """Times (seconds, medians) and hidden shares; raises ``ValueError`` for a sequence that does
    not split into 2W equal chunks or heads that do not divide by W (Ulysses)."""
    if seq_len % (2 * world):
        raise ValueError(f"bench cp: seq_len {seq_len} must be a multiple of 2W = {2 * world}")
    if heads % world:
        raise ValueError(f"bench cp: {heads} heads do not divide over W = {world} (Ulysses)")
    one = run(_one_process, 1, batch, heads, seq_len, head_dim, reps, timeout=600)[0]
    ranks = run(_parallel, world, batch, heads, seq_len, head_dim, reps, timeout=600)
    slowest = {k: max(r[k] for r in ranks) for k in ranks[0]}

    def hidden(wait, alone):
        return min(1.0, max(0.0, 1.0 - wait / alone)) if alone > 0 else 1.0
    return {"world": world, "seq_len": seq_len, "heads": heads, "head_dim": head_dim,
            "batch": batch, "one_process_s": one, "ring_s": slowest["ring"],
            "ulysses_s": slowest["ulysses"],
            "hidden_forward": statistics.median(hidden(r["fwd_wait"], r["fwd_alone"])
                                                for r in ranks),
            "hidden_backward": statistics.median(hidden(r["bwd_wait"], r["bwd_alone"])
                                                 for r in ranks),
            "comm_alone_s": slowest["fwd_alone"] + slowest["bwd_alone"]}


def format_cp(rows: list[dict]) -> str:
    head = (f"{'W':>3}{'S':>7}{'one process ms':>16}{'ring ms':>10}{'Ulysses ms':>12}"
            f"{'hidden fwd':>12}{'hidden bwd':>12}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['world']:>3}{r['seq_len']:>7}{1e3 * r['one_process_s']:>16.1f}"
                     f"{1e3 * r['ring_s']:>10.1f}{1e3 * r['ulysses_s']:>12.1f}"
                     f"{r['hidden_forward']:>12.0%}{r['hidden_backward']:>12.0%}")
    lines.append("(fp32, causal, zigzag split, forward + backward, slowest rank's median; "
                 "hidden = 1 - waited / the same transfers alone, median rank)")
    return "\n".join(lines)


def main(argv=None) -> int:
    """``minidist bench cp [--world-sizes W ...] [--seq-lens S ...] [--heads H] [--head-dim D]``"""
    p = argparse.ArgumentParser(prog="minidist bench cp", description="ring attention vs one "
                                "process and Ulysses; the share of the ring's communication hidden")
    p.add_argument("--world-sizes", nargs="+", type=int, default=[2, 4])
    p.add_argument("--seq-lens", nargs="+", type=int, default=[512, 2048])
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    rows = []
    for w in args.world_sizes:
        for s in args.seq_lens:
            try:
                rows.append(bench_cp(w, s, args.heads, args.head_dim, reps=args.reps))
            except ValueError as e:
                p.error(str(e))
    print(format_cp(rows))
    return 0
