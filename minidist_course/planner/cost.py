"""What a training run costs: FLOPs, GPU-hours, money, and the spot-instance gamble.

Units: FLOPs, FLOP/s, seconds and bytes (``GB`` = 10^9 bytes) in and out of every function.
Prices are in the units bills use — per GPU-hour, per GB, per GB-month (a month = 730 hours, as
cloud bills count it) — in the currency of your prices. Compute time and FLOPs come from
:mod:`minidist_course.planner.calc` (6·N·D, the GPU table, time at an MFU), which this module extends.

Sources:

* training FLOPs ≈ 6·N·D: Kaplan et al. 2020, "Scaling Laws for Neural Language Models", §2.1.
  The attention term per token, forward: Kaplan's Table 1 counts 2·n_layer·n_ctx·d_attn (the
  QKᵀ logits); PaLM (Chowdhery et al. 2022, App. B: 6N + 12·L·H·Q·T for training) and
  Chinchilla (Hoffmann et al. 2022, App. F) also count attention × V: 4·n_layer·n_ctx·d_attn.
  Training is 3× forward (the backward pass is twice the forward);
* model FLOPs utilisation (MFU): PaLM, App. B;
* the optimum checkpoint interval sqrt(2·C·MTBF): Young 1974, "A first order approximation to
  the optimum checkpoint interval", CACM 17(9); its higher-order correction: Daly 2006, "A higher
  order estimate of the optimum checkpoint interval for restart dumps", FGCS 22(3).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from . import calc, energy

__all__ = ["PRICES", "MONTH", "price", "attention_flops_per_token", "training_flops", "mfu",
           "gpu_hours", "gpus_for_deadline", "expected_lost_work", "spot_wall_time",
           "young_interval", "daly_interval", "checkpoint_bytes", "storage_cost", "network_cost",
           "data_parallel_traffic", "Estimate", "estimate"]

MONTH = 730 * 3600.0  # seconds in a billing month (730 hours)

# ILLUSTRATIVE prices, written down by hand: not fetched, not a quote. Edit them (or pass your own
# dict) with what your provider charges you; they only set the order of magnitude of the lessons.
PRICES = {
    "as_of": "2026-11",
    "currency": "USD",
    "source": ("illustrative round numbers of the kind specialised GPU clouds list per GPU-hour "
               "(a large cloud's on-demand 8-GPU instance listed at about 12 USD per H100-hour at "
               "AWS p5's launch in 2023, then up to 45 % less from June 2025); not fetched, not "
               "a quote: edit these"),
    "gpu_hour": {   # per GPU-hour; reserved = a 1-3 year commitment, spot = can be interrupted
        "V100-32GB": {"on_demand": 1.50, "reserved": 1.00, "spot": 0.60},
        "A100-80GB": {"on_demand": 2.50, "reserved": 1.60, "spot": 1.20},
        "H100-80GB": {"on_demand": 4.00, "reserved": 2.50, "spot": 2.00},
    },
    "cpu_core_hour": 0.04,          # one CPU core (vCPU pair) for an hour
    "egress_per_gb": 0.09,          # out of the cloud, to the internet
    "inter_zone_per_gb": 0.02,      # between availability zones: 0.01 out + 0.01 in (AWS)
    "intra_zone_per_gb": 0.0,       # inside one zone / one cluster's fabric
    "storage_per_gb_month": 0.023,  # object storage
}

_CONVENTIONS = {"palm": 4.0, "chinchilla": 4.0, "kaplan": 2.0}  # forward FLOPs / (L·T·d_attn)


def _positive(name: str, value, hint: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
            or math.isinf(value):
        raise ValueError(f"{name} must be a positive number, got {value!r}" + (f": {hint}" if hint else ""))


def _non_negative(name: str, value, hint: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 \
            or math.isinf(value):
        raise ValueError(f"{name} must be >= 0, got {value!r}" + (f": {hint}" if hint else ""))


def _count(name: str, value, hint: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a whole number >= 1, got {value!r}: {hint}")


def _mfu(value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"mfu must be in (0, 1], got {value!r}: it is a fraction of the peak "
                         "(0.4 for 40%)")


def price(gpu: str = "H100-80GB", pricing: str = "on_demand", prices: dict = PRICES) -> float:
    """Price of one ``gpu`` for an hour under ``pricing`` (``"on_demand"``, ``"reserved"``,
    ``"spot"``) from ``prices`` (default: the illustrative :data:`PRICES`)."""
    table = prices["gpu_hour"]
    if gpu not in table:
        raise ValueError(f"no price for GPU {gpu!r}; prices know {sorted(table)}: add it to the dict")
    if pricing not in table[gpu]:
        raise ValueError(f"pricing must be one of {sorted(table[gpu])}, got {pricing!r}")
    return table[gpu][pricing]


def attention_flops_per_token(n_layer: int, n_ctx: int, d_attn: int, convention: str = "palm") -> float:
    """Training FLOPs per token of attention's context-dependent matmuls (forward + backward).

    ``"palm"``/``"chinchilla"``: 3 · 4·n_layer·n_ctx·d_attn (QKᵀ and attention × V; PaLM App. B's
    12·L·H·Q·T); ``"kaplan"``: 3 · 2·n_layer·n_ctx·d_attn (Kaplan Table 1 counts QKᵀ only —
    about what a causal kernel that skips the masked half computes). ``d_attn`` = heads · head dim.
    """
    for name, v in (("n_layer", n_layer), ("n_ctx", n_ctx), ("d_attn", d_attn)):
        _positive(name, v)
    if convention not in _CONVENTIONS:
        raise ValueError(f"convention must be one of {sorted(_CONVENTIONS)}, got {convention!r}")
    return 3 * _CONVENTIONS[convention] * n_layer * n_ctx * d_attn


def training_flops(params: float, tokens: float, n_layer: int | None = None,
                   n_ctx: int | None = None, d_attn: int | None = None,
                   convention: str = "palm") -> float:
    """FLOPs to train ``params`` parameters on ``tokens`` tokens: 6·N·D (:func:`calc.training_flops`),
    plus ``tokens`` × :func:`attention_flops_per_token` when the shape (all three of ``n_layer``,
    ``n_ctx``, ``d_attn``) is given. GPT-3 (174.6e9, 300e9 tokens): 3.14e23 (Brown et al. 2020,
    Table D.1, which leaves attention out)."""
    flops = calc.training_flops(params, tokens)
    shape = (n_layer, n_ctx, d_attn)
    if any(v is not None for v in shape):
        if any(v is None for v in shape):
            raise ValueError("give all of n_layer, n_ctx and d_attn for the attention term, or none")
        flops += tokens * attention_flops_per_token(n_layer, n_ctx, d_attn, convention)
    return flops


def mfu(tokens_per_second: float, flops_per_token: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: the model's FLOP/s (tokens/s × training FLOPs per token) over the
    hardware's ``peak_flops`` (FLOP/s; per device when ``tokens_per_second`` is) — PaLM, App. B."""
    _positive("tokens_per_second", tokens_per_second)
    _positive("flops_per_token", flops_per_token)
    _positive("peak_flops", peak_flops)
    return tokens_per_second * flops_per_token / peak_flops


