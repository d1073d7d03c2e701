"""Full (single-process) state dict <-> a tensor-parallel model's shards.

``model.load_state_dict(shard_state_dict(full_sd, model))`` loads a single-process checkpoint;
``gather_state_dict(model)`` (collective) rebuilds the full state dict (or gradients) on every rank.
Design notes: docs/design/tensor_parallel.md
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
    """This rank's slice along ``dim`` of ``full`` zero-padded to ``padded``.
    ``ValueError`` naming the rank if ``full`` is larger."""
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
    """The state dict ``model`` loads on this rank; ``KeyError`` naming missing keys."""
    meta, local = _meta(model), model.state_dict()
    missing = sorted(set(local) - set(full_sd))
    if missing:
        raise KeyError(f"shard_state_dict: the full state dict lacks {missing}")
    return {k: shard_tensor(full_sd[k], meta.get(k, (None, None))[0], v.shape, group)
            for k, v in local.items()}


def gather_state_dict(model, group=None, grads: bool = False) -> dict:
    """The full, unpadded parameters (or gradients with ``grads=True``) on every rank (collective)."""
    if grads:
        items = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    else:
        items = dict(model.state_dict())
    return gather_tensors(model, items, group)


def gather_tensors(model, tensors: dict, group=None) -> dict:
    """``{name: this rank's shard}`` -> the full, unpadded tensors (collective)."""
    out = {}
    meta = _meta(model)
    for name, t in tensors.items():
        dim, full_size = meta.get(name, (None, None))
        out[name] = gather_tensor(t, dim, full_size, group)
    return out


def parameter_bytes(model) -> int:
    """Bytes of parameters this rank holds (its shards plus the replicated ones)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
