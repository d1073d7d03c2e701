"""The alpha-beta (latency-bandwidth) model of a collective, fitted robustly, with its spread.

A message of ``m`` bytes over one link costs ``alpha + m · beta`` (Hockney 1994): ``alpha`` is the
per-message latency (seconds), ``beta`` the per-byte time (seconds/byte, 1/bandwidth). A collective
on ``W`` ranks and an ``n``-byte buffer costs, for the ring algorithms (Thakur, Rabenseifner &
Gropp, "Optimization of Collective Communication Operations in MPICH", IJHPCA 2005, §3 and §4)::

    all-reduce (reduce-scatter then all-gather)   2(W-1) · alpha + 2(W-1)/W · n · beta
    reduce-scatter, all-gather                     (W-1) · alpha +  (W-1)/W · n · beta

The byte coefficient is nccl-tests' bus-bandwidth factor (nccl-tests, doc/PERFORMANCE.md: busbw =
algbw × 2(W-1)/W for all-reduce), so ``1/beta`` is the busbw a large message approaches. ``torch``
(gloo on CPU) is fitted with the same ring model: gloo's CPU all-reduce is a ring by default, and at
W = 2 ring and halving-doubling have identical coefficients (2 alpha + n beta).

The fit (:func:`fit_alpha_beta_samples`) takes the per-size timing *samples*, not one number per
size: each size's time is the **median** of its samples (one load spike on a shared machine moves a
mean, not a median), alpha and beta come from least squares of the medians against the model,
weighted by 1/median (relative residuals: times span three orders of magnitude, and unweighted, a
1 % wobble of the largest size outweighs alpha entirely), and non-negativity is enforced by
refitting on the boundary (reported in ``clamped``, never silent). Their **spread** comes from the
bootstrap (Efron & Tibshirani 1993): each size's samples are resampled with replacement, the medians
refitted, and the 5th-95th percentiles of the refitted alpha and beta reported. The bootstrap sees
the noise inside one run; drift between runs (a machine whose load changes) it cannot see: compare
two runs.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict, dataclass, field

import torch

from minidist.comm import tuner

__all__ = ["MODELS", "model_coefficients", "model_time", "AlphaBetaFit", "fit_alpha_beta_samples",
           "format_fit", "compare_fits", "format_comparison", "save_fits", "load_fits",
           "machine_note", "FORMAT"]

FORMAT = "minidist-alpha-beta/1"  # the "format" field of the JSON file

# (op, algorithm) -> the model's formula; the coefficients are the tuner's (minidist.comm.tuner,
# counted from what each algorithm sends); "torch" (gloo's ring) is fitted with the ring's model
_FORMULAS = {"all_reduce": {"ring": "2(W-1)·alpha + 2(W-1)/W·n·beta",
                            "recursive_doubling": "k·alpha + k·n·beta, k = log2 W (+2 off a power of 2)",
                            "naive": "2(W-1)·alpha + 2(W-1)·n·beta"},
             "reduce_scatter": {"ring": "(W-1)·alpha + (W-1)/W·n·beta",
                                "naive": "alpha + (W-1)/W·n·beta"},
             "all_gather": {"ring": "(W-1)·alpha + (W-1)/W·n·beta", "naive": "alpha + (W-1)/W·n·beta"},
             "broadcast": {"tree": "ceil(log2 W)·(alpha + n·beta)", "naive": "alpha + (W-1)·n·beta",
                           "ring": "(W-2+S)·alpha + (W-2+S)/S·n·beta, S segments"}}
MODELS = {(op, a): f for op, algs in _FORMULAS.items() for a, f in algs.items()}
MODELS.update({(op, "torch"): _FORMULAS[op]["ring"] for op in ("all_reduce", "reduce_scatter",
                                                                 "all_gather")})


def model_coefficients(op: str, algorithm: str, world_size: int, nbytes: float = 0,
                       itemsize: int = 4) -> tuple[float, float]:
    """(c_alpha, c_beta) with ``time = c_alpha · alpha + c_beta · n · beta`` for an n-byte buffer
    (:func:`minidist.comm.tuner.coefficients`; only the ring broadcast's depend on ``nbytes``).

    Raises ValueError for an (op, algorithm) without a model or world_size < 2 (one rank sends
    nothing: there is nothing to fit).
    """
    if (op, algorithm) not in MODELS:
        raise ValueError(f"no alpha-beta model for {op}/{algorithm}; models exist for "
                         f"{sorted('/'.join(k) for k in MODELS)}")
    if world_size < 2:
        raise ValueError(f"alpha-beta model of {op}/{algorithm}: world_size must be >= 2, "
                         f"got {world_size}")
    return tuner.coefficients(op, "ring" if algorithm == "torch" else algorithm, world_size,
                              nbytes, itemsize)


def model_time(op: str, algorithm: str, world_size: int, nbytes: float, alpha: float,
               beta: float) -> float:
    """Predicted seconds of ``op`` by ``algorithm`` on ``world_size`` ranks for an ``nbytes``
    buffer, given link ``alpha`` (s) and ``beta`` (s/byte). 0 at world_size 1 (nothing moves)."""
    if world_size == 1:
        return 0.0
    ca, cb = model_coefficients(op, algorithm, world_size, nbytes)
    return ca * alpha + cb * nbytes * beta


def machine_note(text: str = "") -> dict:
    """Where and when a measurement ran: host, CPUs, torch and its thread count, load average."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return dict(host=platform.node(), cpus=os.cpu_count(), machine=platform.machine(),
                torch=torch.__version__, torch_threads=torch.get_num_threads(),
                loadavg_1_5_15=[round(x, 2) for x in load],
                utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), note=text)


