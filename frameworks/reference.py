"""The references every framework is checked against: minidist's own DDP, and one torch process.

* ``minidist``: :class:`minidist.data_parallel.BucketedDDP` on the hand-built collectives, 2 ranks
  started by :func:`minidist.run`; each rank trains on its contiguous half, the loss is averaged
  with minidist's ring all-reduce.
* ``single``: one torch process on the whole global batch (no distribution at all).

Both run in the project's venv::

    python frameworks/reference.py --inputs inputs.npz --out minidist.npz --variant short [--single]
"""

from __future__ import annotations

import inspect
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import job  # noqa: E402


def mlp(inputs: dict) -> nn.Module:
    """The job's MLP with the shared initial weights."""
    model = nn.Sequential(nn.Linear(*job.SIZES[:2]), nn.ReLU(), nn.Linear(*job.SIZES[1:]))
    with torch.no_grad():
        for layer, i in ((model[0], 1), (model[2], 2)):
            layer.weight.copy_(torch.from_numpy(inputs[f"w{i}"]))
            layer.bias.copy_(torch.from_numpy(inputs[f"b{i}"]))
    return model


def weights(model: nn.Module) -> dict:
    """Final weights in the job's layout (torch's)."""
    return {"w1": model[0].weight.detach().numpy().copy(), "b1": model[0].bias.detach().numpy().copy(),
            "w2": model[2].weight.detach().numpy().copy(), "b2": model[2].bias.detach().numpy().copy()}


def _hand_built_kwargs() -> dict:
    # minidist's DDP picks its collectives with `collectives="hand-built"` (older: `comm="minidist"`)
    from minidist.data_parallel import DataParallelBase
    params = inspect.signature(DataParallelBase.__init__).parameters
    return {"collectives": "hand-built"} if "collectives" in params else {"comm": "minidist"}


def _minidist_rank(rank: int, world: int, inputs_path: str, variant: str):
    from minidist import collectives
    from minidist.data_parallel import BucketedDDP

    inputs = job.load_inputs(inputs_path)
    steps, lr = job.VARIANTS[variant]["steps"], job.VARIANTS[variant]["lr"]
    model = mlp(inputs)
    ddp = BucketedDDP(model, **_hand_built_kwargs())
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for t in range(steps):
        x, y = job.shard(inputs, t, rank)
        opt.zero_grad()
        loss = F.cross_entropy(ddp(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()            # gradients averaged over the 2 ranks when this returns
        opt.step()
        mean = loss.detach().clone()
        collectives.all_reduce(mean, op="avg")   # halves are equal: mean of means = global mean
        losses.append(mean.item())
    return losses, weights(model)


def run_minidist(inputs_path: str, variant: str, timeout: float = 120.0) -> tuple[list, dict]:
    """minidist's BucketedDDP on 2 ranks: (losses per step, final weights of rank 0)."""
    import minidist

    results = minidist.run(_minidist_rank, job.WORKERS, inputs_path, variant, backend="gloo",
                           timeout=timeout)
    return results[0]


def run_single(inputs_path: str, variant: str) -> tuple[list, dict]:
    """One torch process on the whole global batch: (losses per step, final weights)."""
    inputs = job.load_inputs(inputs_path)
    steps, lr = job.VARIANTS[variant]["steps"], job.VARIANTS[variant]["lr"]
    model = mlp(inputs)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for t in range(steps):
        x, y = job.global_batch(inputs, t)
        opt.zero_grad()
        loss = F.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, weights(model)


if __name__ == "__main__":
    args = job.parse_args(extra=[(("--single",), {"action": "store_true",
                                                  "help": "one process instead of minidist's DDP"})])
    losses, w = (run_single if args.single else run_minidist)(args.inputs, args.variant)
    job.save_result(args.out, losses, w)
