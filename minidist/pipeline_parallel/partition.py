"""Split a sequential model into pipeline stages: by layer count, by parameters, or by measured time.

Minimises the slowest stage (linear partition, dynamic programming; GPipe, Huang et al. 2019, §2.2).
Design notes: docs/design/pipeline_parallel.md
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

__all__ = ["balanced_bounds", "split_model", "layer_costs"]


def balanced_bounds(costs: list[float], n_stages: int) -> list[tuple[int, int]]:
    """Contiguous non-empty ``[start, end)`` per stage minimising the max stage sum.
    ``ValueError``: fewer layers than stages, or negative costs."""
    n = len(costs)
    if n_stages < 1 or n < n_stages:
        raise ValueError(f"cannot split {n} layers into {n_stages} stages: every stage needs at "
                         "least one layer")
    if any(c < 0 for c in costs):
        raise ValueError(f"layer costs must be >= 0, got {costs}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    INF = (float("inf"), float("inf"))
    # best[k][i]: (largest stage sum, sum of squared stage sums) of the best split of the first i
    # layers into k stages; the second entry breaks ties toward even splits (10 -> 2,2,3,3)
    best = [[INF] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = (0.0, 0.0)
    for k in range(1, n_stages + 1):
        for i in range(k, n - (n_stages - k) + 1):
            for j in range(k - 1, i):  # last stage is layers [j, i)
                part = prefix[i] - prefix[j]
                prev = best[k - 1][j]
                cand = (max(prev[0], part), prev[1] + part * part)
                if cand < best[k][i]:
                    best[k][i], cut[k][i] = cand, j
    bounds, i = [], n
    for k in range(n_stages, 0, -1):
        bounds.append((cut[k][i], i))
        i = cut[k][i]
    return bounds[::-1]


def layer_costs(model: nn.Sequential, by: str = "layers", sample: torch.Tensor | None = None,
                repeats: int = 3) -> list[float]:
    """Cost per layer: 1 (``"layers"``), parameter count (``"params"``) or median forward seconds
    on ``sample`` (``"time"``)."""
    layers = list(model)
    if by == "layers":
        return [1.0] * len(layers)
    if by == "params":
        return [float(sum(p.numel() for p in layer.parameters())) for layer in layers]
    if by == "time":
        if sample is None:
            raise ValueError("layer_costs(by='time') needs a sample input to time the layers on")
        costs = []
        x = sample
        with torch.no_grad():
            for layer in layers:
                times = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    y = layer(x)
                    times.append(time.perf_counter() - t0)
                costs.append(statistics.median(times))
                x = y
        return costs
    raise ValueError(f"by must be 'layers', 'params' or 'time', got {by!r}")


def split_model(model: nn.Sequential, n_stages: int, by: str = "layers",
                sample: torch.Tensor | None = None) -> list[nn.Sequential]:
    """Cut ``model`` into ``n_stages`` consecutive ``nn.Sequential`` sharing its layers (no copy);
    for interleaving pass ``P·v``."""
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"split_model needs an nn.Sequential (a list of layers), got "
                        f"{type(model).__name__}")
    bounds = balanced_bounds(layer_costs(model, by, sample), n_stages)
    layers = list(model)
    return [nn.Sequential(*layers[a:b]) for a, b in bounds]