@dataclass
class AlphaBetaFit:
    """One fit: link ``alpha`` (s) and ``beta`` (s/byte) of ``op``/``algorithm`` at ``world_size``.

    ``alpha_spread`` and ``beta_spread`` are the (low, high) percentiles of the bootstrap refits
    (``spread_level`` = 0.90: 5th to 95th). ``clamped`` names a parameter whose unconstrained
    least-squares value (``unconstrained``) was negative and was fixed at 0. ``points``: one dict
    per size: bytes, reps, median_s, q25_s, q75_s (the IQR's ends), model_s (the fit's time).
    """

    op: str
    algorithm: str
    world_size: int
    alpha: float
    beta: float
    alpha_spread: tuple[float, float]
    beta_spread: tuple[float, float]
    spread_level: float = 0.90
    n_bootstrap: int = 0
    statistic: str = "median"
    clamped: tuple[str, ...] = ()
    unconstrained: tuple[float, float] = (float("nan"), float("nan"))
    model: str = ""
    points: list[dict] = field(default_factory=list)
    machine: dict = field(default_factory=dict)

    @property
    def bandwidth_GBps(self) -> float:
        """1/beta in GB/s (1e9 bytes/s): the busbw a large message approaches; inf if beta = 0."""
        return float("inf") if self.beta <= 0 else 1 / self.beta / 1e9

    def predict(self, nbytes: float, world_size: int | None = None) -> float:
        """Seconds the model gives for an ``nbytes`` buffer (at ``world_size``, default the fit's)."""
        return model_time(self.op, self.algorithm, world_size or self.world_size, nbytes,
                          self.alpha, self.beta)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "AlphaBetaFit":
        d = dict(d)
        for k in ("alpha_spread", "beta_spread", "clamped", "unconstrained"):
            d[k] = tuple(d[k])
        return cls(**d)


def _nonneg_lstsq(xa, xb, y, w):
    """Batched weighted least squares of y ≈ a·xa + b·xb with a, b >= 0 (exact for 2 unknowns:
    the interior solution if feasible, else the better of the two one-parameter fits).
    xa: [m], xb: [m], y: [B, m], w: [B, m]. Returns a, b, a_free, b_free ([B] each)."""
    wa, wb, wy = w * xa, w * xb, w * y
    saa, sbb, sab = (wa * wa).sum(1), (wb * wb).sum(1), (wa * wb).sum(1)
    say, sby = (wa * wy).sum(1), (wb * wy).sum(1)
    det = saa * sbb - sab * sab
    a_free, b_free = (sbb * say - sab * sby) / det, (saa * sby - sab * say) / det
    a_only = (say / saa).clamp(min=0)   # b = 0
    b_only = (sby / sbb).clamp(min=0)   # a = 0
    res_a = ((wy - wa * a_only[:, None]) ** 2).sum(1)
    res_b = ((wy - wb * b_only[:, None]) ** 2).sum(1)
    free_ok = (a_free >= 0) & (b_free >= 0)
    use_a_only = ~free_ok & (res_a < res_b)
    a = torch.where(free_ok, a_free, torch.where(use_a_only, a_only, torch.zeros_like(a_only)))
    b = torch.where(free_ok, b_free, torch.where(use_a_only, torch.zeros_like(b_only), b_only))
    return a, b, a_free, b_free


