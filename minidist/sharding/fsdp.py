"""ZeRO-3 / fully sharded data parallelism: :func:`fully_shard`.

Each call turns one module into a *unit* (Zhao et al. 2023, "PyTorch FSDP", §3.2; Rajbhandari et
al. 2020, ZeRO, §5.3, P_os+g+p) owning every parameter of the module that no unit below it owns
(so ``fully_shard(model)`` after its blocks owns the embedding and head, as FSDP2's root does).
One machinery, two layouts: a unit is a :class:`~.fsdp_unit.ShardUnit` (the hooks below) holding
a layout object that says where each parameter lives (this file holds :func:`fully_shard`):

* **per parameter** (default, :class:`~.fsdp_param.ParamLayout`, FSDP2's design): each
  parameter — trainable or frozen — is cut on dim 0, rank r keeps its [ceil(d0/W), ...] rows as
  the same ``nn.Parameter`` object under its own name, so the optimizer sees one sharded tensor
  per original parameter (param groups by name or ``p.dim()`` work) and ``requires_grad`` can
  change after wrapping; communication goes through one flat buffer per unit;
* **flat** (``per_parameter=False``, :class:`~.fsdp_flat.FlatLayout`, FSDP1's ``FlatParameter``, the
  first design, kept to teach why it was replaced): the unit's *trainable* parameters are packed
  into one flat buffer padded to W·S elements (:class:`~.flat.FlatBuffer`); rank r keeps its [S]
  slice as the parameter ``flat_shard``. Frozen parameters stay unsharded; one that later
  requires a gradient is a ``RuntimeError`` at the next forward naming it.

Per training step:

1. **before the unit's forward** its parameters are all-gathered (in ``param_dtype``) and the
   original parameter names point at the gathered tensors; the next unit's all-gather is
   *prefetched* on the communication thread (order recorded during the first step);
2. **after its forward** the gathered storage is freed (``reshard_after_forward``);
3. **before its backward** (a hook on the unit's outputs) it is all-gathered again into the *same*
   storage, so the tensors autograd saved (views of it) are valid again; the unit that comes next
   in backward is prefetched;
4. **when its gradient is complete** (a post-accumulate-grad hook), it is cast to
   ``reduce_dtype`` and reduce-scattered (average) on the communication thread; each rank keeps
   its slice as the shards' ``.grad`` (master dtype); the gathered storage is freed again.

Per step a rank therefore sends 3·(W-1)/W·Ψ elements (two all-gathers and one reduce-scatter):
1.5x plain data parallelism (ZeRO §7.2.2).

**HSDP** (``mesh=hsdp_mesh(R, S)`` or ``replicate_group=``; :mod:`.hsdp`): the same over a shard
group of S ranks, then step 4's piece is all-reduced (average) across the replicate group.
**Replicated units** (:func:`~.replicate.replicate`) keep their parameters whole; a unit above
leaves them out.

**Synced at construction**: per-parameter units broadcast their parameters (trainable and frozen)
and their modules' buffers from rank 0; flat units broadcast the packed (trainable) parameters
only. **Supports**: tied parameters inside one unit, frozen parameters and ``requires_grad``
changes (per parameter), gradient accumulation (:func:`set_requires_gradient_sync`), mixed
precision (:class:`MixedPrecisionPolicy`; per-parameter units cast frozen weights too, as FSDP2),
recomputation inside units, no_grad/eval forwards. **Refuses** (``ValueError``): a module sharded
twice, a parameter tied across two units, 0-d parameters and mixed dtypes without a policy (per
parameter); :func:`~.fsdp_state.clip_grad_norm_` and :func:`~.fsdp_state.full_state_dict` refuse
a model whose trainable parameters belong to no unit (their gradients are never averaged).
Buffers are not cast by a mixed-precision policy (as FSDP2): an fp32 buffer added to bf16
activations makes them fp32.
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
           "set_requires_gradient_sync", "set_requires_all_reduce"]


def units(module: nn.Module) -> list[ShardUnit]:
    """Every unit in ``module`` (itself included), parents after children."""
    return [m._fsdp for m in module.modules() if getattr(m, "_fsdp", None) is not None][::-1]


def close_units(module: nn.Module) -> None:
    """Stop the communication thread of the units under ``module`` and destroy its process-group
    copies (their gloo threads and sockets; HSDP's replicate copy too). Idempotent; local (no rank
    waits for another). Call after the last step and before the grid's ``close()``: a process that
    builds model after model keeps every one's threads otherwise. A forward or backward afterwards
    raises ``RuntimeError`` (the thread is closed)."""
    shared = (u.ctx for u in units(module))   # units under one root share one
    for ctx in {id(c): c for c in shared if c is not None}.values():
        ctx.close()


def set_requires_gradient_sync(module: nn.Module, sync: bool) -> None:
    """``False``: backward accumulates full gradients locally, without communication (gradient
    accumulation, like DDP's ``no_sync``; under HSDP neither the reduce-scatter nor the all-reduce
    runs, and replicated units, :mod:`.replicate`, do not all-reduce); the next backward with
    ``True`` reduces the sum."""
    for u in units(module) + replicated_units(module):
        u.sync = sync


def set_requires_all_reduce(module: nn.Module, flag: bool) -> None:
    """HSDP (FSDP2's method of the same name): ``False`` still reduce-scatters each backward
    inside the shard group (gradient memory stays 1/S) but keeps the pieces instead of
    all-reducing them across the replicate group; the next backward with ``True`` all-reduces
    the sum of every kept piece and its own. Replicated units (:mod:`.replicate`), whose only
    reduction is the all-reduce, accumulate locally meanwhile."""
    for u in units(module) + replicated_units(module):
        u.requires_all_reduce = flag


def fully_shard(module: nn.Module, *, group=None, collectives: str = "hand-built",
                auto_wrap: tuple = (), mp_policy: MixedPrecisionPolicy | None = None,
                reshard_after_forward: bool = True, prefetch: bool = True,
                per_parameter: bool = True, algorithm: str = "auto", replicate_group=None,
                mesh=None) -> nn.Module:
    """Shard ``module`` as one unit (after sharding its submodules of the classes in
    ``auto_wrap`` as units of their own) and return it. Call on children first, then the root.

    Args: ``group`` (data-parallel process group, e.g. ``ProcessGrid.dp_group``), ``collectives``
    (``"hand-built"`` or ``"torch"``), ``algorithm`` (hand-built: ``"auto"``, the tuner's choice per
    call, or a fixed name such as ``"ring"``), ``mp_policy`` (:class:`MixedPrecisionPolicy`),
    ``reshard_after_forward`` (free after forward; False keeps it gathered until backward),
    ``prefetch`` (all-gather the next unit on the comm thread), ``per_parameter`` (True: dim-0
    shards per parameter, FSDP2; False: one flat shard per unit, FSDP1 — see the module doc).

    HSDP (:mod:`.hsdp`): ``replicate_group`` (with ``group`` the shard group), or ``mesh`` — an
    :class:`~.hsdp.HSDPMesh` from ``hsdp_mesh(R, S)``, a ``(replicate, shard)`` pair of groups,
    or torch's 2-D ``DeviceMesh`` (dims replicate, shard, as FSDP2's) — shards over the shard
    group and all-reduces each reduce-scattered gradient piece over the replicate group.
    Per-parameter units only; every unit under one root has the same replicate group.

    Syncs parameters (and, per parameter, frozen ones and buffers) from rank 0. Raises
    ``ValueError`` for a module sharded twice or already replicated (:func:`~.replicate.replicate`),
    a parameter tied across two units, and (per parameter) a 0-d parameter or mixed dtypes
    without ``mp_policy.param_dtype``; for HSDP, a replicate group that does not fit the shard
    groups (:func:`~.hsdp.check_layout`: on every rank of it), a flat layout, or units below with
    another replicate group.
    """
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
    for u in below:
        if u.ctx is not None:
            u.ctx.close()
        u.ctx = ctx
    return module
