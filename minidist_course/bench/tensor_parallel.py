"""``minidist bench tp`` — minidist's tensor parallelism against torch's ``parallelize_module``,
measured in the same run.

Every rank builds the same GPT block (:class:`minidist.models.gpt.Block`, GPT-2's layout) three or
five times from one seed:

* ``minidist``: :class:`~minidist.tensor_parallel.ParallelSelfAttention` and
  :class:`~minidist.tensor_parallel.ParallelMLP` (Megatron-LM's column/row split, Shoeybi et al.
  2019 §3); ``minidist+sp`` with sequence parallelism (Korthikanti et al. 2022 §4.2.2);
* ``torch``: the plain block under ``torch.distributed.tensor.parallel.parallelize_module`` on a
  1-D DeviceMesh — ``ColwiseParallel`` on ``qkv`` and ``fc1``, ``RowwiseParallel`` on ``proj`` and
  ``fc2``, the attention's head count divided by the TP size (torchtitan's plan for Llama,
  ``torchtitan/models/llama3/infra/parallelize.py``); ``torch+sp`` adds ``SequenceParallel`` on the
  LayerNorms and ``PrepareModuleInput`` gathers before attention and the MLP, the row layers
  reduce-scattering to sequence shards (the same file's sequence-parallel plan);
* ``torch-again``: the ``torch`` variant a second time, the control: torch against itself, the
  run's noise;
* ``minidist/gloo`` (and ``minidist+sp/gloo``): minidist's layers with gloo's C++ collectives
  under its region operators instead of minidist's own ring (:mod:`minidist.collectives`, Python
  over point-to-point) — an instrument, not a product path: the gap between ``minidist`` and it is
  the from-scratch ring's cost; between it and ``torch``, the layers' own.

Steps alternate between the variants in a balanced order (:func:`.collectives.balanced_order`);
each step is forward, ``(y²).mean()`` backward and an SGD step, on the same input on every rank.
Reported per variant: the median step time, the median of per-step ratios to ``torch`` (the SP
variants to ``torch+sp``), and the collectives one step calls — minidist's from its own counters
(:mod:`minidist.tensor_parallel.accounting`), torch's from ``CommDebugMode``. Before timing, every
variant's output and gradients are checked against the block on one process (fp32: within 1e-5
relative), so the benchmark never times a wrong answer.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from .collectives import CONTROL, balanced_order

__all__ = ["VARIANTS", "bench_tp", "main"]

VARIANTS = ("minidist", "minidist/gloo", "torch", CONTROL, "minidist+sp", "minidist+sp/gloo",
            "torch+sp")
TOL = 1e-5


def _block(cfg, variant: str, mesh):
    from minidist.models.gpt import Block
    from minidist.tensor_parallel import ParallelMLP, ParallelSelfAttention
    torch.manual_seed(0)
    h, sp = cfg.n_embd, "+sp" in variant
    if variant.startswith("minidist"):
        from minidist.tensor_parallel.layers import mark_parameter
        block = Block(cfg, attn=ParallelSelfAttention(h, cfg.n_head, sequence_parallel=sp),
                      mlp=ParallelMLP(h, 4 * h, sequence_parallel=sp))
        for p in (*block.ln1.parameters(), *block.ln2.parameters()):
            mark_parameter(p, sequence_parallel=sp)   # on sequence shards: partial gradients
        return block
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel,
                                                   parallelize_module)
    block = Block(cfg)
    block.attn.n_head //= mesh.size()
    row = RowwiseParallel(output_layouts=Shard(1)) if sp else RowwiseParallel()
    plan = {"attn.qkv": ColwiseParallel(), "attn.proj": row, "mlp.fc1": ColwiseParallel(),
            "mlp.fc2": row}
    if sp:
        gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        plan.update({"ln1": SequenceParallel(), "ln2": SequenceParallel(), "attn": gather,
                     "mlp": gather})
    return parallelize_module(block, mesh, plan)


@contextlib.contextmanager
def _gloo_collectives(on: bool):
    """minidist's region operators over torch.distributed's collectives (gloo's C++ ring)."""
    if not on:
        yield
        return
    import torch.distributed as dist

    from minidist.tensor_parallel import regions

    def all_reduce(x, dim, group):
        y = x.contiguous().clone()
        dist.all_reduce(y, group=group)
        return y

    def all_gather(x, dim, group, sizes_agreed=False, agree_at=None):
        parts = [torch.empty_like(x, memory_format=torch.contiguous_format)
                 for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim)

    def reduce_scatter(x, dim, group, sizes_agreed=False, agree_at=None):
        pieces = [p.contiguous() for p in x.chunk(dist.get_world_size(group), dim)]
        out = torch.empty_like(pieces[0])
        dist.reduce_scatter(out, pieces, group=group)
        return out

    saved = dict(regions._MOVES)
    for name, fn in (("all_reduce", all_reduce), ("all_gather", all_gather),
                     ("reduce_scatter", reduce_scatter)):
        regions._MOVES[name] = (fn, saved[name][1])
    try:
        yield
    finally:
        regions._MOVES.clear()
        regions._MOVES.update(saved)


def _local(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _grads(block, variant: str, world: int) -> dict:
    """Each parameter's full gradient (shards gathered), by name."""
    import torch.distributed as dist
    out = {}
    for name, p in block.named_parameters():
        g = _local(p.grad).detach()
        dim = getattr(p, "partition_dim", None)
        if variant.startswith("minidist") and dim is not None:
            parts = [torch.empty_like(g) for _ in range(world)]
            dist.all_gather(parts, g.contiguous())
            g = torch.cat(parts, dim)
        out[name] = g
    return out


def _step(block, x, variant: str, world: int, rank: int, lr: float = 1e-3):
    sp = "+sp" in variant
    xin = x.chunk(world, 1)[rank] if sp else x
    with _gloo_collectives(variant.endswith("/gloo")):
        y = block(xin)
        (y.pow(2).mean() / (world if sp else 1)).backward()
    if variant.startswith("minidist+sp"):
        from minidist.tensor_parallel.sequence import allreduce_sequence_parallel_grads
        allreduce_sequence_parallel_grads(block, None)
    with torch.no_grad():
        for p in block.parameters():
            p -= lr * p.grad
            p.grad = None
    return y


def _check(cfg, block, variant, x, world, rank) -> str | None:
    """Output and gradients against one process; None when within :data:`TOL` (relative)."""
    import torch.distributed as dist
    from minidist.models.gpt import Block
    torch.manual_seed(0)
    ref = Block(cfg)
    y_ref = ref(x)
    y_ref.pow(2).mean().backward()
    sp = "+sp" in variant
    with _gloo_collectives(variant.endswith("/gloo")):
        y = block(x.chunk(world, 1)[rank] if sp else x)
        (y.pow(2).mean() / (world if sp else 1)).backward()
    if variant.startswith("minidist+sp"):
        from minidist.tensor_parallel.sequence import allreduce_sequence_parallel_grads
        allreduce_sequence_parallel_grads(block, None)
    if sp:
        parts = [torch.empty_like(y) for _ in range(world)]
        dist.all_gather(parts, y.contiguous())
        y = torch.cat(parts, 1)
    errs = {"output": (y - y_ref).norm() / y_ref.norm()}
    for name, g in _grads(block, variant, world).items():
        want = dict(ref.named_parameters())[name].grad
        errs[name] = (g - want).norm() / want.norm().clamp_min(1e-30)
    for p in block.parameters():
        p.grad = None
    worst = max(errs, key=lambda k: float(errs[k]))
    return None if errs[worst] <= TOL else f"{variant}: {worst} off by {float(errs[worst]):.2e}"


def _counts(block, variant, x, world, rank) -> dict:
    """Collectives of one step: ``{op: count}``."""
    if variant.startswith("minidist"):
        from minidist.tensor_parallel import accounting
        with accounting.comm_log() as log:
            _step(block, x, variant, world, rank, lr=0.0)
        out: dict = {}
        for e in log:
            out[e.op] = out.get(e.op, 0) + 1
        return out
    from torch.distributed.tensor.debug import CommDebugMode
    with CommDebugMode() as mode:
        _step(block, x, variant, world, rank, lr=0.0)
    return {str(getattr(op, "__name__", op)).split(".")[-1]: n
            for op, n in mode.get_comm_counts().items() if n}


def _rank(rank, world, variants, steps, warmup, batch, seq, hidden, heads):
    import warnings
    warnings.filterwarnings("ignore")
    from torch.distributed.device_mesh import init_device_mesh

    from minidist.models.gpt import GPTConfig
    torch.set_num_threads(1)
    cfg = GPTConfig(n_embd=hidden, n_head=heads, block_size=seq)
    mesh = init_device_mesh("cpu", (world,))
    built = {v: _block(cfg, v, mesh) for v in variants}
    x0 = torch.randn(batch, seq, hidden, generator=torch.Generator().manual_seed(1))
    problems = [p for v in variants if (p := _check(cfg, built[v], v, x0, world, rank))]
    if problems:
        raise AssertionError("bench tp: a variant differs from one process — " + "; ".join(problems))
    counts = {v: _counts(built[v], v, x0, world, rank) for v in variants}
    times: dict = {v: [] for v in variants}
    for i in range(warmup + steps):
        x = torch.randn(batch, seq, hidden, generator=torch.Generator().manual_seed(100 + i))
        for v in balanced_order(list(variants), i):
            t0 = time.perf_counter()
            _step(built[v], x, v, world, rank)
            if i >= warmup:
                times[v].append(time.perf_counter() - t0)
    rows = []
    for v in variants:
        base = "torch+sp" if "+sp" in v else "torch"
        ratio = (statistics.median(a / b for a, b in zip(times[v], times[base]))
                 if base in times else float("nan"))
        rows.append({"variant": v, "world_size": world, "step_ms": 1e3 * statistics.median(times[v]),
                     "ratio": ratio, "vs": base, "collectives": counts[v]})
    return rows


def bench_tp(world_size: int = 2, steps: int = 10, warmup: int = 2, batch: int = 4,
             seq: int = 64, hidden: int = 256, heads: int = 8, variants=VARIANTS,
             timeout: float = 600, quiet: bool = False) -> list[dict]:
    """Run the benchmark on ``world_size`` ranks; print (unless ``quiet``) and return rank 0's
    rows: ``variant``, ``step_ms`` (median), ``ratio`` (median of per-step ratios to ``vs``),
    ``collectives`` (one step's, by op). Raises ``AssertionError`` if a variant differs from one
    process."""
    from minidist.launch import run
    rows = run(_rank, world_size, tuple(variants), steps, warmup, batch, seq, hidden, heads,
               timeout=timeout)[0]
    if not quiet:
        print(f"minidist bench tp: W={world_size}, one GPT block (hidden {hidden}, {heads} heads), "
              f"batch {batch} x {seq} tokens, fp32, median of {steps} steps; every variant equal "
              f"to one process within {TOL:g} first")
        print(f"{'variant':<13} {'step ms':>8} {'ratio':>6} {'vs':<9} collectives per step")
        for r in rows:
            ops = ", ".join(f"{n} {op}" for op, n in sorted(r["collectives"].items()))
            print(f"{r['variant']:<13} {r['step_ms']:8.2f} {r['ratio']:6.2f} {r['vs']:<9} {ops}")
        print("(the torch-again row is torch against itself: its distance from 1.00 is this run's "
              "noise; timings on shared CPU cores are indicative only)")
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="minidist bench tp", description=__doc__.split("\n\n")[0])
    p.add_argument("--world-sizes", nargs="*", type=int, default=[2, 4])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    a = p.parse_args(argv)
    for w in a.world_sizes:
        bench_tp(w, a.steps, batch=a.batch, seq=a.seq, hidden=a.hidden, heads=a.heads)
    return 0
