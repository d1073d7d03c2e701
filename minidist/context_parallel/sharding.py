"""How a sequence of ``S`` tokens is split over the ``W`` ranks of a context-parallel group.

Splits ``"contiguous"``, ``"zigzag"`` (chunks ``r`` and ``2W-1-r``: balanced causal work, as
Megatron-LM) and ``"striped"`` (Brandon et al. 2023), each as the global positions a rank holds.
Design notes: docs/design/context_parallel.md
"""

from __future__ import annotations

import torch

from .. import collectives as C

__all__ = ["SPLITS", "positions", "chunks", "shard", "unshard", "causal_work", "block_kind",
           "block_table", "computed_work", "agreed_length"]

SPLITS = ("contiguous", "zigzag", "striped")


def _check(split: str, seq_len: int, world: int, rank: int | None = None, op: str = "positions"):
    if split not in SPLITS:
        raise ValueError(f"context_parallel.{op}: split must be one of {SPLITS}, got {split!r}")
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"context_parallel.{op}: world size must be an int >= 1, got {world!r}")
    if not isinstance(seq_len, int) or seq_len < 0:
        raise ValueError(f"context_parallel.{op}: seq_len must be an int >= 0, got {seq_len!r}")
    if rank is not None and not 0 <= rank < world:
        raise ValueError(f"context_parallel.{op}: rank {rank} is not in 0..{world - 1}")


def chunks(split: str, seq_len: int, world: int, rank: int) -> list[torch.Tensor]:
    """Rank ``rank``'s global positions as runs (two for zigzag); empty runs dropped."""
    _check(split, seq_len, world, rank, "chunks")
    everything = torch.arange(seq_len)
    if split == "contiguous":
        runs = [everything.tensor_split(world)[rank]]
    elif split == "zigzag":
        parts = everything.tensor_split(2 * world)
        runs = [parts[rank], parts[2 * world - 1 - rank]]
    else:
        runs = [everything[rank::world]]
    return [r for r in runs if r.numel()]


def positions(split: str, seq_len: int, world: int, rank: int) -> torch.Tensor:
    """Global positions ``[S_r]`` (int64, increasing) held by ``rank`` under ``split``."""
    runs = chunks(split, seq_len, world, rank)
    return torch.cat(runs) if runs else torch.zeros(0, dtype=torch.long)


def shard(x: torch.Tensor, split: str, world: int, rank: int, dim: int = 1) -> torch.Tensor:
    """The slice of ``x`` (sequence along ``dim``) that ``rank`` holds, contiguous."""
    idx = positions(split, x.shape[dim], world, rank).to(x.device)
    return x.index_select(dim, idx).contiguous()


def unshard(parts: list[torch.Tensor], split: str, dim: int = 1) -> torch.Tensor:
    """The inverse of :func:`shard`: the slices of every rank (rank order) back in sequence order."""
    world = len(parts)
    if world == 0:
        raise ValueError("context_parallel.unshard: need the slices of at least one rank")
    seq_len = sum(p.shape[dim] for p in parts)
    shape = list(parts[0].shape)
    shape[dim] = seq_len
    out = parts[0].new_empty(shape)
    for r, p in enumerate(parts):
        idx = positions(split, seq_len, world, r).to(p.device)
        if idx.numel() != p.shape[dim]:
            raise ValueError(f"context_parallel.unshard: rank {r}'s slice has {p.shape[dim]} "
                             f"positions along dim {dim}; the {split} split of {seq_len} over "
                             f"{world} ranks gives it {idx.numel()}")
        out.index_copy_(dim, idx, p)
    return out


def causal_work(split: str, seq_len: int, world: int) -> list[int]:
    """Per rank, the (query, key) pairs a causal mask keeps: ``sum(p + 1)`` over its queries."""
    _check(split, seq_len, world, None, "causal_work")
    return [int((positions(split, seq_len, world, r) + 1).sum()) for r in range(world)]


def block_kind(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool = True) -> str:
    """``"full"``, ``"skipped"`` (none sees any key; also empty blocks) or ``"diagonal"`` (masked)."""
    if q_pos.numel() == 0 or k_pos.numel() == 0:
        return "skipped"
    if not causal or int(k_pos.max()) <= int(q_pos.min()):
        return "full"
    if int(k_pos.min()) > int(q_pos.max()):
        return "skipped"
    return "diagonal"


def block_table(split: str, seq_len: int, world: int, causal: bool = True) -> dict:
    """``{(query rank, key rank): [kind of each (query run, key run) pair]}`` for the group."""
    runs = [chunks(split, seq_len, world, r) for r in range(world)]
    return {(i, j): [block_kind(a, b, causal) for a in runs[i] for b in runs[j]]
            for i in range(world) for j in range(world)}


def computed_work(split: str, seq_len: int, world: int, causal: bool = True) -> list[int]:
    """Per rank, the (query, key) pairs ring attention multiplies (full and diagonal blocks)."""
    runs = [chunks(split, seq_len, world, r) for r in range(world)]
    return [sum(a.numel() * b.numel() for j in range(world) for a in runs[i] for b in runs[j]
                if block_kind(a, b, causal) != "skipped") for i in range(world)]


def agreed_length(local: int, group, where: str, world: int, device=None) -> int:
    """``local · world`` once every rank's local length agrees (one small all-gather)."""
    lengths = torch.zeros(world, dtype=torch.int64, device=device)   # device: the data's (NCCL)
    C.all_gather(lengths, torch.tensor([local], dtype=torch.int64, device=device), group=group)
    lengths = lengths.tolist()
    if len(set(lengths)) > 1:
        raise ValueError(f"{where}: the ranks hold different numbers of positions {lengths} and "
                         f"seq_len was not given, so the global length is unknown; pass "
                         f"seq_len={sum(lengths)} (the whole sequence) to every rank")
    return local * world
