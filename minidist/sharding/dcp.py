"""ZeRO-3 through torch's ``torch.distributed.checkpoint`` (DCP), in FSDP2's layout: a dim-0 shard
is a DTensor with placement ``Shard(0)`` (``DTensor.from_local``, no copy), so DCP saves and loads
at any world size. Flat units are refused (``TypeError``).
Design notes: docs/design/sharding.md
"""

from __future__ import annotations

import os

import torch
from torch import nn

from .fsdp import units
from .fsdp_param import ParamLayout
from .fsdp_state import _prefix, check_covered

__all__ = ["dcp_state_dict", "save_dcp", "load_dcp"]


def _mesh(group):
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    import torch.distributed as dist
    device = "cuda" if torch.cuda.is_available() and dist.get_backend(group) == "nccl" else "cpu"
    if group is None:
        return init_device_mesh(device, (dist.get_world_size(),))
    return DeviceMesh.from_group(group, device)


def _sharded(u, i: int, p: torch.Tensor, mesh) -> torch.Tensor:
    """``p`` (rank r's [c, *rest] shard of parameter i) as a DTensor of the full shape."""
    from torch.distributed.tensor import DTensor, Shard
    shape = u.layout.shapes[i]
    c = u.layout.rows[i]
    real = max(0, min(c, shape[0] - u.rank * c))
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(p.detach()[:real], mesh, [Shard(0)], run_check=False, shape=torch.Size(shape),
                              stride=stride)


def _init_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state with a step of zero gradients at lr 0 (what torch's
    ``_init_optim_state`` does before loading into an optimizer that has not stepped)."""
    if optimizer.state:
        return
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr
    for p in params:
        p.grad = None


def dcp_state_dict(module: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                   group=None) -> dict:
    """The DCP view of a per-parameter ZeRO-3 ``module`` (and ``optimizer`` on its shards).
    ``TypeError`` for flat units, ``NotImplementedError`` for HSDP, ``ValueError`` for unowned parameters."""
    us = check_covered(module, "dcp_state_dict")
    hybrid = [type(u.module).__name__ for u in us if u.rep is not None]
    if hybrid:   # FSDP2 describes them on a 2-D mesh, (Replicate(), Shard(0)): not written yet
        raise NotImplementedError(f"dcp_state_dict: units {hybrid} are HSDP (replicate_group / "
                                  "a 2-D mesh); their DCP layout is not written yet: export "
                                  "fsdp_state.full_state_dict / full_optim_state_dict instead")
    flat = [type(u.module).__name__ for u in us if u.layout is not None and not u.layout.per_parameter]
    if flat:
        raise TypeError(f"dcp_state_dict: units {flat} use the flat layout (per_parameter=False), "
                        "which has no dim-0 shard per parameter; use fully_shard's default "
                        "per-parameter layout, or export fsdp_state.full_state_dict")
    mesh = _mesh(group)
    prefix = _prefix(module)
    model: dict = {}
    names_of: dict = {}
    for u in us:
        if u.layout is None:
            continue
        for _, _, i, fq in u.slots:
            name = prefix[id(u.module)] + fq
            model[name] = _sharded(u, i, u.params[i], mesh)
            names_of.setdefault(id(u.params[i]), (name, u, i))
    for name, t in module.state_dict().items():       # buffers, and parameters of no unit
        if name not in model:
            model[name] = t
    out: dict = {"model": model}
    if optimizer is not None:
        _init_state(optimizer)
        state, groups = {}, []
        for g in optimizer.param_groups:
            names = []
            for p in g["params"]:
                if id(p) not in names_of:
                    raise ValueError("dcp_state_dict: the optimizer holds a parameter that is not "
                                     "a ZeRO-3 shard of this module")
                name, u, i = names_of[id(p)]
                names.append(name)
                state[name] = {k: (_sharded(u, i, v, mesh) if torch.is_tensor(v) and
                                   v.shape == p.shape and v.dim() > 0 else v)
                               for k, v in optimizer.state.get(p, {}).items()}
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": names})
        out["optimizer"] = {"state": state, "param_groups": groups}
    return out


def save_dcp(path: str | os.PathLike, module: nn.Module, optimizer=None, group=None) -> None:
    """``dcp.save`` this rank's shards (and the optimizer's) to ``path``; collective. FSDP2 loads
    it with ``dcp.load`` into ``get_model_state_dict`` / ``get_optimizer_state_dict``."""
    import torch.distributed.checkpoint as dcp
    dcp.save(dcp_state_dict(module, optimizer, group), checkpoint_id=os.fspath(path))


@torch.no_grad()
def load_dcp(path: str | os.PathLike, module: nn.Module, optimizer=None, group=None) -> None:
    """``dcp.load`` a DCP checkpoint (minidist's, FSDP2's, torchtitan's; any world size) into the shards
    in place; collective. DCP's ``CheckpointException`` when a name or shape is missing."""
    import torch.distributed.checkpoint as dcp
    state = dcp_state_dict(module, optimizer, group)
    dcp.load(state, checkpoint_id=os.fspath(path))
    buffers = dict(module.named_buffers())
    for name, t in state["model"].items():            # plain tensors: loaded into copies
        if name in buffers and t is not buffers[name]:
            buffers[name].copy_(t)
    if optimizer is not None:
        for g, saved in zip(optimizer.param_groups, state["optimizer"]["param_groups"]):
            g.update({k: v for k, v in saved.items() if k != "params"})
        for p, name in _params_by_name(optimizer, state).items():
            for k, v in state["optimizer"]["state"][name].items():
                if not hasattr(v, "to_local"):
                    optimizer.state[p][k] = v
    for u in units(module):                           # zero padding rows stay zero
        layout = u.layout
        if isinstance(layout, ParamLayout):
            for i, p in enumerate(u.params):
                c, d0 = layout.rows[i], layout.shapes[i][0]
                real = max(0, min(c, d0 - u.rank * c))
                p[real:].zero_()


def _params_by_name(optimizer, state) -> dict:
    out = {}
    for g, saved in zip(optimizer.param_groups, state["optimizer"]["param_groups"]):
        for p, name in zip(g["params"], saved["params"]):
            out[p] = name
    return out
