"""A stage's backward in two parts: B (gradient w.r.t. the input) now, W (weight gradients) later.

Zero-bubble pipelines (Qi et al. 2023, §2). B is ``autograd.grad(y, x)``; W runs the frontier nodes
again from their recorded gradients into the parameters (compare torch.distributed.pipelining).
Design notes: docs/design/pipeline_parallel.md
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

__all__ = ["backward_input", "backward_weight", "WeightGrad"]


@dataclass
class WeightGrad:
    """What W needs from B: frontier nodes, their recorded grad_outputs, their off-path edges."""

    groups: list = field(default_factory=list)   # [[(node, grads, [(next_node, nr), ...]), ...]]
    roots: list = field(default_factory=list)    # [(GradientEdge, grad)]
    params: list = field(default_factory=list)


def _nodes_reaching(root, target) -> dict:
    """Nodes under ``root`` from which ``target`` is reached, in a deterministic order."""
    memo: dict = {}
    stack = [(root, False)]
    while stack:  # iterative post-order: deep graphs do not hit the recursion limit
        node, expanded = stack.pop()
        if node in memo and not expanded:
            continue
        if expanded:
            memo[node] = node is target or any(memo.get(n, False) for n, _ in node.next_functions
                                               if n is not None)
            continue
        memo.setdefault(node, False)
        stack.append((node, True))
        stack += [(n, False) for n, _ in node.next_functions if n is not None and n not in memo]
    # a dict, not a set: the same graph gives the same order on every rank. W runs the frontier
    # groups in this order, and a group may recompute a checkpointed block whose forward holds a
    # collective (a TP all-reduce): in a set's order (by address) two TP ranks recomputed
    # different blocks and summed each other's activations.
    return dict.fromkeys(n for n, reach in memo.items() if reach)


def backward_input(y: torch.Tensor, dy: torch.Tensor | None, x: torch.Tensor, params) -> tuple:
    """Op B: ``(dx, WeightGrad)`` (``dx`` None when ``x`` needs no gradient); no ``.grad``
    changes. ``y``: stage output (or scalar loss with ``dy=None``); ``x``: the stage input (a leaf)."""
    params = [p for p in params if p.requires_grad]
    dy = torch.ones_like(y) if dy is None else dy
    if y.grad_fn is None:  # y does not depend on anything that needs a gradient
        return (torch.zeros_like(x) if x.requires_grad else None), WeightGrad(params=params)
    if not x.requires_grad:
        return None, WeightGrad(roots=[(get_gradient_edge(y), dy)], params=params)
    x_node = get_gradient_edge(x).node
    on_path = _nodes_reaching(y.grad_fn, x_node)
    if y.grad_fn not in on_path:  # x unused
        return torch.zeros_like(x), WeightGrad(roots=[(get_gradient_edge(y), dy)], params=params)
    frontier = {}  # node -> off-path edges
    for node in on_path:
        off = [(n, nr) for n, nr in node.next_functions if n is not None and n not in on_path]
        if off and node is not x_node:
            frontier[node] = off
    recorded: dict = {}
    handles: list = []
    for node in frontier:
        handles.append(node.register_prehook(
            lambda grad_outputs, node=node: recorded.__setitem__(node, grad_outputs)))
    try:
        (dx,) = torch.autograd.grad(y, x, dy, retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    return dx, WeightGrad(groups=_group(frontier, recorded), params=params)


def _group(frontier: dict, recorded: dict) -> list:
    parent = {n: n for n in frontier}

    def find(n):
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    owner: dict = {}
    for node, off in frontier.items():
        for edge in off:
            key = (edge[0], edge[1])
            if key in owner:
                parent[find(node)] = find(owner[key])
            else:
                owner[key] = node
    groups: dict = {}
    for node, off in frontier.items():
        if node in recorded:  # a node B never reached carries no gradient
            groups.setdefault(find(node), []).append((node, recorded[node], off))
    return list(groups.values())


def backward_weight(wg: WeightGrad) -> None:
    """Op W: accumulate the weight gradients into ``.grad`` (as a fused backward would)."""
    roots = list(wg.roots)
    for group in wg.groups:
        outs, gouts, targets = [], [], []
        for node, grads, off in group:
            for i, g in enumerate(grads):
                if g is not None:
                    outs.append(GradientEdge(node, i))
                    gouts.append(g)
            targets += [GradientEdge(n, nr) for n, nr in off if GradientEdge(n, nr) not in targets]
        if not outs:
            continue
        handles = []
        if len(group) > 1:  # pin every member to what it received in B (no double counting)
            handles = [node.register_prehook(lambda _, saved=grads: saved) for node, grads, _ in group]
        try:
            got = torch.autograd.grad(outs, targets, gouts, retain_graph=True, allow_unused=True)
        finally:
            for h in handles:
                h.remove()
        roots += [(e, g) for e, g in zip(targets, got) if g is not None]
    if not roots or not wg.params:
        return
    # Every root goes through autograd, also an edge straight into a parameter's AccumulateGrad
    # (a bias): only then do the parameter's hooks fire (post-accumulate-grad hooks, which
    # bucketed DDP fills its buckets from). Writing ``.grad`` by hand skipped them (pytorch#144530).
    torch.autograd.backward([e for e, _ in roots], [g for _, g in roots], inputs=wg.params)