def gpu_hours(flops: float, peak_flops: float, mfu: float) -> float:
    """GPU-hours to do ``flops`` at ``mfu`` of ``peak_flops`` (FLOP/s per GPU). Independent of how
    many GPUs share the work, as long as each keeps that MFU."""
    _mfu(mfu)
    return calc.training_time(flops, 1, peak_flops, mfu) / 3600


def gpus_for_deadline(flops: float, deadline: float, peak_flops: float, mfu: float,
                      gpus_per_node: int = 1) -> int:
    """Fewest GPUs (whole nodes of ``gpus_per_node``) that do ``flops`` within ``deadline`` seconds
    at ``mfu`` of ``peak_flops`` each. Assumes the MFU holds at that scale (perfect scaling):
    measure it there, it falls as communication grows."""
    _positive("flops", flops)
    _positive("deadline", deadline, "the deadline is in seconds and must be in the future")
    _positive("peak_flops", peak_flops)
    _mfu(mfu)
    _count("gpus_per_node", gpus_per_node, "GPUs in one node (8 on most GPU servers)")
    gpus = flops / (deadline * peak_flops * mfu)
    nodes = math.ceil(gpus / gpus_per_node * (1 - 1e-12))  # 2.0000000001 nodes is 2 nodes
    return max(1, nodes) * gpus_per_node


