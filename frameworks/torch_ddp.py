"""The job in plain PyTorch DDP: the primer's torchrun recipe, line by line.

    torchrun --standalone --nproc_per_node 2 frameworks/torch_ddp.py --inputs I --out O --variant V

torchrun starts 2 processes and gives each RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT
(--standalone: a rendezvous on a free port of this machine).
"""
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import job  # noqa: E402


class Stream(Dataset):
    """The job's samples in the order the steps use them. DistributedSampler deals indices
    round-robin (rank, rank + W, ...), so within each global batch the samples are laid out
    interleaved: round-robin then hands each worker its contiguous half, as in every framework."""

    def __init__(self, inputs, steps):
        self.inputs, self.steps = inputs, steps

    def __len__(self):
        return self.steps * job.GLOBAL_BATCH

    def __getitem__(self, i):
        step, pos = divmod(i, job.GLOBAL_BATCH)
        rank, k = pos % job.WORKERS, pos // job.WORKERS
        x, y = job.shard(self.inputs, step, rank)
        return torch.from_numpy(x[k]), int(y[k])


def main():
    args = job.parse_args()
    dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    assert world == job.WORKERS, f"the job is defined for {job.WORKERS} workers, got {world}"

    inputs = job.load_inputs(args.inputs)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    with torch.no_grad():                       # the shared initial weights
        for layer, i in ((model[0], 1), (model[2], 2)):
            layer.weight.copy_(torch.from_numpy(inputs[f"w{i}"]))
            layer.bias.copy_(torch.from_numpy(inputs[f"b{i}"]))
    model = model.to(device)
    ddp = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr)

    data = Stream(inputs, args.steps)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False)
    loader = DataLoader(data, batch_size=job.LOCAL_BATCH, sampler=sampler)

    losses, t0 = [], time.perf_counter()
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        opt.zero_grad()
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()                         # DDP averages gradients over the workers here
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)                   # sum of the workers' means ...
        losses.append(mean.item() / world)      # ... / W = the global batch's mean

    if rank == 0:
        w = {n: p.detach().cpu().numpy() for n, p in zip(job.WEIGHT_NAMES, model.parameters())}
        job.save_result(args.out, losses, w, step_s=(time.perf_counter() - t0) / args.steps)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)   # gloo can abort at interpreter exit after the results are written
