"""The GPU check: every CUDA path of minidist on a machine with (at least) one GPU, in minutes.

Run it with ``tools/gpu-check.sh`` (or ``python -m minidist_course.lessons.gpu_check``). One line per
check, ``PASS``/``FAIL``/``SKIP``, then a summary; the exit status is 1 if any check FAILed. On a
machine without a GPU it says so and exits 0 without running anything.

Every reference runs on the GPU too, in rank 0's process (the parent never initialises CUDA, as
``minidist.run`` requires): ranks sharing the GPU (gloo between them, CUDA tensors staged through
pinned CPU buffers) against one process on the GPU; hand-built collectives against torch's gloo
collectives on CPU copies of the same tensors. Tolerances: float32, 1e-5 relative to the largest
magnitude (summation order differs). ``--rehearse`` runs the same checks with ``device="cpu"``
and staging forced on, to test this file on a machine without a GPU.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from minidist import collectives as C, env
from minidist.comm import staging
from minidist.launch import run

TOL = 1e-5
SIZES = (0, 1, 3, 1001, (1 << 16) + 3)
_TORCH = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def _exact():
    """No TF32: the GPU computes in full float32 like the CPU reference."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def _err(a, b) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    if a.numel() == 0:
        return 0.0 if b.numel() == 0 else float("inf")
    return ((a - b).abs().max() / max(1.0, b.abs().max().item())).item()


def _max_err(a: dict, b: dict) -> float:
    return max(_err(a[k], b[k]) for k in b)


# --------------------------------------------------------------------------- collectives
def _collectives_rank(rank, world):
    dev, worst, bad, last = env.device(), {}, [], world - 1
    for n in SIZES:
        g = torch.Generator().manual_seed(rank * 7919 + n)
        x_cpu = torch.randn(n, generator=g)
        x = x_cpu.to(dev)
        for op in ("sum", "max"):
            ref = x_cpu.clone()
            dist.all_reduce(ref, op=_TORCH[op]) if n else None
            for alg in C.ALGORITHMS["all_reduce"]:
                worst[f"all_reduce/{alg}"] = max(worst.get(f"all_reduce/{alg}", 0), _err(
                    C.all_reduce(x.clone(), op=op, algorithm=alg), ref))
            for alg in C.ALGORITHMS["reduce"]:
                got = C.reduce(x.clone(), last, op=op, algorithm=alg)
                e = _err(got, ref) if rank == last else 0.0
                worst[f"reduce/{alg}"] = max(worst.get(f"reduce/{alg}", 0), e)
            big_cpu = torch.randn(n * world, generator=g)
            ref_rs = big_cpu.clone()
            dist.all_reduce(ref_rs, op=_TORCH[op]) if n else None
            for alg in C.ALGORITHMS["reduce_scatter"]:
                scratch = big_cpu.to(dev, copy=True)  # reduce_scatter writes into its input
                out = C.reduce_scatter(torch.empty(n, device=dev), scratch, op=op, algorithm=alg)
                worst[f"reduce_scatter/{alg}"] = max(worst.get(f"reduce_scatter/{alg}", 0),
                                                     _err(out, ref_rs[rank * n:(rank + 1) * n]))
        ref_ag = [torch.empty_like(x_cpu) for _ in range(world)]
        dist.all_gather(ref_ag, x_cpu) if n else None
        for alg in C.ALGORITHMS["all_gather"]:
            out = C.all_gather(torch.empty(n * world, device=dev), x, algorithm=alg)
            worst[f"all_gather/{alg}"] = max(worst.get(f"all_gather/{alg}", 0),
                                             _err(out, torch.cat(ref_ag)))
            bad += [] if out.device == x.device else [f"all_gather/{alg} left {dev}"]
        ref_bc = x_cpu.clone()
        dist.broadcast(ref_bc, src=last) if n else None
        for alg in C.ALGORITHMS["broadcast"]:
            worst[f"broadcast/{alg}"] = max(worst.get(f"broadcast/{alg}", 0), _err(
                C.broadcast(x.clone(), last, algorithm=alg), ref_bc))
    return worst, bad, staging.stats()["staged_sends"]


