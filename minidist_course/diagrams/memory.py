"""Which parallelism when: model-state memory per device against model size (chapter 09).

Per device, for Ψ parameters trained with mixed-precision Adam (2-byte weights and gradients,
K = 12 bytes of optimizer state: fp32 master copy, momentum, variance — ZeRO, Rajbhandari et al.
2020, §3.1 and §5, Figure 1), computed with :func:`minidist.sharding.zero_formula`:

* **DP** (stage 0) over ``world_size`` replicas: (2 + 2 + K)Ψ — nothing shrinks;
* **ZeRO-1 / 2 / 3** over ``world_size`` ranks: 2Ψ + 2Ψ + KΨ/N, 2Ψ + (2 + K)Ψ/N, (2 + 2 + K)Ψ/N;
* **TP** of degree ``tp``: every weight matrix split ``tp`` ways (Megatron-LM, Shoeybi et al.
  2019, §3), so each device holds the DP formula of Ψ/tp (the replicated LayerNorms and biases,
  a fraction of a percent, are left out);
* **PP** of degree ``pp``: each stage holds 1/pp of the layers, the DP formula of Ψ/pp.

Activations are left out (they depend on batch, sequence length and recomputation): the curves
are a lower bound, and the model sizes where they cross the device memory are upper bounds.
"""

from __future__ import annotations

import matplotlib.pyplot as plt

from ..planner import calc

__all__ = ["K_MIXED_ADAM", "parallelism_memory", "largest_fitting", "draw_parallelism_memory"]

K_MIXED_ADAM = 12  # bytes of optimizer state per parameter: fp32 master + momentum + variance


def parallelism_memory(psi: float, world_size: int = 64, tp: int = 8, pp: int = 4) -> dict:
    """Bytes of model states per device for ``psi`` parameters: ``{"DP": ..., "ZeRO-1": ...,
    "ZeRO-2": ..., "ZeRO-3": ..., "TP": ..., "PP": ...}`` (see the module docstring).

    Raises ``ValueError`` for ``psi <= 0`` or a degree below 1.
    """
    from minidist.sharding.memory import zero_formula  # floor 2, only needed when called

    if psi <= 0:
        raise ValueError(f"parallelism_memory: psi (parameters) must be > 0, got {psi}")
    for name, degree in (("world_size", world_size), ("tp", tp), ("pp", pp)):
        if int(degree) != degree or degree < 1:
            raise ValueError(f"parallelism_memory: {name} must be an integer >= 1, got {degree!r}")
    out = {("DP" if s == 0 else f"ZeRO-{s}"): zero_formula(psi, world_size, s, K_MIXED_ADAM)["total"]
           for s in range(4)}
    out["TP"] = zero_formula(psi / tp, 1, 0, K_MIXED_ADAM)["total"]
    out["PP"] = zero_formula(psi / pp, 1, 0, K_MIXED_ADAM)["total"]
    return out


def largest_fitting(memory: float, world_size: int = 64, tp: int = 8, pp: int = 4) -> dict:
    """The largest Ψ (parameters) whose model states fit in ``memory`` bytes per device, per
    strategy (every formula is linear in Ψ, so it is ``memory`` / bytes per parameter)."""
    if memory <= 0:
        raise ValueError(f"largest_fitting: memory must be > 0 bytes, got {memory}")
    per_param = parallelism_memory(1.0, world_size, tp, pp)
    return {name: memory / b for name, b in per_param.items()}


def draw_parallelism_memory(world_size: int = 64, tp: int = 8, pp: int = 4,
                            device: str = "A100-80GB", psi_range=(1e8, 1e12), ax=None):
    """Log-log chart: bytes per device against parameters, one line per strategy, the device's
    memory (``calc.GPUS[device]``) as a horizontal line, and where each line crosses it marked
    with the largest model that fits (model states only)."""
    if device not in calc.GPUS:
        raise ValueError(f"device must be one of {sorted(calc.GPUS)}, got {device!r}")
    memory = calc.GPUS[device]["memory"]
    lo, hi = psi_range
    if not 0 < lo < hi:
        raise ValueError(f"psi_range must be (low, high) with 0 < low < high, got {psi_range!r}")
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.6), dpi=80)
    n = 60
    psis = [lo * (hi / lo) ** (i / (n - 1)) for i in range(n)]
    curves = [parallelism_memory(p, world_size, tp, pp) for p in psis]
    fits = largest_fitting(memory, world_size, tp, pp)
    degree = {"DP": f"N={world_size}", "TP": f"degree {tp}", "PP": f"{pp} stages"}
    styles = {"DP": ("black", "-"), "ZeRO-1": ("tab:blue", "-"), "ZeRO-2": ("tab:orange", "-"),
              "ZeRO-3": ("tab:green", "-"), "TP": ("tab:purple", "--"), "PP": ("tab:brown", ":")}
    for name, (colour, style) in styles.items():
        label = f"{name} ({degree.get(name, f'N={world_size}')}): fits ≤ {fits[name] / 1e9:.3g}B"
        ax.plot(psis, [c[name] / 1e9 for c in curves], style, color=colour, label=label, linewidth=1.5)
        if lo <= fits[name] <= hi:
            ax.plot([fits[name]], [memory / 1e9], "o", color=colour, markersize=4)
    ax.axhline(memory / 1e9, color="red", linewidth=1)
    ax.text(lo * 1.2, memory / 1e9 * 1.3, f"{device}: {calc.human_bytes(memory)}", color="red",
            fontsize=8, va="bottom")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("model size Ψ (parameters)", fontsize=8)
    ax.set_ylabel("model states per device (GB)", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=7, loc="lower right", framealpha=0.9)
    ax.set_title("Which parallelism when: weights + grads + Adam state per device "
                 "(mixed precision, no activations)", fontsize=9)
    return ax.figure
