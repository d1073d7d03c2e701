"""Data-parallel training on the digits, the same script on one machine, two torchrun trees, or Slurm.

Run it with any launcher; ``minidist.init()`` reads the launcher's variables (RANK / LOCAL_RANK /
WORLD_SIZE from torchrun, SLURM_PROCID / SLURM_LOCALID / SLURM_NTASKS from srun)::

    python -m torch.distributed.run --nproc_per_node=4 course/multinode/train.py      # one machine
    torchrun --nnodes=2 --nproc_per_node=2 --rdzv_backend=c10d \\
             --rdzv_endpoint=HEAD:29500 --rdzv_id=job1 course/multinode/train.py      # on each node
    sbatch course/multinode/sbatch_torchrun_cpu.sh                                   # Slurm

Every rank writes ``OUT/rank{r}.json`` (rank, local rank, node, hostname, a SHA-256 of its
parameters, final accuracy): a test compares those files, not interleaved log text. Rank 0 saves
a new generation of the checkpoint folder ``CKPT/checkpoint.pt/`` (the unwrapped model, so keys
have no ``module.`` prefix; the previous generation is removed only once the new one is complete)
after every epoch and every rank resumes from the newest complete one, so
``torchrun --max-restarts=N`` continues where a crash stopped. Set
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` for restarts: since pytorch PR #128096 (2024) the workers
share the rendezvous's TCP store, and a restarted worker can read the failed attempt's addresses
from it (pytorch#135712). Measured on torch 2.14.1 (chapter 08's crash): without the variable 2 of
5 restarts failed ("Connection refused"), 2 hung, 1 worked; with it 3 of 3 worked::

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 python -m torch.distributed.run --standalone \
        --nproc_per_node=2 --max-restarts=1 course/multinode/train.py --ckpt=CKPT

Fault injection for the troubleshooting lab: ``--crash-rank R --crash-epoch E`` (raises once, on
the first attempt only: TORCHELASTIC_RESTART_COUNT=0); ``--slow-rank R --slow-seconds S`` (sleeps
before the first collective while the others wait in it; with a short ``--timeout`` they fail).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

import minidist
from minidist.checkpoint_io import newest
from minidist_course.data import load_digits
from minidist.data_parallel import (BucketedDDP, DistributedSampler, evaluate, load_checkpoint,
                                    save_checkpoint)
from minidist.models import MLP


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.3)
    p.add_argument("--ddp", default="minidist", choices=["minidist", "torch"],
                   help="minidist's BucketedDDP (default) or torch's DDP")
    p.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds a collective may wait before the process group gives up")
    p.add_argument("--out", default=None, help="folder for rank{r}.json (a shared filesystem)")
    p.add_argument("--ckpt", default=None, help="folder for checkpoint.pt (a shared filesystem)")
    p.add_argument("--no-host-check", action="store_true",
                   help="allow several ranks with the same (hostname, local rank): two torchrun "
                        "trees simulating two nodes on one machine")
    p.add_argument("--crash-rank", type=int, default=None)
    p.add_argument("--crash-epoch", type=int, default=1)
    p.add_argument("--slow-rank", type=int, default=None)
    p.add_argument("--slow-seconds", type=float, default=0.0)
    return p.parse_args(argv)


def make_ddp(model: nn.Module, which: str, device) -> tuple[nn.Module, str]:
    """Wrap the model: minidist's bucketed DDP (hand-built, the course's own) or torch's (the reference)."""
    if which == "minidist":
        return BucketedDDP(model), "minidist.BucketedDDP"
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None), "torch DDP"


def param_digest(model: nn.Module) -> str:
    """SHA-256 of every parameter's bytes: equal digests mean bit-identical replicas."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def main(argv=None) -> int:
    args = parse_args(argv)
    info = minidist.init(backend=args.backend, timeout=args.timeout,
                         check_hosts=not args.no_host_check)
    rank, world = info.rank, info.world_size
    device = minidist.env.device()
    host = socket.gethostname()
    hosts = [None] * world
    dist.all_gather_object(hosts, host)  # who runs where: rank 0 may be on any node
    train_set, test_set = load_digits(seed=0)  # the same split on every rank
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=0,
                                 drop_last=True)  # disjoint shards, a new order every epoch
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    torch.manual_seed(0)  # the same init on every rank (DDP also broadcasts rank 0's values)
    model = MLP(64, (64,), 10).to(device)
    start_epoch = 0
    ckpt_path = os.path.join(args.ckpt, "checkpoint.pt") if args.ckpt else None
    if ckpt_path and newest(ckpt_path):  # a shared folder: every rank reads rank 0's file
        start_epoch = load_checkpoint(ckpt_path, model, map_location=device)["epoch"] + 1
        if rank == 0:
            print(f"resumed from {ckpt_path} at epoch {start_epoch}", flush=True)
    ddp, ddp_name = make_ddp(model, args.ddp, device)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.0)
    if rank == 0:
        print(f"world_size={world} backend={dist.get_backend()} hosts={sorted(set(hosts))} "
              f"launcher={info.launcher} ddp={ddp_name}", flush=True)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)  # a new shuffle every epoch, the same on every rank
        if rank == args.slow_rank and epoch == start_epoch:
            print(f"rank {rank}: doing {args.slow_seconds:.0f} s of extra work", flush=True)
            time.sleep(args.slow_seconds)
        if rank == args.crash_rank and epoch == args.crash_epoch and attempt == 0:
            raise RuntimeError(f"rank {rank}: injected crash in epoch {epoch}")
        total = torch.zeros(2, device=device, dtype=torch.float64)
        for x, y in loader:
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(ddp(x.to(device)), y.to(device))
            loss.backward()  # DDP averages gradients over ranks here
            opt.step()
            total[0] += loss.detach().double() * len(y)  # summed loss and sample count, for the log
            total[1] += len(y)
        dist.all_reduce(total)
        acc = evaluate(model, test_set)["accuracy"]  # every test sample counted once
        if rank == 0:
            print(f"epoch {epoch}: loss {total[0].item() / total[1].item():.4f}  "
                  f"test accuracy {acc:.4f}", flush=True)
        if ckpt_path:  # rank 0 writes the unwrapped model atomically; every rank waits for it
            save_checkpoint(ckpt_path, model, extra={"epoch": epoch})

    acc = evaluate(model, test_set)["accuracy"]
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        record = dict(rank=rank, local_rank=info.local_rank, world_size=world,
                      node_rank=info.node_rank, launcher=info.launcher, hostname=host,
                      hosts=hosts, pid=os.getpid(), params_sha256=param_digest(model),
                      accuracy=acc, backend=dist.get_backend(), attempt=attempt, ddp=ddp_name)
        with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
            json.dump(record, f)
    dist.barrier()
    del ddp  # release DDP's reducer before the process group (a clean teardown)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
