"""The one job every framework runs (course chapter 10): its definition, inputs and results.

Identical in every framework, so that any difference in the results is the framework's:

* model: MLP 64 → 32 → ReLU → 10, cross-entropy averaged over the global batch;
* initial weights: read from one shared file (:func:`make_inputs`), so no framework's RNG matters;
* data: scikit-learn's bundled 8x8 digits (1797 images, pixels / 16), stored in the same file, so a
  framework's environment needs only numpy to read it;
* plain SGD (no momentum, no weight decay, no gradient clipping);
* step ``t`` uses the global batch ``(t * 64 + arange(64)) mod 1797`` of the digits in their
  bundled order, split into equal contiguous halves: worker 0 rows 0..31, worker 1 rows 32..63;
* after each step's backward the loss (the mean over the global batch) is all-reduced and recorded;
* at the end, the weights are saved (:func:`save_result`) in torch's layout: ``w1`` [32, 64],
  ``b1`` [32], ``w2`` [10, 32], ``b2`` [10] (a ``Linear`` computes ``x @ w.T + b``).

Two variants: ``short`` (20 steps, lr 0.1) and ``long`` (200 steps, lr 0.5), long and steep enough
that a silent difference such as a default gradient clipping shows (it moves the weights by ~1e-2).

This module needs only numpy (and scikit-learn for :func:`make_inputs`, run once in the project's
venv), so each framework's script imports it whatever else its environment pins::

    python frameworks/job.py make-inputs inputs.npz      # project venv
    <launcher> frameworks/<framework>.py --inputs inputs.npz --out result.npz --variant long
"""

from __future__ import annotations

import argparse
import os

import numpy as np

SIZES = (64, 32, 10)          # in, hidden, classes
GLOBAL_BATCH = 64
WORKERS = 2
LOCAL_BATCH = GLOBAL_BATCH // WORKERS
VARIANTS = {"short": {"steps": 20, "lr": 0.1}, "long": {"steps": 200, "lr": 0.5}}
WEIGHT_NAMES = ("w1", "b1", "w2", "b2")
SEED = 0


def make_inputs(path: str) -> str:
    """Write the shared inputs (initial weights + digits) to ``path`` (.npz); deterministic.

    Weights: uniform in ±1/sqrt(fan_in), torch's default ``Linear`` range, drawn by numpy's
    PCG64 with seed 0, float32. Returns ``path``.
    """
    from sklearn.datasets import load_digits

    digits = load_digits()
    rng = np.random.default_rng(SEED)
    arrays = {}
    for i, (fan_in, fan_out) in enumerate(zip(SIZES[:-1], SIZES[1:]), start=1):
        bound = 1.0 / np.sqrt(fan_in)
        arrays[f"w{i}"] = rng.uniform(-bound, bound, (fan_out, fan_in)).astype(np.float32)
        arrays[f"b{i}"] = rng.uniform(-bound, bound, (fan_out,)).astype(np.float32)
    arrays["x"] = (digits.data / 16.0).astype(np.float32)      # [1797, 64] in [0, 1]
    arrays["y"] = digits.target.astype(np.int64)               # [1797] in 0..9
    np.savez(path, **arrays)
    return path


def load_inputs(path: str) -> dict[str, np.ndarray]:
    """The arrays written by :func:`make_inputs`: w1, b1, w2, b2, x, y."""
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def global_batch(inputs: dict, step: int) -> tuple[np.ndarray, np.ndarray]:
    """Step ``step``'s global batch: ``x`` [64, 64] float32, ``y`` [64] int64."""
    n = len(inputs["y"])
    idx = (step * GLOBAL_BATCH + np.arange(GLOBAL_BATCH)) % n
    return inputs["x"][idx], inputs["y"][idx]


def shard(inputs: dict, step: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """Worker ``rank``'s contiguous half of step ``step``'s global batch: [32, 64], [32]."""
    x, y = global_batch(inputs, step)
    lo = rank * LOCAL_BATCH
    return x[lo: lo + LOCAL_BATCH], y[lo: lo + LOCAL_BATCH]


def save_result(path: str, losses, weights: dict, **info) -> None:
    """Save the per-step losses ([steps] float64) and final weights (torch layout) to ``path``.

    Written to a temporary name then renamed, so a reader never sees half a file.
    """
    missing = set(WEIGHT_NAMES) - set(weights)
    if missing:
        raise ValueError(f"save_result: weights lack {sorted(missing)}")
    arrays = {k: np.asarray(weights[k], dtype=np.float32) for k in WEIGHT_NAMES}
    for k, (shape) in zip(WEIGHT_NAMES, ((SIZES[1], SIZES[0]), (SIZES[1],), (SIZES[2], SIZES[1]), (SIZES[2],))):
        if arrays[k].shape != shape:
            raise ValueError(f"save_result: {k} has shape {arrays[k].shape}, expected {shape} "
                             "(torch layout: [out, in])")
    tmp = path + ".tmp.npz"
    np.savez(tmp, losses=np.asarray(losses, dtype=np.float64), **arrays,
             **{k: np.asarray(v) for k, v in info.items()})
    os.replace(tmp, path)


def load_result(path: str) -> dict[str, np.ndarray]:
    """What :func:`save_result` wrote: losses, w1, b1, w2, b2 (and any extra info)."""
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def parse_args(argv=None, extra=None) -> argparse.Namespace:
    """The command line every framework script shares: --inputs, --out, --variant (+ ``extra``)."""
    p = argparse.ArgumentParser(description="the frameworks chapter's job")
    p.add_argument("--inputs", required=True, help=".npz written by `job.py make-inputs`")
    p.add_argument("--out", required=True, help="where rank 0 saves losses and final weights (.npz)")
    p.add_argument("--variant", choices=sorted(VARIANTS), default="short")
    for args, kwargs in (extra or []):
        p.add_argument(*args, **kwargs)
    a, _unknown = p.parse_known_args(argv)   # some launchers append their own flags (--local_rank)
    a.steps, a.lr = VARIANTS[a.variant]["steps"], VARIANTS[a.variant]["lr"]
    return a


if __name__ == "__main__":
    cmd = argparse.ArgumentParser(description="write the shared inputs of the frameworks chapter")
    cmd.add_argument("command", choices=["make-inputs"])
    cmd.add_argument("path")
    print(make_inputs(cmd.parse_args().path))