def expected_lost_work(checkpoint_interval: float, restart_time: float = 0.0) -> float:
    """Seconds one interruption costs on average: half a checkpoint interval of work to redo
    (it strikes uniformly between two checkpoints) plus the ``restart_time`` (new machines, reload)."""
    _positive("checkpoint_interval", checkpoint_interval)
    _non_negative("restart_time", restart_time)
    return checkpoint_interval / 2 + restart_time


def spot_wall_time(work_time: float, interruptions_per_hour: float, checkpoint_interval: float,
                   checkpoint_time: float = 0.0, restart_time: float = 0.0) -> float:
    """Expected wall-clock seconds for ``work_time`` seconds of uninterrupted training when the
    job is interrupted ``interruptions_per_hour`` times an hour while it runs (Poisson; for the whole
    job: k nodes each interrupted r times an hour give k·r), writes a checkpoint taking
    ``checkpoint_time`` seconds every ``checkpoint_interval`` seconds of work, and needs
    ``restart_time`` seconds to come back after an interruption.

    First-order model (as Young 1974): each interruption costs :func:`expected_lost_work`, τ/2 of
    work to redo plus the restart R. Running time W_run = work·(1 + C/τ) + λ·W_run·τ/2, and the
    restarts add λ·W_run·R: ``W = work·(1 + C/τ)·(1 + λR) / (1 − λτ/2)``. Raises ``ValueError``
    when λτ/2 >= 1: the job loses work as fast as it makes it and never finishes.
    """
    _positive("work_time", work_time)
    _non_negative("interruptions_per_hour", interruptions_per_hour)
    _positive("checkpoint_interval", checkpoint_interval, "seconds of work between checkpoints")
    _non_negative("checkpoint_time", checkpoint_time)
    _non_negative("restart_time", restart_time)
    rate = interruptions_per_hour / 3600
    if rate * checkpoint_interval / 2 >= 1:
        raise ValueError(
            f"the run never finishes: an interruption every {1 / rate:.4g} s of running on average, "
            f"each losing checkpoint_interval/2 = {checkpoint_interval / 2:.4g} s of work; "
            f"checkpoint more often (Young's interval: "
            f"{young_interval(max(checkpoint_time, 1e-9), 1 / rate):.4g} s) or use on-demand machines")
    running = work_time * (1 + checkpoint_time / checkpoint_interval) / (1 - rate * checkpoint_interval / 2)
    return running * (1 + rate * restart_time)


def young_interval(checkpoint_time: float, mtbf: float) -> float:
    """Young's (1974) optimum seconds of work between checkpoints: sqrt(2 · C · MTBF), for a
    checkpoint taking ``checkpoint_time`` C seconds and a mean time between failures (or
    interruptions) of ``mtbf`` seconds. First order: good when C << MTBF."""
    _positive("checkpoint_time", checkpoint_time)
    _positive("mtbf", mtbf, "mean seconds between interruptions (3600 / interruptions per hour)")
    return math.sqrt(2 * checkpoint_time * mtbf)


def daly_interval(checkpoint_time: float, mtbf: float) -> float:
    """Daly's (2006) higher-order optimum: sqrt(2CM)·(1 + sqrt(C/2M)/3 + (C/2M)/9) − C
    for C < 2M, else M (seconds; C = ``checkpoint_time``, M = ``mtbf``)."""
    base = young_interval(checkpoint_time, mtbf)
    c, m = checkpoint_time, mtbf
    if c >= 2 * m:
        return m
    x = c / (2 * m)
    return base * (1 + math.sqrt(x) / 3 + x / 9) - c


def checkpoint_bytes(params: float, dtype: str = "bf16", optimizer: str = "adam") -> float:
    """Bytes of one full training checkpoint: weights and optimizer state (not the gradients), from
    :func:`calc.training_memory`: 14 bytes per parameter for mixed-precision Adam."""
    m = calc.training_memory(params, dtype, optimizer)
    return m.weights + m.optimizer


def storage_cost(nbytes: float, seconds: float, price_per_gb_month: float) -> float:
    """Cost of keeping ``nbytes`` for ``seconds`` at ``price_per_gb_month`` (per 1e9 bytes per 730 h)."""
    _non_negative("nbytes", nbytes)
    _non_negative("seconds", seconds)
    _non_negative("price_per_gb_month", price_per_gb_month, "prices are not negative")
    return nbytes / 1e9 * seconds / MONTH * price_per_gb_month


