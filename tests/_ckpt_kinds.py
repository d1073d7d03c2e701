"""Every checkpoint kind behind one interface, for the fault-injection tests (test_checkpoint_faults).

``KINDS[name] = (setup, save, load, params)``: ``setup(rank, world, seed)`` builds a tiny model and
optimizer and trains ``steps`` deterministic steps; ``save(path, model, opt)`` and
``load(path, model, opt)`` are the kind's checkpoint functions; ``params(model)`` is what a test
compares (the full model on every rank)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minidist.data_parallel import BucketedDDP
from minidist.data_parallel.checkpoint import load_checkpoint, save_checkpoint
from minidist.models import MLP
from minidist.sharding import ShardedOptimizer, fsdp, fsdp_state
from minidist.sharding.checkpoints import (load_full_checkpoint, load_sharded_checkpoint,
                                          save_full_checkpoint, save_sharded_checkpoint)


def _mlp(seed, width=8):
    torch.manual_seed(seed)
    return MLP(6, (width,), 3)


def _batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)


def _train(model, opt, rank, steps, start=0):
    for step in range(start, start + steps):
        x, y = _batch(step, rank)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


def _trained(model, opt, rank, steps):
    _train(model, opt, rank, steps)
    return model, opt, lambda n, start=steps: _train(model, opt, rank, n, start=start)


def setup_ddp(rank, world, seed, steps, width=8):
    model = BucketedDDP(_mlp(seed, width))
    return _trained(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), rank, steps)


def _zero(stage):
    def setup(rank, world, seed, steps, width=8):
        model = _mlp(seed, width)
        opt = ShardedOptimizer(model.parameters(), torch.optim.Adam, stage=stage,
                               grads="local", lr=0.01)
        return _trained(model, opt, rank, steps)
    return setup


def setup_zero3(rank, world, seed, steps, width=8):
    model = fsdp.fully_shard(_mlp(seed, width))
    return _trained(model, torch.optim.Adam(model.parameters(), lr=0.01), rank, steps)


def setup_hybrid(rank, world, seed, steps, width=8):
    """A pipeline of two stages (grid dp=1, pp=2, tp=1): each rank holds other parameters."""
    from minidist.grid import ProcessGrid
    from minidist.hybrid import HybridGPT, make_optimizer, train_step, wrap_stages
    from minidist.models.gpt import GPTConfig
    cfg = GPTConfig(vocab_size=20, block_size=4, n_layer=2, n_head=2, n_embd=width)
    model = HybridGPT(cfg, ProcessGrid(1, 2, 1), seed=seed)
    modules = wrap_stages(model, "flat")
    opt = make_optimizer(model, "flat", torch.optim.AdamW, lr=1e-2)

    def run(n, start=0):
        for step in range(start, start + n):
            g = torch.Generator().manual_seed(step)
            ids = torch.randint(0, cfg.vocab_size, (2, cfg.block_size), generator=g)
            train_step(model, opt, modules, ids, torch.roll(ids, -1, 1), microbatches=2,
                       dp_mode="flat")
    run(steps)
    return model, opt, lambda n, start=steps: run(n, start)


def _hybrid_params(model):
    return {f"{s}.{k}": v.detach().clone() for s, m in model.stages.items()
            for k, v in m.state_dict().items()}


def _hybrid_save(path, model, opt):
    from minidist.hybrid.checkpoint import save_hybrid_checkpoint
    save_hybrid_checkpoint(path, model, opt, step=1)


def _hybrid_load(path, model, opt):
    from minidist.hybrid.checkpoint import load_hybrid_checkpoint
    load_hybrid_checkpoint(path, model, opt)


def _plain_params(model):
    inner = getattr(model, "module", model)
    return {k: v.detach().clone() for k, v in inner.state_dict().items()}


def _zero3_params(model):
    return fsdp_state.full_state_dict(model)


def _ddp_load(path, model, opt):
    load_checkpoint(path, model, opt)


KINDS = {
    "ddp": (setup_ddp, save_checkpoint, _ddp_load, _plain_params),
    "zero1-full": (_zero(1), save_checkpoint, _ddp_load, _plain_params),
    "zero2-sharded": (_zero(2), save_sharded_checkpoint, load_sharded_checkpoint, _plain_params),
    "zero3-full": (setup_zero3, save_full_checkpoint, load_full_checkpoint, _zero3_params),
    "zero3-sharded": (setup_zero3, save_sharded_checkpoint, load_sharded_checkpoint,
                      _zero3_params),
    "3d": (setup_hybrid, _hybrid_save, _hybrid_load, _hybrid_params),
}
# the rank that writes a file in every kind (DDP and full checkpoints: rank 0 alone)
WRITER = {"ddp": 0, "zero1-full": 0, "zero3-full": 0, "zero2-sharded": 1, "zero3-sharded": 1,
          "3d": 1}


def close(model, opt):
    for obj in (model, opt):
        if hasattr(obj, "close"):
            obj.close()