def fit_alpha_beta_samples(samples: dict[int, list[float]], op: str = "all_reduce",
                           algorithm: str = "ring", world_size: int = 2, *,
                           statistic: str = "median", n_bootstrap: int = 1000,
                           spread_level: float = 0.90, seed: int = 0,
                           machine: dict | None = None) -> AlphaBetaFit:
    """Fit link alpha (s) and beta (s/byte) to per-size timing samples under the collective's model.

    Args:
        samples: {buffer bytes: [seconds of each repetition]}, at least two sizes, each with at
            least one finite positive sample.
        op, algorithm, world_size: which model (:data:`MODELS`) the times follow.
        statistic: ``"median"`` (robust; the default) or ``"mean"`` (to show what an outlier does).
        n_bootstrap: resamples for the spread (0: no spread; the spread is then (alpha, alpha)).
        spread_level: central fraction of the bootstrap distribution reported (0.90: 5-95 %).
        seed: the bootstrap's generator seed (the fit is deterministic given the samples).

    Returns:
        :class:`AlphaBetaFit`. Raises ValueError on fewer than two sizes, an empty or non-positive
        sample set, or an unknown statistic/model.
    """
    model_coefficients(op, algorithm, world_size)   # raises for an unknown model
    if statistic not in ("median", "mean"):
        raise ValueError(f"statistic must be 'median' or 'mean', got {statistic!r}")
    sizes = sorted(samples)
    if len(sizes) < 2:
        raise ValueError(f"fit_alpha_beta_samples: need at least two sizes, got {sizes}")
    data = []
    for s in sizes:
        t = torch.tensor(list(samples[s]), dtype=torch.float64)
        if t.numel() == 0 or not bool(torch.isfinite(t).all()) or bool((t <= 0).any()):
            raise ValueError(f"fit_alpha_beta_samples: the samples of {s} bytes must be finite "
                             f"and positive (got {t.numel()} samples, min {t.min().item() if t.numel() else 'none'})")
        data.append(t)
    stat = (lambda t, dim: t.quantile(0.5, dim=dim)) if statistic == "median" else \
        (lambda t, dim: t.mean(dim=dim))
    coef = [model_coefficients(op, algorithm, world_size, s) for s in sizes]
    xa = torch.tensor([ca for ca, _ in coef], dtype=torch.float64)
    xb = torch.tensor([cb * s for (_, cb), s in zip(coef, sizes)], dtype=torch.float64)
    scale_b = float(xb.max())  # solve for beta·scale_b: both columns O(1), well conditioned
    y = torch.stack([stat(t, 0) for t in data])[None, :]
    a, b, a_free, b_free = _nonneg_lstsq(xa, xb / scale_b, y, 1 / y)
    alpha, beta = a.item(), b.item() / scale_b
    clamped = tuple(n for n, v in (("alpha", a_free.item()), ("beta", b_free.item())) if v < 0)
    lo_q, hi_q = (1 - spread_level) / 2, (1 + spread_level) / 2
    a_sp, b_sp = (alpha, alpha), (beta, beta)
    if n_bootstrap > 0:
        gen = torch.Generator().manual_seed(seed)
        yb = torch.stack([stat(t[torch.randint(t.numel(), (n_bootstrap, t.numel()), generator=gen)], 1)
                          for t in data], dim=1)
        ab, bb, _, _ = _nonneg_lstsq(xa, xb / scale_b, yb, 1 / yb)
        bb = bb / scale_b
        q = torch.tensor([lo_q, hi_q], dtype=torch.float64)
        a_sp, b_sp = tuple(ab.quantile(q).tolist()), tuple(bb.quantile(q).tolist())
    points = [dict(bytes=s, reps=t.numel(), median_s=t.quantile(0.5).item(),
                   q25_s=t.quantile(0.25).item(), q75_s=t.quantile(0.75).item(),
                   mean_s=t.mean().item(), model_s=ca * alpha + cb * s * beta)
              for s, t, (ca, cb) in zip(sizes, data, coef)]
    return AlphaBetaFit(op=op, algorithm=algorithm, world_size=world_size, alpha=alpha, beta=beta,
                        alpha_spread=a_sp, beta_spread=b_sp, spread_level=spread_level,
                        n_bootstrap=n_bootstrap, statistic=statistic, clamped=clamped,
                        unconstrained=(a_free.item(), b_free.item() / scale_b),
                        model=MODELS[(op, algorithm)], points=points,
                        machine=machine if machine is not None else {})


