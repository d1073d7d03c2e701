"""State of a :func:`~.fsdp.fully_shard` model: full and sharded checkpoints, global-norm clipping.

* :func:`full_state_dict` — every unit's flat shard all-gathered and cut back into the original
  parameters, named as in the unsharded model (tied parameters under each of their names), plus
  the buffers and unsharded (frozen) parameters; on every rank or only on rank 0 (FSDP paper,
  Zhao et al. 2023, §4.1 "state dict": full vs sharded). :func:`load_full_state_dict` takes such
  a dict at *any* world size and keeps this rank's slices.
* :func:`full_optim_state_dict` / :func:`load_full_optim_state_dict` — the same for an optimizer
  built on the shards, keyed by parameter name (so it reloads at another world size).
* :func:`save_sharded` / :func:`load_sharded` — one file per rank with its slices only, as a new
  generation of a checkpoint folder (:mod:`.checkpoint`); reloads at the same world size only
  (else ``ValueError``).
* :func:`clip_grad_norm_` — the global L2 norm of all gradients is sqrt(all-reduce of every
  rank's sum of squares of its slices) (the zero padding adds nothing); every rank scales its
  slices by ``min(1, max_norm / (norm + 1e-6))``, as ``torch.nn.utils.clip_grad_norm_``.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from .fsdp import units

__all__ = ["full_state_dict", "load_full_state_dict", "full_optim_state_dict",
           "load_full_optim_state_dict", "save_sharded", "load_sharded", "clip_grad_norm_"]


def _prefix(module: nn.Module) -> dict:
    return {id(m): (n + "." if n else "") for n, m in module.named_modules(remove_duplicate=False)}


def _unit_entries(module: nn.Module):
    """(unit, [(qualified name, index into the unit's parameters)])."""
    prefix = _prefix(module)
    for u in units(module):
        if u.layout is not None:
            yield u, [(prefix[id(u.module)] + fq, i) for _, _, i, fq in u.slots]


def _gather_flat(u, shard: torch.Tensor) -> list[torch.Tensor]:
    full = torch.empty(u.layout.padded, dtype=shard.dtype, device=shard.device)
    u.comm.all_gather(full, shard.detach())
    return [v.clone() for v in u.layout.views(full)]


def full_state_dict(module: nn.Module, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """The unsharded ``state_dict`` (fp32 masters). Collective. ``rank0_only``: others get {}."""
    out = {}
    for u, entries in _unit_entries(module):
        views = _gather_flat(u, u.flat_shard)
        for name, i in entries:
            out[name] = views[i]
    for name, t in module.state_dict().items():
        if not name.endswith("flat_shard"):
            out[name] = t.detach().clone()
    rank = next((u.rank for u in units(module)), 0)
    return {} if rank0_only and rank != 0 else out


def load_full_state_dict(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load an unsharded state dict (from any world size); no communication."""
    with torch.no_grad():
        for u, entries in _unit_entries(module):
            first = {}
            for name, i in entries:
                first.setdefault(i, state[name])
            flat = u.layout.pack([first[i] for i in range(len(first))],
                                 dtype=u.flat_shard.dtype)
            u.flat_shard.copy_(u.layout.shard(flat))
        rest = {k: v for k, v in state.items() if k in module.state_dict()
                and not k.endswith("flat_shard")}
        for name, t in module.state_dict().items():
            if name in rest:
                t.copy_(rest[name])


def full_optim_state_dict(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """``{"state": {param name: {key: tensor}}, "param_groups": [...]}`` unsharded. Collective."""
    state = {}
    for u, entries in _unit_entries(module):
        own = optimizer.state.get(u.flat_shard, {})
        for key in sorted(own):
            val = own[key]
            if torch.is_tensor(val) and val.shape == u.flat_shard.shape:
                views = _gather_flat(u, val)
                for name, i in entries:
                    state.setdefault(name, {})[key] = views[i]
            else:
                for name, _ in entries:
                    state.setdefault(name, {})[key] = val.clone() if torch.is_tensor(val) else val
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return {"state": state, "param_groups": groups}


def load_full_optim_state_dict(module: nn.Module, optimizer: torch.optim.Optimizer,
                               osd: dict) -> None:
    """Load :func:`full_optim_state_dict`'s output (from any world size) into ``optimizer``."""
    for mine, saved in zip(optimizer.param_groups, osd["param_groups"]):
        mine.update(saved)
    for u, entries in _unit_entries(module):
        per = {}
        for name, i in entries:
            per.setdefault(i, osd["state"].get(name, {}))
        per = [per[i] for i in range(len(per))]
        new = {}
        for key in sorted(set().union(*per)):
            vals = [s.get(key) for s in per]
            if key != "step" and torch.is_tensor(vals[0]) and vals[0].dim() > 0:
                new[key] = u.layout.shard(u.layout.pack(vals, dtype=vals[0].dtype)).clone()
            else:
                new[key] = vals[0].clone() if torch.is_tensor(vals[0]) else vals[0]
        if new:
            optimizer.state[u.flat_shard] = new


def save_sharded(module: nn.Module, prefix: str, optimizer=None) -> str:
    """Write this rank's slices (and optimizer state) as a new generation of the checkpoint
    folder ``prefix`` (:func:`~.checkpoint.save_sharded_checkpoint`: the previous one survives a
    crash or a full disk); collective. Returns this rank's file."""
    from .checkpoint import save_sharded_checkpoint, shard_name
    folder = save_sharded_checkpoint(prefix, module, optimizer)
    return os.path.join(folder, shard_name(units(module)[0].rank))


def load_sharded(module: nn.Module, prefix: str, optimizer=None) -> None:
    """Read this rank's part of the newest generation of ``prefix``; collective. Raises
    ``ValueError`` if saved at another world size (or truncated, corrupted, another shape)."""
    from .checkpoint import load_sharded_checkpoint
    load_sharded_checkpoint(prefix, module, optimizer)


@torch.no_grad()
def clip_grad_norm_(module: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip by the global norm across shards; returns the norm (fp32 scalar). Collective."""
    us = [u for u in units(module) if u.layout is not None]
    sq = torch.zeros(1, dtype=torch.float32, device=us[0].flat_shard.device)
    for u in us:
        if u.flat_shard.grad is not None:
            sq += u.flat_shard.grad.float().pow(2).sum()
    us[0].comm.all_reduce(sq, "sum")
    norm = sq.sqrt()[0]
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for u in us:
        if u.flat_shard.grad is not None:
            u.flat_shard.grad.mul_(coef.to(u.flat_shard.grad.dtype))
    return norm