def check_collectives(world, device):
    res = run(_collectives_rank, world, device=device, timeout=300)
    worst = {k: max(r[0][k] for r in res) for k in res[0][0]}
    bad = [b for r in res for b in r[1]] + [k for k, e in worst.items() if e > TOL]
    staged = min(r[2] for r in res)
    ok = not bad and staged > 0
    return ok, (f"{len(worst)} collective/algorithm pairs, sizes {SIZES}: worst error "
                f"{max(worst.values()):.1e} (<= {TOL}); {staged} messages staged per rank"
                + (f"; wrong: {bad}" if bad else ""))


# --------------------------------------------------------------------------- DDP, TP, PP, ZeRO
def _ddp_rank(rank, world):
    from minidist.data_parallel import BucketedDDP
    from ..references.data_parallel import global_batch, make_model, shard
    _exact()
    dev = env.device()

    def train(model, wrap, r, w):
        ddp = wrap(model.to(dev))
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        for step in range(3):
            x, y = global_batch(step, 16)
            opt.zero_grad()
            F.cross_entropy(ddp(shard(x, r, w).to(dev)), shard(y, r, w).to(dev)).backward()
            opt.step()
        getattr(ddp, "close", lambda: None)()
        return [p.detach().cpu() for p in model.parameters()]
    got = train(make_model(rank), lambda m: BucketedDDP(m, bucket_cap_mb=0.001), rank, world)
    ref = train(make_model(0), lambda m: m, 0, 1) if rank == 0 else got
    return max(_err(a, b) for a, b in zip(got, ref))


def _tp_rank(rank, world):
    from minidist.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from minidist.tensor_parallel.sharding import gather_state_dict
    _exact()
    dev = env.device()
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16)).to(dev)
    torch.manual_seed(0)
    tp = nn.Sequential(ColumnParallelLinear(16, 64), nn.ReLU(), RowParallelLinear(64, 16)).to(dev)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1)).to(dev)
    yr, yt = ref(x), tp(x)
    (yr ** 2).sum().backward()
    (yt ** 2).sum().backward()
    grads = gather_state_dict(tp, grads=True)
    return max(_err(yt, yr), _max_err(grads, {n: p.grad for n, p in ref.named_parameters()}))


def _pp_rank(rank, world):
    from minidist.pipeline_parallel.engine import local_stages, pipeline_step
    from minidist.pipeline_parallel.catalog import make_schedule
    _exact()
    dev = env.device()

    def model():
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(world)])
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(12, 32, generator=g).to(dev), torch.randn(12, 32, generator=g).to(dev)
    sched = make_schedule("1f1b", world, 4)
    mods = {s: m.to(dev) for s, m in local_stages(list(model()), sched, rank).items()}
    pipeline_step(sched, mods, x, y, F.mse_loss, device=dev)
    full = model().to(dev)
    F.mse_loss(full(x), y).backward()
    return max(_err(p.grad, q.grad) for s, m in mods.items()
               for p, q in zip(m.parameters(), full[s].parameters()))


def _zero_rank(rank, world):
    from minidist.sharding import ShardedOptimizer, account, fully_shard, full_state_dict, zero_formula
    from ..references.sharding import Block, local_batch, loss_fn, make_model, named_state
    _exact()
    dev, out = env.device(), {}
    big = dict(vocab=4096, dim=256, hidden=1024)  # Ψ in the millions: allocator rounding is noise
    for stage in (1, 2, 3):
        for kw, steps in (({}, 3), (big, 2)):
            if dev.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            model = make_model(**kw).to(dev)
            psi = sum(p.numel() for p in model.parameters() if p.requires_grad)
            if stage == 3:
                model = fully_shard(model, auto_wrap=(Block,))
                opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            else:
                opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=stage,
                                       grads="local", lr=1e-2)
            for step in range(steps):
                opt.zero_grad()
                x, y = local_batch(step, rank, world)
                loss_fn(model(x.to(dev)), y.to(dev)).backward()
                opt.step()
            if kw:
                held = torch.cuda.memory_allocated() - base if dev.type == "cuda" else None
                peak = torch.cuda.max_memory_allocated() - base if dev.type == "cuda" else None
                out[stage, "memory"] = (held, peak, account(model, opt),
                                        zero_formula(psi, world, stage, 8, 4, 4))
            else:
                state = full_state_dict(model) if stage == 3 else named_state(model)
                out[stage, "state"] = {k: v.cpu() for k, v in state.items()}
            del model, opt
    if rank == 0:  # one process on the same device
        model = make_model().to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(3):
            opt.zero_grad()
            x, y = local_batch(step, 0, 1)
            loss_fn(model(x.to(dev)), y.to(dev)).backward()
            opt.step()
        out["single"] = {k: v.cpu() for k, v in named_state(model).items()}
    return out


