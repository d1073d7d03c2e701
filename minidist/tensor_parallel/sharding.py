"""Move between a full (single-process) state dict and a tensor-parallel model's shards.

Every TP layer marks its parameters (see :func:`minidist.tensor_parallel.layers.mark_parameter`)
with ``partition_dim`` and ``full_size``; a parameter without them is replicated. Parameter names
of the TP models in minidist equal those of their single-process reference, so

* ``model.load_state_dict(shard_state_dict(full_sd, model))`` loads a checkpoint of the
  single-process model into a TP model (pads, then keeps this rank's slice), and
* ``gather_state_dict(model)`` (a collective: every rank of the group must call it) rebuilds the
  full, unpadded state dict on every rank — or the full gradients with ``grads=True``, which is how
  the tests compare each shard's weight gradient with the single-process one.
"""

from __future__ import annotations

import torch

from ..comm.p2p import group_rank_world
from .. import collectives as C
from . import regions as R

__all__ = ["pad_and_split", "shard_tensor", "gather_tensor", "shard_state_dict", "gather_state_dict", "gather_tensors",
           "parameter_bytes"]


def _meta(model) -> dict:
    return {name: (getattr(p, "partition_dim", None), getattr(p, "full_size", None))
            for name, p in model.named_parameters(remove_duplicate=False)}  # tied: every name


def pad_and_split(full: torch.Tensor, dim: int, padded: int, group=None,
                  what: str = "shard") -> torch.Tensor:
    """This rank's slice along ``dim`` of ``full`` zero-padded to ``padded`` (a multiple of the TP
    size) along ``dim``: the one way a full weight becomes a shard (layers at construction,
    checkpoints at load). ``ValueError`` naming the rank if ``full`` is larger than ``padded``."""
    rank, world = group_rank_world(group)
    if full.shape[dim] > padded:
        raise ValueError(f"{what} (rank {rank}): full size {full.shape[dim]} along dim {dim} "
                         f"exceeds the padded size {padded} ({world} x {padded // world})")
    if full.shape[dim] < padded:
        pad = list(full.shape)
        pad[dim] = padded - full.shape[dim]
        full = torch.cat([full, full.new_zeros(pad)], dim=dim)
    return R.split_along(full, dim, group, what).clone()


def shard_tensor(full: torch.Tensor, partition_dim, local_shape, group=None) -> torch.Tensor:
    """This rank's shard of ``full`` (padded with zeros to W x the local size along the dim)."""
    if partition_dim is None:
        return full.clone()
    _, world = group_rank_world(group)
    return pad_and_split(full, partition_dim, local_shape[partition_dim] * world, group,
                         "shard_tensor")


def gather_tensor(shard: torch.Tensor, partition_dim, full_size=None, group=None) -> torch.Tensor:
    """All-gather the shards along ``partition_dim`` and drop the padding (collective)."""
    _, world = group_rank_world(group)
    if partition_dim is None or world == 1:
        full = shard.detach().clone()
    else:
        shard = shard.detach().contiguous()
        pieces = [torch.empty_like(shard) for _ in range(world)]
        C.all_gather(pieces, shard, group=group)
        full = torch.cat(pieces, dim=partition_dim)
    if partition_dim is not None and full_size is not None:
        full = full.narrow(partition_dim, 0, full_size)
    return full


def shard_state_dict(full_sd: dict, model, group=None) -> dict:
    """The state dict ``model`` (a TP model) should load on this rank, cut from a full one.

    Raises ``KeyError`` naming missing keys. Buffers are copied as they are.
    """
    meta, local = _meta(model), model.state_dict()
    missing = sorted(set(local) - set(full_sd))
    if missing:
        raise KeyError(f"shard_state_dict: the full state dict lacks {missing}")
    return {k: shard_tensor(full_sd[k], meta.get(k, (None, None))[0], v.shape, group)
            for k, v in local.items()}


def gather_state_dict(model, group=None, grads: bool = False) -> dict:
    """The full, unpadded parameters (or gradients) on every rank. A collective over ``group``.

    With ``grads=True`` parameters without a gradient are left out (the same on every rank, as
    every rank runs the same model).
    """
    if grads:
        items = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    else:
        items = dict(model.state_dict())
    return gather_tensors(model, items, group)


def gather_tensors(model, tensors: dict, group=None) -> dict:
    """``{name: this rank's TP shard}`` of ``model``'s parameters → the full, unpadded tensors (a
    collective over ``group``); e.g. gradients a data-parallel wrapper kept elsewhere."""
    out = {}
    meta = _meta(model)
    for name, t in tensors.items():
        dim, full_size = meta.get(name, (None, None))
        out[name] = gather_tensor(t, dim, full_size, group)
    return out


def parameter_bytes(model) -> int:
    """Bytes of parameters this rank holds (its shards plus the replicated ones)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
