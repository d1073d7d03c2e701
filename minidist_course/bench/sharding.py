"""``minidist bench zero`` — DDP, ZeRO-1/2/3 (hand-built and torch collectives) and torch's FSDP2
on one model in one run: median step time and accounted memory per rank beside ZeRO's formula.

Every variant is built on every rank from the same seed; steps alternate between variants (in a
balanced order, each in every position and after every other alike:
:func:`minidist_course.bench.collectives.balanced_order`) so machine noise hits all alike. Memory is
*accounted* (live tensors after ``optimizer.step()``: parameters, gradients, per-element
optimizer states; see
:mod:`minidist.sharding.memory`), and on CUDA ``torch.cuda.max_memory_allocated`` is added;
formula = ZeRO §5 with 4-byte parameters/gradients and K = 8 (AdamW, fp32). Step times on a loaded
CPU machine are indicative only; the ratio column is each variant's median per-step ratio to FSDP2,
and ``fsdp2-again`` (a second FSDP2 model, the same in every way) is the control: how far from 1
FSDP2 against itself strays in the same run.
"""

from __future__ import annotations

import statistics
import time

import torch

__all__ = ["bench_zero", "VARIANTS"]

VARIANTS = ["ddp", "ddp-torch", "zero1", "zero1-torch", "zero2", "zero2-torch", "zero3",
            "zero3-torch", "fsdp2", "fsdp2-again"]
STAGE = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp2": 3, "fsdp2-again": 3}


def _model(dim, hidden, blocks, vocab):
    from ..references.sharding import make_model
    return make_model(frozen=False, vocab=vocab, dim=dim, hidden=hidden, blocks=blocks)


def _build(name, dims):
    from minidist.data_parallel import BucketedDDP
    from ..references.sharding import Block
    from minidist.sharding import ShardedOptimizer, fully_shard

    kind = "torch" if name.endswith("-torch") else "hand-built"
    base = name.replace("-torch", "")
    model = _model(*dims)
    if base == "ddp":
        model = BucketedDDP(model, collectives=kind, broadcast_buffers=False)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)
    if base in ("zero1", "zero2"):
        opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, collectives=kind,
                               stage=int(base[-1]), grads="local", lr=1e-3)
        return model, opt
    if base == "zero3":
        model = fully_shard(model, auto_wrap=(Block,), collectives=kind)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for b in model.blocks:
        torch_fully_shard(b, mesh=mesh)
    torch_fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _account(name, model, opt) -> dict:
    from minidist.sharding import account
    if not name.startswith("fsdp2"):
        return account(model, opt)
    ps = [_local(p) for p in model.parameters()]
    gs = [_local(p.grad) for p in model.parameters() if p.grad is not None]
    st = [_local(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    size = sum(t.numel() * t.element_size() for t in ps)
    return {"params": size, "grads": sum(t.numel() * t.element_size() for t in gs),
            "optimizer": sum(t.numel() * t.element_size() for t in st if t.dim() > 0)}


def _rank(rank, world, variants, steps, warmup, batch, dims):
    import warnings
    warnings.filterwarnings("ignore", message=".*(FSDP2-wrapped|TypedStorage).*")
    from ..references.sharding import loss_fn
    from minidist.sharding import zero_formula
    from .collectives import balanced_order
    built = {v: _build(v, dims) for v in variants}
    g = torch.Generator().manual_seed(rank)
    times = {v: [] for v in variants}
    for step in range(warmup + steps):
        x = torch.randint(0, dims[3], (batch, 33), generator=g)
        order = balanced_order(list(variants), step)
        for v in order:
            model, opt = built[v]
            t0 = time.perf_counter()
            opt.zero_grad()
            loss_fn(model(x[:, :-1]), x[:, 1:]).backward()
            opt.step()
            if step >= warmup:
                times[v].append(time.perf_counter() - t0)
    psi = sum(p.numel() for p in _model(*dims).parameters())
    rows = []
    for v in variants:
        acc = _account(v, *built[v])
        base = v.replace("-torch", "")
        formula = zero_formula(psi, world, STAGE[base], 8, 4, 4)["total"]
        ratio = (statistics.median(a / b for a, b in zip(times[v], times["fsdp2"]))
                 if "fsdp2" in times else float("nan"))
        rows.append({"variant": v, "rank": rank, "step_ms": 1e3 * statistics.median(times[v]),
                     "ratio_to_fsdp2": ratio, "model_states_bytes":
                     acc["params"] + acc["grads"] + acc["optimizer"], "formula_bytes": formula,
                     **{k: acc[k] for k in ("params", "grads", "optimizer")}})
    for v in variants:
        if hasattr(built[v][0], "close"):
            built[v][0].close()
    return rows


def bench_zero(world_size: int = 2, steps: int = 10, warmup: int = 2, batch: int = 8,
               dim: int = 256, hidden: int = 1024, blocks: int = 4, vocab: int = 512,
               variants=None, timeout: float = 600) -> list[dict]:
    """Run the benchmark on ``world_size`` ranks; print and return rank 0's rows."""
    from minidist.launch import run
    variants = list(variants or VARIANTS)
    rows = run(_rank, world_size, variants, steps, warmup, batch, (dim, hidden, blocks, vocab),
               timeout=timeout)[0]
    print(f"minidist bench zero: W={world_size}, TiedLM dim {dim}, hidden {hidden}, {blocks} "
          f"blocks, vocab {vocab}, AdamW, batch {batch}x32 per rank, median of {steps} steps")
    print(f"{'variant':<12} {'step ms':>9} {'x FSDP2':>8} {'params MiB':>11} {'grads MiB':>10} "
          f"{'optim MiB':>10} {'total MiB':>10} {'formula':>8}")
    mib = 2 ** 20
    for r in rows:
        print(f"{r['variant']:<12} {r['step_ms']:9.1f} {r['ratio_to_fsdp2']:8.2f} "
              f"{r['params'] / mib:11.2f} {r['grads'] / mib:10.2f} {r['optimizer'] / mib:10.2f} "
              f"{r['model_states_bytes'] / mib:10.2f} {r['formula_bytes'] / mib:8.2f}")
    print("(timings on a shared CPU are indicative only; memory is exact accounting of live "
          "tensors, the formula is ZeRO §5 with fp32 and K = 8)")
    return rows