def _worst(fn, world, device):
    errs = run(fn, world, device=device, timeout=300)
    return max(errs) <= TOL, f"max error {max(errs):.1e} over {world} ranks (<= {TOL})"


def check_ddp(device):
    ok, text = _worst(_ddp_rank, 2, device)
    return ok, "BucketedDDP, 2 ranks sharing the device, 3 SGD steps vs one process: " + text


def check_tp(device):
    ok, text = _worst(_tp_rank, 2, device)
    return ok, "column+row parallel MLP, 2 ranks, output and gathered weight grads: " + text


def check_pp(device):
    ok, text = _worst(_pp_rank, 2, device)
    return ok, "1F1B, 2 stages x 4 micro-batches, every gradient: " + text


_ZERO = {}


def _zero(device, world=2):
    if device not in _ZERO:
        _ZERO[device] = run(_zero_rank, world, device=device, timeout=300)
    return _ZERO[device]


def check_zero(device):
    from ..references.sharding import max_abs_diff
    res = _zero(device)
    errs = {s: max(max_abs_diff(r[s, "state"], res[0]["single"]) for r in res) for s in (1, 2, 3)}
    ok = max(errs.values()) <= TOL
    return ok, ("ZeRO-1/2/3 (AdamW, 3 steps, 2 ranks) vs one process: "
                + ", ".join(f"stage {s} {e:.1e}" for s, e in errs.items()) + f" (<= {TOL})")


def check_memory(device):
    """Model-state bytes a rank holds after a step (CUDA's count) against ZeRO §5's formula."""
    res, rows, ok = _zero(device), [], True
    for s in (1, 2, 3):
        held, peak, acc, want = res[0][s, "memory"]
        accounted = acc["params"] + acc["grads"] + acc["optimizer"]
        ok &= abs(accounted - want["total"]) <= 0.02 * want["total"]  # flat-buffer padding only
        if held is not None:  # on a GPU: what the allocator says, within 25% (+ 4 MiB of scratch)
            ok &= abs(held - want["total"]) <= 0.25 * want["total"] + (4 << 20)
        mib = lambda b: "n/a" if b is None else f"{b / 2**20:.1f}"  # noqa: E731
        rows.append(f"stage {s}: formula {mib(want['total'])} MiB, accounted {mib(accounted)}, "
                    f"cuda held {mib(held)}, cuda peak {mib(peak)}")
    helds = [res[0][s, "memory"][0] for s in (1, 2, 3)]
    if helds[0] is not None:
        ok &= helds[0] > helds[1] > helds[2]  # each stage shards one more kind of state
    return ok, "rank 0 after a step, 2 ranks: " + "; ".join(rows)


def _nccl_rank(rank, world):
    dev, errs = env.device(), []
    for n in SIZES:
        x = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dev)
        for name, table in C.ALGORITHMS.items():
            for alg, _ in table.items():
                t = x.clone()
                if name == "all_reduce":
                    C.all_reduce(t, algorithm=alg)
                elif name == "reduce":
                    C.reduce(t, 0, algorithm=alg)
                elif name == "broadcast":
                    C.broadcast(t, 0, algorithm=alg)
                elif name == "all_gather":
                    t = C.all_gather(torch.empty_like(x), x, algorithm=alg)
                else:
                    t = C.reduce_scatter(torch.empty_like(x), x.clone(), algorithm=alg)
                errs.append((f"{name}/{alg}", _err(t, x), t.device == x.device))
        t = x.clone()
        dist.all_reduce(t)  # torch's own, on the NCCL communicator
        errs.append(("torch all_reduce", _err(t, x), t.device == x.device))
    return dist.get_backend(), errs


