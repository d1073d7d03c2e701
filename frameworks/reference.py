"""The references every framework is checked against: minidist's own DDP, and one torch process.

* ``minidist``: :class:`minidist.data_parallel.BucketedDDP` on the hand-built collectives, 2 ranks
  started by :func:`minidist.run`; each rank trains on its contiguous half, the loss is averaged
  with minidist's ring all-reduce.
* ``zero1``/``zero2``/``zero3``: minidist's own ZeRO (:mod:`minidist.sharding`), 2 ranks:
  ``ShardedOptimizer`` stage 1 or 2, or ``fully_shard`` (one unit per Linear, then the root) for
  stage 3 — the references of DeepSpeed's stages and of FSDP2.
* ``single``: one torch process on the whole global batch (no distribution at all).

Both run in the project's venv::

    python frameworks/reference.py --inputs inputs.npz --out minidist.npz --variant short \
        [--single | --zero STAGE]
"""

from __future__ import annotations

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


def _minidist_rank(rank: int, world: int, inputs_path: str, variant: str, stage: int = 0):
    from minidist import collectives
    from minidist.data_parallel import BucketedDDP
    from minidist.sharding import ShardedOptimizer, full_state_dict, fully_shard

    inputs = job.load_inputs(inputs_path)
    steps, lr = job.VARIANTS[variant]["steps"], job.VARIANTS[variant]["lr"]
    model = mlp(inputs)
    if stage == 0:                  # DDP: replicated everything, gradients all-reduced
        ddp = BucketedDDP(model, collectives="hand-built")
        opt = torch.optim.SGD(model.parameters(), lr=lr)
    elif stage in (1, 2):           # ZeRO-1/2: optimizer state (and gradients) sharded
        ddp = model
        opt = ShardedOptimizer(model.parameters(), torch.optim.SGD, stage=stage, grads="local",
                               collectives="hand-built", lr=lr)
    else:                           # ZeRO-3: parameters sharded too
        ddp = fully_shard(model, auto_wrap=(nn.Linear,), collectives="hand-built")
        opt = torch.optim.SGD(ddp.parameters(), lr=lr)
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
    if stage == 3:                  # a collective: every rank gathers the full parameters
        sd = full_state_dict(ddp)
        return losses, {"w1": sd["0.weight"].numpy(), "b1": sd["0.bias"].numpy(),
                        "w2": sd["2.weight"].numpy(), "b2": sd["2.bias"].numpy()}
    return losses, weights(model)


def run_minidist(inputs_path: str, variant: str, stage: int = 0,
                 timeout: float = 180.0) -> tuple[list, dict]:
    """minidist on 2 ranks: ``stage`` 0 = BucketedDDP, 1/2 = ShardedOptimizer, 3 = fully_shard.
    Returns (losses per step, final weights of rank 0)."""
    import minidist

    results = minidist.run(_minidist_rank, job.WORKERS, inputs_path, variant, stage,
                           backend="gloo", timeout=timeout)
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
                                                  "help": "one process instead of minidist's DDP"}),
                                 (("--zero",), {"type": int, "choices": [0, 1, 2, 3], "default": 0,
                                                "help": "minidist's ZeRO stage (0: DDP)"})])
    if args.single:
        losses, w = run_single(args.inputs, args.variant)
    else:
        losses, w = run_minidist(args.inputs, args.variant, args.zero)
    job.save_result(args.out, losses, w)
