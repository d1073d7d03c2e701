"""ZeRO-3 / fully sharded data parallelism: :func:`fully_shard` (Zhao et al. 2023, §3.2; ZeRO §5.3).

Each call makes a module a *unit* (:class:`~.fsdp_unit.ShardUnit`) owning the parameters no unit
below owns, in a per-parameter (FSDP2, :mod:`.fsdp_param`) or flat (FSDP1, :mod:`.fsdp_flat`)
layout. Per step: all-gather before forward (next unit prefetched) and again before backward, free
after each, reduce-scatter each complete gradient: 1.5x DP's traffic (ZeRO §7.2.2). HSDP: :mod:`.hsdp`.
Design notes: docs/design/sharding.md
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from ..communicator import Communicator
from . import hsdp
from .fsdp_flat import FlatLayout
from .fsdp_param import ParamLayout
from .fsdp_unit import ShardUnit, _Context
from .mixed_precision import MixedPrecisionPolicy
from .replicate import replicated_units

__all__ = ["fully_shard", "MixedPrecisionPolicy", "ShardUnit", "units", "close_units",
           "set_requires_gradient_sync", "set_requires_all_reduce", "set_gradient_divide_factor"]


def units(module: nn.Module) -> list[ShardUnit]:
    """Every unit in ``module`` (itself included), parents after children."""
    return [m._fsdp for m in module.modules() if getattr(m, "_fsdp", None) is not None][::-1]


def close_units(module: nn.Module) -> None:
    """Stop the units' communication thread and destroy their process-group copies. Idempotent,
    local; call before the grid's ``close()``. A later forward/backward raises ``RuntimeError``."""
    shared = (u.ctx for u in units(module))   # units under one root share one
    for ctx in {id(c): c for c in shared if c is not None}.values():
        ctx.close()


def set_requires_gradient_sync(module: nn.Module, sync: bool) -> None:
    """``False``: backward accumulates full gradients locally (DDP's ``no_sync``); the next
    backward with ``True`` reduces the sum."""
    for u in units(module) + replicated_units(module):
        u.sync = sync


def set_gradient_divide_factor(module: nn.Module, factor: float) -> None:
    """The units of ``module`` divide their reduce-scattered gradient sum by ``factor`` instead of
    their group's size (FSDP2's ``set_gradient_divide_factor``; torchtitan sets it on experts
    sharded over their expert-DP mesh, whose all-to-all already summed the EP ranks')."""
    for u in units(module):
        u.divide_factor = float(factor)


def set_requires_all_reduce(module: nn.Module, flag: bool) -> None:
    """HSDP (as FSDP2's): ``False`` reduce-scatters in the shard group but skips the replicate
    all-reduce; the next backward with ``True`` all-reduces the kept sum."""
    for u in units(module) + replicated_units(module):
        u.requires_all_reduce = flag


def fully_shard(module: nn.Module, *, group=None, collectives: str = "hand-built",
                auto_wrap: tuple = (), mp_policy: MixedPrecisionPolicy | None = None,
                reshard_after_forward: bool = True, prefetch: bool = True,
                per_parameter: bool = True, algorithm: str = "auto", replicate_group=None,
                mesh=None) -> nn.Module:
    """Shard ``module`` as one unit (its ``auto_wrap`` submodules first) and return it.

    ``group``: the (shard) process group; ``collectives``/``algorithm`` as :class:`Communicator`;
    ``per_parameter``: dim-0 shards (FSDP2) or one flat shard (FSDP1). HSDP: ``replicate_group``
    or ``mesh`` (:class:`~.hsdp.HSDPMesh`, a (replicate, shard) pair or a 2-D ``DeviceMesh``).
    Syncs parameters from rank 0. Raises ``ValueError`` for a module sharded twice or replicated,
    a parameter tied across units, (per parameter) a 0-d parameter or mixed dtypes without
    ``mp_policy.param_dtype``; for HSDP, a misfit replicate group, a flat layout, or units below
    with another replicate group."""
    if getattr(module, "_fsdp", None) is not None:
        raise ValueError(f"fully_shard: {type(module).__name__} is already a unit")
    if getattr(module, "_replicate", None) is not None:
        raise ValueError(f"fully_shard: {type(module).__name__} is already replicated "
                         "(replicate(...)); a module is either sharded or replicated")
    group, replicate_group = hsdp.resolve(mesh, group, replicate_group)
    if replicate_group is not None and dist.get_world_size(replicate_group) == 1:
        replicate_group = None          # R = 1: plain FSDP over the shard group
    if replicate_group is not None:
        if not per_parameter:
            raise ValueError(f"fully_shard (rank {dist.get_rank()}): HSDP (replicate_group / a "
                             "2-D mesh) needs per_parameter=True; the flat layout is FSDP1's "
                             "teaching design and has no replicate dimension here")
        hsdp.check_layout("fully_shard", group, replicate_group, collectives)
    opts = dict(group=group, collectives=collectives, mp_policy=mp_policy,
                reshard_after_forward=reshard_after_forward, prefetch=prefetch,
                per_parameter=per_parameter, algorithm=algorithm,
                replicate_group=replicate_group)
    if auto_wrap:
        for sub in list(module.modules())[1:][::-1]:
            if isinstance(sub, tuple(auto_wrap)) and getattr(sub, "_fsdp", None) is None:
                fully_shard(sub, **opts)
    comm = Communicator(collectives, group, where="sharding", algorithm=algorithm)
    rep = (None if replicate_group is None else
           Communicator(collectives, replicate_group, where="sharding", algorithm=algorithm))
    below = units(module)
    mine = hsdp.replicate_ranks(rep)
    other = [u for u in below if hsdp.replicate_ranks(u.rep) != mine]
    if other:
        raise ValueError(f"fully_shard (rank {comm.rank}): units "
                         f"{[u.unit_name() for u in other]} below {type(module).__name__} "
                         f"replicate over {hsdp.replicate_ranks(other[0].rep)}, "
                         f"this one over {mine}; every unit under one root shares its replicate "
                         "group (None: plain FSDP)")
    unit = ShardUnit(module, comm, mp_policy or MixedPrecisionPolicy(), reshard_after_forward,
                     prefetch, ParamLayout if per_parameter else FlatLayout, rep=rep)
    module._fsdp = unit
    module.register_forward_pre_hook(unit.pre_forward, with_kwargs=True)
    module.register_forward_hook(unit.post_forward)
    below = [unit] + below
    ctx = _Context(unit.comm, rep)   # the newest outer unit's context is the shared one
    ctx.other_comms = [u.comm for u in below if u.comm.group is not unit.comm.group]
    for u in below:
        if u.ctx is not None:
            u.ctx.close()
        u.ctx = ctx
    return module
