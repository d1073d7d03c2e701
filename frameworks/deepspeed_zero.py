"""The job in DeepSpeed, ZeRO stage 0, 1, 2 or 3, on its CPU accelerator (gloo) under torchrun.

    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node 2 frameworks/deepspeed_zero.py \
        --inputs I --out O --variant V --stage S

Stage 0 is plain data parallelism; 1 shards the optimizer state, 2 also the gradients
(reduce-scatter instead of all-reduce), 3 also the parameters (all-gathered layer by layer) —
the stages of the sharding chapter. With plain SGD every stage computes the same update.
"""
import os
import sys
import time

import deepspeed
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import job  # noqa: E402


def main():
    args = job.parse_args(extra=[
        (("--stage",), {"type": int, "choices": [0, 1, 2, 3], "required": True}),
        (("--clipping",), {"choices": ["off", "default"], "default": "off",
                           "help": "default: leave DeepSpeed's gradient_clipping unset (the trap)"})])
    deepspeed.init_distributed(dist_backend="gloo")    # the CPU accelerator would pick oneCCL
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()

    inputs = job.load_inputs(args.inputs)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    with torch.no_grad():                       # the shared initial weights
        for layer, i in ((model[0], 1), (model[2], 2)):
            layer.weight.copy_(torch.from_numpy(inputs[f"w{i}"]))
            layer.bias.copy_(torch.from_numpy(inputs[f"b{i}"]))
    config = {
        "train_batch_size": job.GLOBAL_BATCH,                 # = micro batch × workers × accumulation
        "train_micro_batch_size_per_gpu": job.LOCAL_BATCH,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,           # the default is 1.0: a long run would silently differ
        "zero_optimization": {"stage": args.stage},
        "zero_allow_untested_optimizer": True,                 # our own torch.optim.SGD
    }
    if args.clipping == "default":
        del config["gradient_clipping"]
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)

    losses, t0 = [], time.perf_counter()
    for t in range(args.steps):
        x, y = (torch.from_numpy(a).to(engine.device) for a in job.shard(inputs, t, rank))
        loss = F.cross_entropy(engine(x), y)
        engine.backward(loss)                   # gradients averaged (stage 2/3: reduce-scattered)
        engine.step()                           # optimizer step on this rank's partition, zero_grad
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        losses.append(mean.item() / world)
    step_s = (time.perf_counter() - t0) / args.steps

    # stage 3 keeps 1/W of each parameter per rank: gather them (a collective, all ranks call it)
    with deepspeed.zero.GatheredParameters(list(model.parameters()), enabled=args.stage == 3):
        w = {n: p.detach().cpu().numpy().copy() for n, p in zip(job.WEIGHT_NAMES, model.parameters())}
    if rank == 0:
        job.save_result(args.out, losses, w, step_s=step_s)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)   # gloo can abort at interpreter exit after the results are written
