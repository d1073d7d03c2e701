"""The job in Hugging Face Accelerate, two gloo processes on the CPU under ``accelerate launch``.

    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --main_process_port P \
        frameworks/accelerate_job.py --inputs I --out O --variant V

The trap (measured with accelerate 1.15): ``accelerate launch --cpu --num_processes 2`` starts ONE
process (``DistributedType.NO``) and exits 0 without a warning. Two CPU processes need
``--multi_gpu`` (which here means "several processes", whatever the device) AND
``Accelerator(cpu=True)`` (or ``ACCELERATE_USE_CPU=1``); ``--multi_gpu`` without ``cpu=True``
starts two processes that each train alone. So the script records how many processes it saw and
refuses to train on fewer than the job's 2 (``--allow-fewer`` records it and goes on, for the test
that shows the trap).
"""
import os
import sys
import time

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import job  # noqa: E402


def main():
    args = job.parse_args(extra=[(("--allow-fewer",), {"action": "store_true",
                                  "help": "train on however many processes were started"})])
    acc = Accelerator(cpu=True)                 # without it, --multi_gpu on a CPU trains alone
    rank, world = acc.process_index, acc.num_processes
    info = {"processes": world, "distributed_type": str(acc.distributed_type),
            "backend": str(torch.distributed.get_backend()) if torch.distributed.is_initialized()
            else "none"}
    if world != job.WORKERS and not args.allow_fewer:
        raise SystemExit(f"accelerate started {world} process(es) ({info['distributed_type']}), "
                         f"the job needs {job.WORKERS}: use --multi_gpu --num_processes "
                         f"{job.WORKERS} with Accelerator(cpu=True), not --cpu")

    inputs = job.load_inputs(args.inputs)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    with torch.no_grad():                       # the shared initial weights
        for layer, i in ((model[0], 1), (model[2], 2)):
            layer.weight.copy_(torch.from_numpy(inputs[f"w{i}"]))
            layer.bias.copy_(torch.from_numpy(inputs[f"b{i}"]))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    ddp, opt = acc.prepare(model, opt)          # wraps in torch DDP when there are 2 processes

    losses, t0 = [], time.perf_counter()
    for t in range(args.steps):
        # each process its contiguous half (one process alone: the first half only)
        x, y = (torch.from_numpy(a).to(acc.device) for a in job.shard(inputs, t, rank))
        opt.zero_grad()
        loss = F.cross_entropy(ddp(x), y)
        acc.backward(loss)                      # DDP averages the gradients over the processes
        opt.step()
        losses.append(acc.reduce(loss.detach(), reduction="mean").item())  # the global mean
    step_s = (time.perf_counter() - t0) / args.steps

    if acc.is_main_process:
        w = {n: p.detach().cpu().numpy() for n, p in
             zip(job.WEIGHT_NAMES, acc.unwrap_model(ddp).parameters())}
        job.save_result(args.out, losses, w, step_s=step_s, **info)
    acc.wait_for_everyone()
    acc.end_training()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)   # gloo can abort at interpreter exit after the results are written
