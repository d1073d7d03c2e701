"""The job in Horovod (PyTorch front end, gloo), 2 processes under horovodrun.

    horovodrun -np 2 -H localhost:2 --gloo --network-interfaces lo \
        python frameworks/horovod_job.py --inputs I --out O --variant V

Horovod is no longer maintained (last release 0.28.1, 2023); it is here because many code bases
and papers still use it. ``hvd.DistributedOptimizer`` hooks every gradient and all-reduces it
(averaged by default) in fused buffers before ``step()``: bucketed all-reduce with averaging.
"""
import os
import sys
import time

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import job  # noqa: E402


def main():
    args = job.parse_args()
    hvd.init()
    rank, world = hvd.rank(), hvd.size()
    assert world == job.WORKERS, f"the job is defined for {job.WORKERS} workers, got {world}"

    inputs = job.load_inputs(args.inputs)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    with torch.no_grad():                       # the shared initial weights
        for layer, i in ((model[0], 1), (model[2], 2)):
            layer.weight.copy_(torch.from_numpy(inputs[f"w{i}"]))
            layer.bias.copy_(torch.from_numpy(inputs[f"b{i}"]))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)   # same start everywhere
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())  # op=Average

    losses, t0 = [], time.perf_counter()
    for t in range(args.steps):
        x, y = (torch.from_numpy(a) for a in job.shard(inputs, t, rank))
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()                         # hooks start the all-reduces
        opt.step()                              # waits for them, then SGD
        losses.append(hvd.allreduce(loss.detach(), op=hvd.Average, name="loss").item())
    step_s = (time.perf_counter() - t0) / args.steps

    if rank == 0:
        w = {n: p.detach().numpy() for n, p in zip(job.WEIGHT_NAMES, model.parameters())}
        job.save_result(args.out, losses, w, step_s=step_s)
    hvd.shutdown()


if __name__ == "__main__":
    main()