def check_nccl(device):
    if device != "cuda":
        return None, "needs a GPU (NCCL moves CUDA tensors only)"
    backend, errs = run(_nccl_rank, 1, backend="nccl", device="cuda", timeout=300)[0]
    bad = [n for n, e, same in errs if e > 0 or not same]
    return backend == "nccl" and not bad, (f"backend {backend}, W=1, {len(errs) // len(SIZES)} "
                                           f"collectives x sizes {SIZES}: "
                                           + ("all exact, on the GPU" if not bad else f"wrong: {bad}"))


def _bf16_rank(rank, world):
    from minidist.models.gpt import GPT, GPTConfig
    dev = env.device()
    torch.manual_seed(0)
    big = dev.type == "cuda"  # the rehearsal on a CPU core gets a model 16x smaller
    cfg = GPTConfig(vocab_size=256, block_size=128, n_layer=4 if big else 2, n_head=8,
                    n_embd=256 if big else 64)
    model = GPT(cfg).to(dev)
    ids = torch.randint(0, 256, (16 if big else 4, 128),
                        generator=torch.Generator().manual_seed(0)).to(dev)
    out = {}
    for name, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
        def step(dtype=dtype):
            with torch.autocast(dev.type, dtype=dtype, enabled=dtype is not None):
                loss = model(ids[:, :-1], ids[:, 1:])[1]
            loss.backward()
            return loss.item()
        step()  # warm-up (kernels, allocator)
        sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        losses = [step() for _ in range(10)]
        sync()
        out[name] = ((time.perf_counter() - t0) / 10, losses[0])
    return out


def check_bf16(device):
    r = run(_bf16_rank, 1, device=device, timeout=300)[0]
    (t32, l32), (t16, l16) = r["fp32"], r["bf16"]
    ok = abs(l16 - l32) <= 0.05 * abs(l32)
    return ok, (f"tiny GPT (4 layers, 256 wide, 16 x 127 tokens on a GPU) step: fp32 {t32 * 1e3:.1f} ms, bf16 autocast "
                f"{t16 * 1e3:.1f} ms ({t32 / t16:.2f}x; measured, not asserted); loss {l32:.4f} vs "
                f"{l16:.4f} (within 5%)")


def check_demo(device):
    import subprocess
    p = subprocess.run([sys.executable, "-m", "minidist", "demo", "--device", device],
                       capture_output=True, text=True, timeout=300)
    return p.returncode == 0, f"`minidist demo --device {device}` exit status {p.returncode}"


CHECKS = [
    ("collectives W=2 sharing the device vs torch gloo on CPU copies",
     lambda d: check_collectives(2, d)),
    ("collectives W=4 sharing the device vs torch gloo on CPU copies",
     lambda d: check_collectives(4, d)),
    ("ddp", check_ddp), ("tp", check_tp), ("pp", check_pp), ("zero", check_zero),
    ("nccl W=1 every collective", check_nccl),
    ("memory per rank, ZeRO stages vs formula", check_memory),
    ("bf16 autocast vs fp32", check_bf16),
    ("demo --device cuda", check_demo),
]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rehearse = "--rehearse" in argv
    if not rehearse and torch.cuda.device_count() == 0:  # asks; initialises nothing
        print("gpu-check: needs a GPU (torch sees none: torch.cuda.device_count() == 0); "
              "nothing was run.")
        return 0
    device = "cpu" if rehearse else "cuda"
    if rehearse:
        os.environ["MINIDIST_FORCE_STAGING"] = "1"  # the ranks inherit it: every message staged
        print("gpu-check --rehearse: the checks on the CPU, staging forced on (no GPU involved)")
    only = [a for a in argv if not a.startswith("--")]
    failed, t0 = 0, time.monotonic()
    for name, check in CHECKS:
        if only and not any(o in name for o in only):
            continue
        t = time.monotonic()
        try:
            ok, detail = check(device)
        except Exception as e:  # noqa: BLE001 - a crash is a FAIL line, then the next check
            ok, detail = False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        word = "SKIP" if ok is None else "PASS" if ok else "FAIL"
        failed += ok is False
        print(f"{word} {name} [{time.monotonic() - t:.0f} s]: {detail}", flush=True)
    print(f"gpu-check: {failed} failed, {time.monotonic() - t0:.0f} s in all")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
