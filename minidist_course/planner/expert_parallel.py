"""Expert parallelism in the planner: the memory an MoE model's experts take per rank and the
all-to-all time of one step, when its experts are sharded over ``ep`` ranks (EP carved out of the
DP ranks; tp = pp = 1).

The model is a :class:`~minidist_course.planner.search.ModelSpec` GPT whose every MLP is replaced by the
experts of a :class:`MoESpec`; the links and the bytes per parameter are the planner's
(:class:`~minidist_course.planner.search.Links`, :data:`~minidist_course.planner.published.PRECISIONS`).
Chapter 15 compares :func:`predict_ep` with the bytes the hand-built all-to-all measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .published import PRECISIONS
from .search import Links, ModelSpec

__all__ = ["MoESpec", "predict_ep"]


@dataclass(frozen=True)
class MoESpec:
    """Every block's MLP (8h² + 5h parameters) replaced by ``experts`` copies and a router
    (``E·h``, no bias); each token goes to ``top_k`` experts; an expert accepts
    ``capacity_factor`` × its fair share of rows (:func:`minidist.expert_parallel.expert_capacity`)."""
    experts: int
    top_k: int = 1
    capacity_factor: float = 1.0


def predict_ep(model: ModelSpec, moe: MoESpec, ep: int, tokens_per_rank: int,
               links: Links = Links(), devices_per_node: int = 8, precision: str = "mixed",
               act_bytes: int = 2) -> dict:
    """Expert parallelism over ``ep`` ranks (EP carved out of the DP ranks, tp = pp = 1): the
    expert memory per rank and the all-to-all time of one step of ``tokens_per_rank`` tokens.

    Experts per rank ``ceil(E/ep)``; their weights, gradients and optimizer state take the bytes
    per parameter of ``precision`` (the non-expert part is ``model.params`` minus the MLPs, plus
    the routers). Per MoE layer: dispatch and combine forward, the same two backward; each moves
    ``rows = tokens·k·min(1, capacity_factor)`` rows of ``h`` values (balanced routing; a
    capacity factor below 1 drops the rest), of which (ep-1)/ep leave
    the rank, pairwise: ``(ep-1)·α + (ep-1)/ep · rows·h·act_bytes · β``, plus one count exchange
    (forward only: ``(ep-1)·α + (ep-1)/ep · 8E · β``, E int64). The EP group's link is the node's when ``ep <= devices_per_node``.
    Returns ``expert_params`` (per rank), ``dense_params``, ``expert_memory`` (bytes per rank),
    ``a2a_bytes`` (sent per rank per step), ``a2a_s`` (seconds per step, all exposed).

    Raises ValueError for ep < 1 or an unknown precision.
    """
    if not isinstance(ep, int) or ep < 1:
        raise ValueError(f"predict_ep: ep must be an int >= 1, got {ep!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"plan: precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
    h, L, E = model.hidden, model.layers, moe.experts
    mlp = 8 * h * h + 5 * h
    expert_params = L * math.ceil(E / ep) * mlp
    dense_params = model.params - L * mlp + L * E * h
    wb, gb, ob = PRECISIONS[precision]
    rows = tokens_per_rank * moe.top_k * min(1.0, moe.capacity_factor)
    out_bytes = (ep - 1) / ep * rows * h * act_bytes if ep > 1 else 0.0
    link = links.intra if ep <= devices_per_node else links.inter
    one = (ep - 1) * link.alpha + out_bytes * link.beta if ep > 1 else 0.0
    counts = (ep - 1) * link.alpha + 8 * E * (ep - 1) / ep * link.beta if ep > 1 else 0.0
    return dict(expert_params=expert_params, dense_params=dense_params,
                expert_memory=expert_params * (wb + gb + ob),
                a2a_bytes=L * (4 * out_bytes + 8 * E * (ep - 1) / ep),
                a2a_s=L * (4 * one + counts))