def _bw(beta: float) -> str:
    return "inf" if beta <= 0 else f"{1 / beta / 1e9:.3f}"


def format_fit(fit: AlphaBetaFit) -> str:
    """The per-size table (reps, median, IQR, model) and the fit with its spread, as text."""
    lines = [f"{fit.op}/{fit.algorithm}, W={fit.world_size}: time = {fit.model}",
             f"{'size':>10}{'reps':>7}{'median ms':>12}{'IQR ms':>20}{'model ms':>11}"]
    for p in fit.points:
        lines.append(f"{p['bytes']:>10}{p['reps']:>7}{p['median_s'] * 1e3:>12.4f}"
                     f"{'[' + format(p['q25_s'] * 1e3, '.4f') + ', ' + format(p['q75_s'] * 1e3, '.4f') + ']':>20}"
                     f"{p['model_s'] * 1e3:>11.4f}")
    pct = f"{(1 - fit.spread_level) / 2 * 100:g}-{(1 + fit.spread_level) / 2 * 100:g}%"
    (a0, a1), (b0, b1) = fit.alpha_spread, fit.beta_spread
    lines.append(f"alpha = {fit.alpha * 1e6:.1f} us  [{pct} of {fit.n_bootstrap} bootstrap "
                 f"refits: {a0 * 1e6:.1f} .. {a1 * 1e6:.1f} us]")
    lines.append(f"beta  = {fit.beta:.4g} s/B (1/beta = {_bw(fit.beta)} GB/s)  "
                 f"[{pct}: 1/beta {_bw(b1)} .. {_bw(b0)} GB/s]")
    for name in fit.clamped:
        i = 0 if name == "alpha" else 1
        lines.append(f"NOTE: {name} clamped to 0: the unconstrained least squares gave "
                     f"{fit.unconstrained[i]:.3g} (negative: noise larger than the {name} term; "
                     f"more repetitions or a wider size range)")
    return "\n".join(lines)


def compare_fits(before: list[AlphaBetaFit], after: list[AlphaBetaFit]) -> list[dict]:
    """Do two runs agree? For each (op, algorithm, world size) fitted in both: whether the alpha
    spreads overlap and whether the beta spreads overlap (``alpha_agree``, ``beta_agree``), with
    both fits' values. Disagreement means the machine changed between the runs by more than the
    noise within either run (the bootstrap cannot see that): trust neither spread alone."""
    old = {(f.op, f.algorithm, f.world_size): f for f in before}
    out = []
    for f in after:
        g = old.get((f.op, f.algorithm, f.world_size))
        if g is None:
            continue
        overlap = lambda a, b: a[0] <= b[1] and b[0] <= a[1]  # noqa: E731
        out.append(dict(op=f.op, algorithm=f.algorithm, world_size=f.world_size,
                        alpha=(g.alpha, f.alpha), beta=(g.beta, f.beta),
                        alpha_agree=overlap(g.alpha_spread, f.alpha_spread),
                        beta_agree=overlap(g.beta_spread, f.beta_spread)))
    return out


def format_comparison(rows: list[dict]) -> str:
    """One line per fit compared by :func:`compare_fits`."""
    word = {True: "agree (spreads overlap)", False: "DISAGREE (spreads disjoint)"}
    return "\n".join(f"{r['op']}/{r['algorithm']} W={r['world_size']}: alpha {r['alpha'][0] * 1e6:.1f} "
                     f"-> {r['alpha'][1] * 1e6:.1f} us {word[r['alpha_agree']]}; 1/beta "
                     f"{_bw(r['beta'][0])} -> {_bw(r['beta'][1])} GB/s {word[r['beta_agree']]}"
                     for r in rows)


def save_fits(path, fits: list[AlphaBetaFit], extra: dict | None = None) -> None:
    """Write ``{"format": FORMAT, "fits": [AlphaBetaFit.to_dict(), ...], **extra}`` as JSON."""
    with open(path, "w") as f:
        json.dump({"format": FORMAT, **(extra or {}), "fits": [x.to_dict() for x in fits]}, f,
                  indent=1)


def load_fits(path) -> list[AlphaBetaFit]:
    """Read a file written by :func:`save_fits`; ValueError if its ``format`` is not FORMAT."""
    with open(path) as f:
        d = json.load(f)
    if d.get("format") != FORMAT:
        raise ValueError(f"{path}: format {d.get('format')!r}, expected {FORMAT!r}")
    return [AlphaBetaFit.from_dict(x) for x in d["fits"]]
