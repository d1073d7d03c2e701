"""The job in PaddlePaddle: fleet in collective mode, 2 processes under paddle.distributed.launch.

    python -m paddle.distributed.launch --host 127.0.0.1 --master 127.0.0.1:PORT \
        --nproc_per_node 2 --log_dir DIR frameworks/paddle_fleet.py --inputs I --out O --variant V

Without ``--host`` the launcher advertises this machine's network address instead of loopback;
without ``--log_dir`` it writes ./log. On CPU it picks gloo. ``fleet.distributed_model`` wraps
the layer in ``paddle.DataParallel`` (gradients averaged over the workers during backward).
"""
import os
import sys
import time

import paddle
import paddle.distributed as dist
import paddle.nn.functional as F
from paddle.distributed import fleet

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import job  # noqa: E402


def main():
    args = job.parse_args()
    fleet.init(is_collective=True)              # reads the launcher's PADDLE_* variables
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == job.WORKERS, f"the job is defined for {job.WORKERS} workers, got {world}"

    inputs = job.load_inputs(args.inputs)
    model = paddle.nn.Sequential(paddle.nn.Linear(64, 32), paddle.nn.ReLU(), paddle.nn.Linear(32, 10))
    for layer, i in ((model[0], 1), (model[2], 2)):   # Paddle's Linear weight is [in, out]
        layer.weight.set_value(inputs[f"w{i}"].T.copy())
        layer.bias.set_value(inputs[f"b{i}"])
    opt = paddle.optimizer.SGD(learning_rate=args.lr, parameters=model.parameters())
    opt = fleet.distributed_optimizer(opt)
    dp_model = fleet.distributed_model(model)

    losses, t0 = [], time.perf_counter()
    for t in range(args.steps):
        x, y = (paddle.to_tensor(a) for a in job.shard(inputs, t, rank))
        loss = F.cross_entropy(dp_model(x), y)   # mean over this worker's half
        loss.backward()                          # DataParallel averages gradients here
        opt.step()
        opt.clear_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
    step_s = (time.perf_counter() - t0) / args.steps

    if rank == 0:
        w = {"w1": model[0].weight.numpy().T, "b1": model[0].bias.numpy(),
             "w2": model[2].weight.numpy().T, "b2": model[2].bias.numpy()}
        job.save_result(args.out, losses, w, step_s=step_s)


if __name__ == "__main__":
    main()
