"""The job in PyTorch FSDP2 (``fully_shard``): parameters, gradients and optimizer state sharded.

    torchrun --standalone --nproc_per_node 2 frameworks/torch_fsdp2.py --inputs I --out O --variant V

Each worker keeps 1/W of every parameter (a DTensor sharded on dim 0). Forward all-gathers a
layer's parameters just before it runs and frees them after; backward reduce-scatters the
gradients, so each worker updates only its shard: ZeRO stage 3 (the sharding chapter).
"""
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import job  # noqa: E402


def main():
    args = job.parse_args()
    dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")

    inputs = job.load_inputs(args.inputs)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    with torch.no_grad():                       # the shared initial weights, before sharding
        for layer, i in ((model[0], 1), (model[2], 2)):
            layer.weight.copy_(torch.from_numpy(inputs[f"w{i}"]))
            layer.bias.copy_(torch.from_numpy(inputs[f"b{i}"]))
    model = model.to(device)
    for layer in (model[0], model[2]):          # one all-gather unit per layer ...
        fully_shard(layer)
    fully_shard(model)                          # ... then the root (whatever is left)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)   # steps on the local shards

    losses, t0 = [], time.perf_counter()
    for t in range(args.steps):
        x, y = (torch.from_numpy(a).to(device) for a in job.shard(inputs, t, rank))
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()                         # reduce-scatter: each rank gets its shard's mean grad
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    step_s = (time.perf_counter() - t0) / args.steps

    # full_tensor() all-gathers a DTensor: a collective, so every rank calls it
    w = {n: p.full_tensor().detach().cpu().numpy() for n, p in zip(job.WEIGHT_NAMES, model.parameters())}
    if rank == 0:
        job.save_result(args.out, losses, w, step_s=step_s)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)   # gloo can abort at interpreter exit after the results are written
