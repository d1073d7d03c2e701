"""Do larger batches help convergence? Steps and examples to a target loss, batch by batch.

The sweep of chapter 04: the digits MLP trained with SGD (momentum 0.9) at global batches from
32 to 2048, the learning rate scaled by the linear scaling rule with gradual warm-up (Goyal et al.
2017, "Accurate, Large Minibatch SGD", §2.1-2.2: ``lr = base_lr·B/base_batch``, reached by a
linear ramp from ``base_lr`` over the first ``warmup_epochs``), each run stopped when the loss on
the whole training set falls below a target. Recorded: the steps and the examples it took, and
along the small-batch runs the gradient noise scale ``B_simple = tr(Σ)/|G|²``
(:mod:`minidist.data_parallel.noise_scale`, McCandlish et al. 2018).

One process draws the global batch: DDP on W ranks of B/W examples each computes the same
averaged gradient as one process on B (:func:`ddp_gradient_check` checks it on minidist's
FlatDDP, and the chapter runs it), so the sweep needs no ranks — only the batch size matters.

Batches are drawn **with replacement** from the 1347 training digits: the examples of a batch are
then independent draws from a fixed distribution (the training set), the setting of McCandlish
et al.'s model, and ``tr(Σ)`` and ``|G|²`` over the whole training set are its exact values; it
also lets a batch exceed the training set.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..data import load_digits
from minidist.data_parallel.noise_scale import (NoiseScale, from_per_example, from_two_batches,
    per_example_grads)
from minidist.models import MLP
from .data_parallel_training import scaled_lr

__all__ = ["warmup_lr", "Run", "train_to_target", "sweep", "fit_critical_batch", "plot_sweep",
           "ddp_gradient_check", "check_batch_indices",
           "ranks_noise_scale", "exact_noise_scale"]


def warmup_lr(step: int, base_lr: float, batch: int, base_batch: int = 32,
              warmup_steps: int = 0) -> float:
    """The learning rate of step ``step`` (0-based) under linear scaling with gradual warm-up.

    Goyal et al. 2017 §2.2: the target rate is ``k·base_lr`` with ``k = batch/base_batch``
    (:func:`~minidist_course.lessons.data_parallel_training.scaled_lr`); training starts at ``base_lr`` and adds
    a constant amount each step so that it reaches ``k·base_lr`` after ``warmup_steps`` steps,
    then stays there. ``warmup_steps=0``: ``k·base_lr`` from the first step.
    """
    if batch <= 0 or base_batch <= 0:
        raise ValueError(f"warmup_lr: batch and base_batch must be > 0, got batch={batch}, "
                         f"base_batch={base_batch}")
    if warmup_steps < 0 or step < 0:
        raise ValueError(f"warmup_lr: step and warmup_steps must be >= 0, got step={step}, "
                         f"warmup_steps={warmup_steps}")
    target = scaled_lr(base_lr, batch, base_batch)
    if step >= warmup_steps:
        return target
    return base_lr + (target - base_lr) * step / warmup_steps


@dataclass
class Run:
    """One training run: ``losses[t]`` is the whole training set's loss after step ``t + 1``;
    ``steps``/``examples`` to the target (None: not reached, or diverged); ``noise``: the
    noise-scale measurements taken along the run."""

    batch: int
    seed: int
    lr: float
    losses: list[float]
    steps: int | None
    noise: list[NoiseScale] = field(default_factory=list)

    @property
    def examples(self) -> int | None:
        return None if self.steps is None else self.steps * self.batch


def train_to_target(batch: int, seed: int = 0, target: float = 0.2, base_lr: float = 0.02,
                    base_batch: int = 32, momentum: float = 0.9, warmup_epochs: float = 2.0,
                    max_steps: int = 2000, noise_every: int = 0, noise_band: float = 2.0) -> Run:
    """Train the digits MLP (64→64→10, seeded by ``seed``) on batches of ``batch`` examples
    drawn with replacement until the training loss is below ``target`` (nats).

    ``warmup_epochs`` of examples set the warm-up: ``ceil(warmup_epochs·N/batch)`` steps.
    ``noise_every=k > 0``: every k steps while the loss is within ``noise_band × target``,
    measure tr(Σ) and |G|² exactly over the N training examples (per-example gradients).
    Runs on one thread (restored after): the model is too small for a second to help, and on a
    shared machine extra threads only contend.
    """
    if batch < 1 or max_steps < 1 or not target > 0 or warmup_epochs < 0:
        raise ValueError(f"train_to_target: need batch >= 1, max_steps >= 1, target > 0 and "
                         f"warmup_epochs >= 0, got batch={batch}, max_steps={max_steps}, "
                         f"target={target}, warmup_epochs={warmup_epochs}")
    with _one_thread():
        return _train(batch, seed, target, base_lr, base_batch, momentum, warmup_epochs, max_steps,
                      noise_every, noise_band)


@contextlib.contextmanager
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _train(batch, seed, target, base_lr, base_batch, momentum, warmup_epochs, max_steps,
           noise_every, noise_band) -> Run:
    x_all, y_all = load_digits()[0].tensors
    n = len(x_all)
    torch.manual_seed(seed)
    model = MLP(64, (64,), 10)
    opt = torch.optim.SGD(model.parameters(), lr=base_lr, momentum=momentum)
    draw = torch.Generator().manual_seed(10_000 + seed)
    warmup = math.ceil(warmup_epochs * n / batch)
    losses: list[float] = []
    noise: list[NoiseScale] = []
    for step in range(max_steps):
        for group in opt.param_groups:
            group["lr"] = warmup_lr(step, base_lr, batch, base_batch, warmup)
        idx = torch.randint(n, (batch,), generator=draw)
        opt.zero_grad()
        F.cross_entropy(model(x_all[idx]), y_all[idx]).backward()
        opt.step()
        with torch.no_grad():
            loss = float(F.cross_entropy(model(x_all), y_all))
        losses.append(loss)
        if not math.isfinite(loss):
            break
        if noise_every and step % noise_every == 0 and loss < noise_band * target:
            grads = per_example_grads(model, F.cross_entropy, x_all, y_all)
            noise.append(from_per_example(grads, whole_population=True))
        if loss < target:
            return Run(batch, seed, scaled_lr(base_lr, batch, base_batch), losses, step + 1, noise)
    return Run(batch, seed, scaled_lr(base_lr, batch, base_batch), losses, None, noise)


def sweep(batches=(32, 64, 128, 256, 512, 1024, 2048), seeds=(0, 1, 2), noise_batch: int = 32,
          noise_every: int = 20, progress: bool = False, **kwargs) -> dict[int, list[Run]]:
    """:func:`train_to_target` for every batch and seed: ``{batch: [Run per seed]}``. The runs at
    ``noise_batch`` also measure the noise scale (every ``noise_every`` steps)."""
    from tqdm.auto import tqdm

    jobs = [(b, s) for b in batches for s in seeds]
    out: dict[int, list[Run]] = {b: [] for b in batches}
    for b, s in tqdm(jobs, desc="batch sweep", disable=not progress, leave=False):
        out[b].append(train_to_target(b, s, noise_every=noise_every if b == noise_batch else 0,
                                      **kwargs))
    return out


def fit_critical_batch(batches, steps) -> tuple[float, float, float]:
    """Fit McCandlish et al.'s ``S = S_min + E_min/B`` (their eq. 2.11 with ``E = B·S``) to
    measured steps; returns ``(S_min, E_min, B_crit = E_min/S_min)``.

    Least squares on the relative error ``(S_min + E_min/B)/S − 1``, so a 20-step run weighs as
    much as a 2000-step one.
    """
    b = torch.tensor([float(v) for v in batches], dtype=torch.float64)
    s = torch.tensor([float(v) for v in steps], dtype=torch.float64)
    if len(b) < 2 or len(b) != len(s) or bool((b <= 0).any()) or bool((s <= 0).any()):
        raise ValueError(f"fit_critical_batch: need >= 2 positive (batch, steps) pairs of equal "
                         f"length, got batches={list(batches)}, steps={list(steps)}")
    a = torch.stack([1 / s, 1 / (b * s)], dim=1)
    s_min, e_min = torch.linalg.lstsq(a, torch.ones_like(s).unsqueeze(1)).solution.flatten().tolist()
    return s_min, e_min, (e_min / s_min if s_min > 0 else math.inf)


def plot_sweep(runs: dict[int, list[Run]], target: float, seed_index: int = 0, axes=None):
    """Training loss against steps (left) and against examples seen (right), one line per batch
    (the runs of ``seeds[seed_index]``), the target dashed. Returns the two axes."""
    import matplotlib.pyplot as plt

    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(10, 3.6), dpi=80, sharey=True)
    cmap = plt.get_cmap("viridis")
    for i, (b, rs) in enumerate(sorted(runs.items())):
        r = rs[seed_index]
        t = torch.arange(1, len(r.losses) + 1)
        color = cmap(i / max(len(runs) - 1, 1))
        axes[0].plot(t, r.losses, color=color, label=f"B = {b}")
        axes[1].plot(t * b, r.losses, color=color)
    for ax, label in zip(axes, ("steps", "examples seen")):
        ax.axhline(target, ls="--", color="grey", lw=1)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(label)
    axes[0].set_ylabel("training loss (nats)")
    axes[0].legend(fontsize=7)
    axes[0].set_title("fewer steps with larger batches ...")
    axes[1].set_title("... at the price of more examples")
    return axes


def ddp_gradient_check(rank: int, world_size: int, batch: int = 64, seed: int = 0) -> dict:
    """Inside :func:`minidist.run`: one batch of ``batch`` digits split over the ranks, FlatDDP's
    averaged gradient against one process's gradient on the whole batch, and the two-batch
    noise estimate (local = ``batch/W`` examples, averaged = ``batch``) formed from the ranks'
    norms against the same estimate formed by one process from the same halves.

    Returns ``{"max_abs_diff", "local_sq", "global_sq", "noise"}`` (``noise``: a NoiseScale;
    None on one rank, where the two batches are the same).
    """
    import torch.distributed as dist

    from minidist.data_parallel import FlatDDP

    if batch % world_size:
        raise ValueError(f"ddp_gradient_check: batch {batch} must split evenly over "
                         f"{world_size} ranks (unequal shards need weighted losses)")
    x_all, y_all = load_digits()[0].tensors
    idx = check_batch_indices(len(x_all), batch, seed)
    torch.manual_seed(seed)
    single = MLP(64, (64,), 10)
    ddp = FlatDDP(MLP(64, (64,), 10))  # broadcast from rank 0: same start as `single`
    ddp.module.load_state_dict(single.state_dict())
    local = idx.view(world_size, -1)[rank]
    F.cross_entropy(ddp(x_all[local]), y_all[local]).backward()
    local_sq = torch.stack([p.grad.pow(2).sum() for p in ddp.module.parameters()]).sum()
    ddp.sync_gradients()
    global_sq = float(torch.stack([p.grad.pow(2).sum() for p in ddp.module.parameters()]).sum())
    dist.all_reduce(local_sq)          # sum over ranks, then the mean
    local_mean = float(local_sq) / world_size
    F.cross_entropy(single(x_all[idx]), y_all[idx]).backward()
    diff = max(float((p.grad - q.grad).abs().max())
               for p, q in zip(ddp.module.parameters(), single.parameters()))
    noise = (from_two_batches(local_mean, global_sq, batch // world_size, batch)
             if world_size > 1 else None)
    return {"max_abs_diff": diff, "local_sq": local_mean, "global_sq": global_sq, "noise": noise}


def ranks_noise_scale(model: torch.nn.Module, per_rank: int, world_size: int, draws: int,
                      seed: int = 0) -> NoiseScale:
    """What W DDP ranks of ``per_rank`` digits each would estimate over ``draws`` steps at fixed
    parameters: per step, the mean of the ranks' local squared gradient norms (batch
    ``per_rank``) and the averaged gradient's (``W·per_rank``), fed to
    :func:`~minidist.data_parallel.noise_scale.from_two_batches` and averaged over steps
    (:meth:`NoiseScale.mean`). One process plays the ranks (the gradients are the same)."""
    if world_size < 2 or per_rank < 1 or draws < 1:
        raise ValueError(f"ranks_noise_scale: need world_size >= 2, per_rank >= 1, draws >= 1, "
                         f"got {world_size}, {per_rank}, {draws}")
    x_all, y_all = load_digits()[0].tensors
    draw = torch.Generator().manual_seed(seed)
    params = [p for p in model.parameters() if p.requires_grad]

    def grad_of(rows):
        loss = F.cross_entropy(model(x_all[rows]), y_all[rows])
        return torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)])

    estimates = []
    with _one_thread():
        for _ in range(draws):
            idx = torch.randint(len(x_all), (per_rank * world_size,), generator=draw)
            local = torch.stack([grad_of(rows) for rows in idx.view(world_size, per_rank)])
            estimates.append(from_two_batches(float(local.pow(2).sum(dim=1).mean()),
                                              float(local.mean(dim=0).pow(2).sum()),
                                              per_rank, per_rank * world_size))
    return NoiseScale.mean(estimates)


def exact_noise_scale(model: torch.nn.Module) -> NoiseScale:
    """tr(Σ) and |G|² of ``model`` over all 1347 training digits (per-example gradients)."""
    x_all, y_all = load_digits()[0].tensors
    with _one_thread():
        return from_per_example(per_example_grads(model, F.cross_entropy, x_all, y_all),
                                whole_population=True)


def check_batch_indices(n: int, batch: int, seed: int) -> torch.Tensor:
    """The ``batch`` example indices (of ``n``) :func:`ddp_gradient_check` uses; rank r takes
    the r-th of W equal consecutive slices."""
    return torch.randint(n, (batch,), generator=torch.Generator().manual_seed(seed))