def network_cost(nbytes: float, price_per_gb: float) -> float:
    """Cost of moving ``nbytes`` at ``price_per_gb`` (per 1e9 bytes)."""
    _non_negative("nbytes", nbytes)
    _non_negative("price_per_gb", price_per_gb, "prices are not negative")
    return nbytes / 1e9 * price_per_gb


def data_parallel_traffic(grad_bytes: float, steps: int, n_nodes: int) -> float:
    """Bytes that cross the network between nodes when ``n_nodes`` all-reduce ``grad_bytes`` of
    gradients ``steps`` times, hierarchically (inside a node first): each node sends a ring
    all-reduce's 2(n−1)/n · grad_bytes per step (:func:`calc.comm_bytes_per_rank`), summed over nodes."""
    _non_negative("grad_bytes", grad_bytes)
    _non_negative("steps", steps)
    _count("n_nodes", n_nodes, "machines taking part")
    return calc.comm_bytes_per_rank("all_reduce", grad_bytes, n_nodes) * n_nodes * steps


@dataclass(frozen=True)
class Estimate:
    """A run's expected wall time (s), GPU-hours billed, and money by line (``lines``)."""

    wall_time: float
    gpu_hours: float
    lines: dict = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.lines.values())

    def __str__(self) -> str:
        rows = [f"{k:<26}{v:>16,.0f}" for k, v in self.lines.items()]
        return "\n".join(rows + [f"{'total':<26}{self.total:>16,.0f}",
                                 f"wall time {calc.human_time(self.wall_time)}, "
                                 f"{self.gpu_hours:,.0f} GPU-hours billed"])


def estimate(flops: float, n_gpus: int, price_per_gpu_hour: float, peak_flops: float, mfu: float,
             *, interruptions_per_hour: float = 0.0, checkpoint_interval: float = 3600.0,
             checkpoint_time: float = 0.0, restart_time: float = 0.0, commitment: float = 0.0,
             network_bytes: float = 0.0, price_per_gb_moved: float = 0.0,
             storage_bytes: float = 0.0, storage_time: float | None = None,
             price_per_gb_month: float = 0.0, gpu_watts: float = 0.0, node_watts: float = 0.0,
             gpus_per_node: int = 8, pue: float = 1.0, price_per_kwh: float = 0.0) -> Estimate:
    """Money for a run of ``flops`` on ``n_gpus`` GPUs at ``mfu`` of ``peak_flops`` (FLOP/s each),
    by line: the useful compute, the checkpoint writes, the work lost to interruptions and restarts
    (:func:`spot_wall_time`), reserved time left unused (``commitment``: seconds you pay for
    whatever you use), the network (``network_bytes`` at ``price_per_gb_moved``) and storage
    (``storage_bytes`` kept ``storage_time`` seconds, default the wall time), and the energy
    (:func:`energy.energy_kwh` of every GPU and its node, in W, for the wall time, × ``pue``, at
    ``price_per_kwh``: zero unless you pay for power apart from the GPU-hour price). Every GPU is
    billed for the whole wall time."""
    _count("n_gpus", n_gpus, "the run needs at least one GPU")
    _non_negative("price_per_gpu_hour", price_per_gpu_hour, "prices are not negative")
    _non_negative("commitment", commitment)
    _mfu(mfu)
    work = calc.training_time(flops, n_gpus, peak_flops, mfu)
    wall = spot_wall_time(work, interruptions_per_hour, checkpoint_interval, checkpoint_time,
                          restart_time)
    per_second = n_gpus * price_per_gpu_hour / 3600
    checkpoints = work * checkpoint_time / checkpoint_interval
    lines = {"compute": work * per_second,
             "checkpoint writes": checkpoints * per_second,
             "lost work and restarts": (wall - work - checkpoints) * per_second,
             "unused reservation": max(0.0, commitment - wall) * per_second,
             "network": network_cost(network_bytes, price_per_gb_moved),
             "storage": storage_cost(storage_bytes, wall if storage_time is None else storage_time,
                                     price_per_gb_month),
             "energy": energy.energy_cost(energy.energy_kwh(
                 n_gpus * wall / 3600, gpu_watts, node_watts, gpus_per_node, pue), price_per_kwh)}
    return Estimate(wall, n_gpus * max(wall, commitment) / 3600, lines)
