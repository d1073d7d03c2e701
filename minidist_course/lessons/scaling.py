"""Strong and weak scaling measured on this machine: bucketed DDP steps of an MLP at several W.

:func:`measured_scaling` launches W ranks for each world size, times ``steps`` training steps
after ``warmup`` (synthetic inputs: the input pipeline is chapter 05's other section), and
returns rows shaped like :func:`minidist_course.planner.scaling.dp_scaling`'s — step time, samples/s,
speedup of throughput over W = 1 and efficiency = speedup / W — plus the compute and the exposed
communication per step from DDP's timeline. Ranks are processes with one thread each
(:func:`minidist.run`), so W ranks need W free cores: on a machine with fewer, or with other
work on it, the curve shows the cores, not the algorithm.
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from minidist.data_parallel import BucketedDDP
from minidist.launch import run
from minidist.models import MLP
from minidist.trace import Timeline

__all__ = ["time_dp_steps", "measured_scaling"]



def recorded_step(ddp, opt, x: torch.Tensor, y: torch.Tensor, tl: Timeline) -> torch.Tensor:
    """One DDP training step (cross-entropy) with its phases on ``tl``'s ``main`` lane:
    ``forward``, ``backward`` (the buckets' all-reduces start inside it, on ``comm``), the wait
    for the last bucket (``ddp.sync_gradients``) and ``optimizer``. Returns the loss."""
    with tl.observe():   # and the wrapper's own spans: "all-reduce bK" (comm), "wait" (main)
        with tl.record("forward"):
            loss = F.cross_entropy(ddp(x), y)
        with tl.record("backward"):
            loss.backward()
        ddp.sync_gradients()
        with tl.record("optimizer"):
            opt.step()
            opt.zero_grad()
    return loss

def time_dp_steps(rank: int, world_size: int, batch: int, steps: int = 20, warmup: int = 3,
                  hidden: int = 512, seed: int = 0) -> dict:
    """``steps`` DDP steps of an MLP 256 → hidden → hidden → 10 on ``batch`` random samples per
    rank. Returns the median step time (s; the barrier-to-barrier time of the slowest rank is
    what counts, so ranks report theirs and the caller takes the maximum), and the median compute
    (forward + backward + optimizer, less the wait) and exposed communication (DDP's ``"wait"``) per step."""
    torch.manual_seed(seed + rank)
    tl = Timeline()
    ddp = BucketedDDP(MLP(256, (hidden, hidden), 10), bucket_cap_mb=1.0)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x, y = torch.randn(batch, 256), torch.randint(0, 10, (batch,))
    times, compute, exposed = [], [], []
    for i in range(warmup + steps):
        tl.clear()
        dist.barrier()
        start = time.perf_counter()
        recorded_step(ddp, opt, x, y, tl)
        if i >= warmup:
            times.append(time.perf_counter() - start)
            exposed.append(tl.total("wait", lane="main"))   # inside backward (autograd's callback)
            compute.append(sum(tl.total(k) for k in ("forward", "backward", "optimizer")) - exposed[-1])
    ddp.close()
    return {"step_s": statistics.median(times), "compute_s": statistics.median(compute),
            "exposed_s": statistics.median(exposed)}


def measured_scaling(world_sizes=(1, 2, 4), mode: str = "strong", batch: int = 256,
                     steps: int = 20, warmup: int = 3, hidden: int = 512, progress: bool = False,
                     timeout: float = 180.0) -> list[dict]:
    """Measure DDP's step time at each W (``mode="strong"``: ``batch`` is the global batch, split
    over W; ``"weak"``: ``batch`` per rank). Returns one dict per W: ``world_size``,
    ``batch_per_rank``, ``step_s`` (slowest rank's median), ``compute_s``, ``exposed_s``,
    ``samples_per_s``, ``speedup``, ``efficiency``, and ``load`` (the 1-minute load average when
    it ran)."""
    if mode not in ("weak", "strong"):
        raise ValueError(f"measured_scaling: mode must be 'weak' or 'strong', got {mode!r}")
    sizes = list(world_sizes)
    if not sizes or sizes[0] != 1:
        raise ValueError(f"measured_scaling: world_sizes must start at 1 (the reference), got {sizes}")
    if mode == "strong" and (bad := [w for w in sizes if batch % w]):
        raise ValueError(f"measured_scaling: strong scaling splits batch={batch} over W ranks; "
                         f"W = {bad} do not divide it")
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(sizes, desc=f"{mode} scaling", unit="W")
    rows = []
    for w in sizes:
        per_rank = batch // w if mode == "strong" else batch
        res = run(time_dp_steps, w, per_rank, steps, warmup, hidden, timeout=timeout)
        slowest = max(res, key=lambda r: r["step_s"])
        rows.append({"world_size": w, "batch_per_rank": per_rank, **slowest,
                     "samples_per_s": per_rank * w / slowest["step_s"], "load": os.getloadavg()[0]})
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    for r in rows:
        r["speedup"] = r["samples_per_s"] / rows[0]["samples_per_s"]
        r["efficiency"] = r["speedup"] / r["world_size"]
    return rows
