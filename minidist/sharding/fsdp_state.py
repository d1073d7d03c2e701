"""State of a :func:`~.fsdp.fully_shard` model: full state dicts and optimizer state dicts (names of
the unsharded model, any world size; Zhao et al. 2023, §4.1), and :func:`clip_grad_norm_`, the
global p-norm reduced over the *shard* group (replicated units' norm added once). Both layouts
and replicated units are handled; per-rank files: :mod:`minidist.sharding.checkpoints`.
Design notes: docs/design/sharding.md
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .fsdp import units
from .replicate import replicated_units

__all__ = ["full_state_dict", "load_full_state_dict", "full_optim_state_dict",
           "load_full_optim_state_dict", "clip_grad_norm_", "full_gradients",
           "check_covered"]


def _prefix(module: nn.Module) -> dict:
    return {id(m): (n + "." if n else "") for n, m in module.named_modules(remove_duplicate=False)}


def _per_param(u) -> bool:
    return u.layout is not None and u.layout.per_parameter


def _unit_entries(module: nn.Module, per_param: bool):
    """(unit, [(qualified name, index into the unit's parameters)]) for one kind of unit."""
    prefix = _prefix(module)
    for u in units(module):
        if u.layout is not None and _per_param(u) == per_param:
            yield u, [(prefix[id(u.module)] + fq, i) for _, _, i, fq in u.slots]


def check_covered(module: nn.Module, what: str) -> list:
    """The units of ``module``; ``ValueError`` naming every module with trainable parameters no unit owns."""
    us = units(module)
    reps = replicated_units(module)
    owned: set[int] = {id(p) for r in reps for p in r.params}
    for u in us:
        owned.update(id(p) for p in u.params)
        owned.update(id(p) for _, p in u.frozen)
        if u.flat_shard is not None:
            owned.add(id(u.flat_shard))
    outside = [n for n, p in module.named_parameters() if id(p) not in owned and p.requires_grad]
    if outside or not (us or reps):
        mods = sorted({n.rpartition(".")[0] or "<root>" for n in outside})
        raise ValueError(f"{what}: parameters {', '.join(outside) or '(none)'} of modules "
                         f"{', '.join(mods) or '(none)'} belong to no fully_shard unit"
                         + (" (the model has no unit at all)" if not (us or reps) else "")
                         + " and to no replicate unit; their gradients would never be averaged "
                           "and they would be left out. Call fully_shard(model) on the root "
                           "after its blocks (the root owns what no unit below it owns), or "
                           "replicate(module) on those that should stay whole")
    return us


def _gather_flat(u, shard: torch.Tensor) -> list[torch.Tensor]:
    full = torch.empty(u.layout.padded, dtype=shard.dtype, device=shard.device)
    u.comm.all_gather(full, shard.detach())
    return [v.clone() for v in u.layout.views(full)]


def _gather_param(u, i: int, shard: torch.Tensor) -> torch.Tensor:
    """Parameter ``i`` of a per-parameter unit: every rank's [c, *rest] rows → [d0, *rest]."""
    shape, c = u.layout.shapes[i], u.layout.rows[i]
    full = torch.empty((u.world_size * c,) + shape[1:], dtype=shard.dtype, device=shard.device)
    if full.numel():
        u.comm.all_gather(full.view(-1), shard.detach().reshape(-1))
    return full[:shape[0]].clone()


def _rows_of(u, i: int, full: torch.Tensor, dtype=None) -> torch.Tensor:
    """This rank's padded [c, *rest] rows of a full parameter-shaped tensor."""
    c = u.layout.rows[i]
    rows = torch.zeros((u.world_size * c,) + tuple(full.shape[1:]),
                       dtype=dtype or full.dtype, device=full.device)
    rows[:full.shape[0]].copy_(full)
    return rows[u.rank * c:(u.rank + 1) * c].clone()


def full_state_dict(module: nn.Module, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """The unsharded ``state_dict`` (fp32 masters). Collective. ``rank0_only``: the others get {}.
    Raises ``ValueError`` naming modules whose trainable parameters belong to no unit."""
    check_covered(module, "full_state_dict")
    out = {name: t.detach().clone() for name, t in module.state_dict().items()
           if not name.endswith("flat_shard")}
    for u, entries in _unit_entries(module, per_param=False):
        views = _gather_flat(u, u.flat_shard)
        for name, i in entries:
            out[name] = views[i]
    for u, entries in _unit_entries(module, per_param=True):
        full = [_gather_param(u, i, p) for i, p in enumerate(u.params)]
        for name, i in entries:
            out[name] = full[i]
    return {} if rank0_only and not _first(module) else out


def _first(module: nn.Module) -> bool:
    """Rank 0 of the data-parallel group the model is sharded over (of both groups under HSDP:
    one rank per model, as before per pipeline stage of a grid)."""
    for u in units(module):
        rep = u.rep
        return u.rank == 0 and (rep is None or rep.rank == 0)
    for r in replicated_units(module):
        return all(c.rank == 0 for c in r.comms)
    return True


def _rank(module: nn.Module) -> int:
    """This rank's global rank (0 outside a process group)."""
    return dist.get_rank() if dist.is_initialized() else 0


def _replicated_entries(module: nn.Module):
    """(qualified name, parameter) of every replicated unit's parameters."""
    prefix = _prefix(module)
    for r in replicated_units(module):
        for n, p in zip(r.names, r.params):
            yield prefix[id(r.module)] + n, p


def full_gradients(module: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded gradients of a per-parameter model, by name (for checks). Collective;
    ``ValueError`` for flat units."""
    if any(u.layout is not None and not _per_param(u) for u in units(module)):
        raise ValueError("full_gradients: per-parameter units only (fully_shard's default)")
    out = {}
    for u, entries in _unit_entries(module, per_param=True):
        for name, i in entries:
            if u.params[i].grad is not None:
                out[name] = _gather_param(u, i, u.params[i].grad)
    for name, p in _replicated_entries(module):
        if p.grad is not None:
            out[name] = p.grad.detach().clone()
    return out


def load_full_state_dict(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load an unsharded state dict (from any world size); no communication."""
    with torch.no_grad():
        done = set()
        for u, entries in _unit_entries(module, per_param=False):
            first: dict = {}
            for name, i in entries:
                first.setdefault(i, state[name])
                done.add(name)
            flat = u.layout.pack([first[i] for i in range(len(first))],
                                 dtype=u.flat_shard.dtype)
            u.flat_shard.copy_(u.layout.shard(flat))
        for u, entries in _unit_entries(module, per_param=True):
            for name, i in entries:
                u.params[i].copy_(_rows_of(u, i, state[name]))
                done.add(name)
        for name, t in module.state_dict().items():
            if name in state and name not in done and not name.endswith("flat_shard"):
                t.copy_(state[name])


def full_optim_state_dict(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """``{"state": {param name: {key: tensor}}, "param_groups": [...]}`` unsharded. Collective."""
    state: dict = {}
    for u, entries in _unit_entries(module, per_param=False):
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
    for u, entries in _unit_entries(module, per_param=True):
        # every rank must make the same all-gathers: a state every rank has (same keys)
        for i, p in enumerate(u.params):
            own = optimizer.state.get(p, {})
            for key in sorted(own):
                val = own[key]
                if torch.is_tensor(val) and val.shape == p.shape and val.dim() > 0:
                    val = _gather_param(u, i, val)
                else:
                    val = val.clone() if torch.is_tensor(val) else val
                for name, j in entries:
                    if j == i:
                        state.setdefault(name, {})[key] = val
    for name, p in _replicated_entries(module):
        for key, val in optimizer.state.get(p, {}).items():
            state.setdefault(name, {})[key] = val.clone() if torch.is_tensor(val) else val
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return {"state": state, "param_groups": groups}


def load_full_optim_state_dict(module: nn.Module, optimizer: torch.optim.Optimizer,
                               osd: dict) -> None:
    """Load :func:`full_optim_state_dict`'s output (from any world size) into ``optimizer``."""
    for mine, saved in zip(optimizer.param_groups, osd["param_groups"]):
        mine.update(saved)
    for u, entries in _unit_entries(module, per_param=False):
        by_index: dict = {}
        for name, i in entries:
            by_index.setdefault(i, osd["state"].get(name, {}))
        per = [by_index[i] for i in range(len(by_index))]
        new = {}
        for key in sorted(set().union(*per)):
            vals = [s.get(key) for s in per]
            if key != "step" and torch.is_tensor(vals[0]) and vals[0].dim() > 0:
                new[key] = u.layout.shard(u.layout.pack(vals, dtype=vals[0].dtype)).clone()
            else:
                new[key] = vals[0].clone() if torch.is_tensor(vals[0]) else vals[0]
        if new:
            optimizer.state[u.flat_shard] = new
    for u, entries in _unit_entries(module, per_param=True):
        for name, i in entries:
            saved = osd["state"].get(name)
            if not saved:
                continue
            new = {}
            for key, val in saved.items():
                if torch.is_tensor(val) and val.dim() > 0 and tuple(val.shape) == u.layout.shapes[i]:
                    new[key] = _rows_of(u, i, val)
                else:
                    new[key] = val.clone() if torch.is_tensor(val) else val
            optimizer.state[u.params[i]] = new
    for name, p in _replicated_entries(module):
        saved = osd["state"].get(name)
        if saved:
            optimizer.state[p] = {k: v.clone() if torch.is_tensor(v) else v
                                  for k, v in saved.items()}


@torch.no_grad()
def clip_grad_norm_(module: nn.Module, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Clip by the global ``norm_type`` norm across shards (as ``torch.nn.utils.clip_grad_norm_``);
    returns the norm (fp32 scalar). Collective. ``ValueError`` if a parameter belongs to no unit,
    ``RuntimeError`` for a non-finite norm with ``error_if_nonfinite``."""
    us = [u for u in check_covered(module, "clip_grad_norm_") if u.layout is not None]
    whole = [q.grad for _, q in _replicated_entries(module) if q.grad is not None]
    p = float(norm_type)
    if not us and not whole:
        return torch.zeros(())
    grads = []
    for u in us:
        if _per_param(u):
            grads += [q.grad for q in u.params if q.grad is not None]
        elif u.flat_shard.grad is not None:
            grads.append(u.flat_shard.grad)
    device = (grads + whole)[0].device if grads + whole else torch.device("cpu")
    if p == float("inf"):
        local = torch.zeros(1, dtype=torch.float32, device=device)
        for g in grads:
            if g.numel():
                local = torch.maximum(local, g.detach().abs().max().float().view(1))
        if us:
            every = torch.empty(us[0].world_size, dtype=torch.float32, device=device)
            us[0].comm.all_gather(every, local)
            local = every.max().view(1)
        for g in whole:                   # equal on every rank: after the reduction
            if g.numel():
                local = torch.maximum(local, g.detach().abs().max().float().view(1))
        norm = local[0]
    else:
        sq = torch.zeros(1, dtype=torch.float32, device=device)
        for g in grads:
            sq += g.detach().float().abs().pow(p).sum()
        if us:
            us[0].comm.all_reduce(sq, "sum")     # the shard group: each piece once
        for g in whole:                   # equal on every rank: once, after the reduction
            sq += g.detach().float().abs().pow(p).sum()
        norm = sq.pow(1.0 / p)[0]
    if error_if_nonfinite and not torch.isfinite(norm):
        raise RuntimeError(f"clip_grad_norm_ (rank {_rank(module)}): the total norm of order {p} "
                           "is non-finite; pass error_if_nonfinite=False to clip anyway")
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads + whole:
        g.mul_(coef.to(g.dtype))
    return norm
