"""The resume matrix: every configuration of the composition matrix stopped, saved, rebuilt in a
new launch, loaded and continued must equal the run that never stopped — bitwise.

For each configuration (:mod:`.covering`; refused ones are skipped: the composition matrix checks
their refusal) the tiny GPT with dropout trains :data:`STEPS` steps with AdamW through
:func:`minidist.hybrid.train_step`; after step :data:`SAVE_AT` every rank saves with
:func:`~minidist.hybrid.checkpoint.save_hybrid_checkpoint` (its shards, the optimizer — ZeRO-1's
slices —, every generator and the dropout tracker, the data stream as a stateful object) and goes
on. A second launch builds everything again from another seed, loads and trains the remaining
steps. Every rank's parameters must be ``==`` to the first launch's: the layout and the order of
the sums are the same, so nothing may differ, not even in the last bit. Like the composition
matrix, one launch per world size runs its configurations, at most :data:`PER_LAUNCH` at a time
(two launches each: straight and resumed).
"""

from __future__ import annotations

import os
import time

import torch

import minidist
from minidist.hybrid import make_optimizer, train_step, wrap_stages
from minidist.hybrid.checkpoint import load_hybrid_checkpoint, save_hybrid_checkpoint
from minidist.tensor_parallel.random import grid_seed

from ..references import hybrid as ref_hybrid
from .covering import refusal, world_size
from .run import BATCH, _autocast_dtype, _cfg, _ignore, build, release

__all__ = ["STEPS", "SAVE_AT", "run_resume", "Batches"]

STEPS, SAVE_AT = 3, 2
PER_LAUNCH = 12   # configurations per launch (a launch holds their checkpoints' results in memory)
DROPOUT = 0.1


class Batches:
    """The global batch stream (the same on every rank); its position is its generator's state:
    a stateful object of the library's protocol (:mod:`minidist.state`)."""

    checkpoint_scope = "replicated"

    def __init__(self, config: dict):
        self.cfg, self.ignore = _cfg(config), _ignore(config)
        self.gen = torch.Generator().manual_seed(11)

    def next(self):
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=self.gen))
        return ref_hybrid.batch(BATCH, self.cfg, self.ignore, seed=seed)

    def state_dict(self) -> dict:
        return {"gen": self.gen.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.gen.set_state(state["gen"])


def _build(config: dict, seed: int):
    model = build(config, seed=seed, dropout=DROPOUT)
    grid_seed(1234 + seed, model.grid)
    modules = wrap_stages(model, config["dp_mode"])
    opt = make_optimizer(model, config["dp_mode"], torch.optim.AdamW, lr=1e-2)
    return model, modules, opt


def _one(config: dict, folder: str, resume: bool) -> list[torch.Tensor]:
    model, modules, opt = _build(config, seed=1 if resume else 0)
    data, start = Batches(config), 0
    if resume:
        start = load_hybrid_checkpoint(folder, model, opt, states={"data": data})["step"]
    for step in range(start, STEPS):
        ids, targets = data.next()
        train_step(model, opt, modules, ids, targets, config["microbatches"],
                   schedule=config["schedule"], dp_mode=config["dp_mode"],
                   loss_reduction=config["loss"], max_norm=ref_hybrid.MAX_NORM,
                   autocast_dtype=_autocast_dtype(config))
        if step + 1 == SAVE_AT and not resume:
            save_hybrid_checkpoint(folder, model, opt, step=SAVE_AT, states={"data": data})
    release(model, modules, opt)   # frees the groups' gloo threads before the next configuration
    return [p.detach().clone() for p in model.parameters()]


def _rank(rank, world, configs, folders, resume):
    return [_one(c, f, resume) for c, f in zip(configs, folders)]


def run_resume(configs: list[dict], root: str, timeout: float = 600, progress=None) -> list[dict]:
    """Run the resume check of every configuration that is not refused; each row is the config
    plus ``"world"``, ``"status"`` (``"✓"`` or ``"✗"``) and ``"detail"`` (the largest difference
    and where). Checkpoints go under ``root``."""
    by_world: dict[int, list[tuple[int, dict]]] = {}
    for i, c in enumerate(configs):
        if refusal(c) is None:
            by_world.setdefault(world_size(c), []).append((i, c))
    rows = []
    launches = [(w, by_world[w][i:i + PER_LAUNCH]) for w in sorted(by_world)
                for i in range(0, len(by_world[w]), PER_LAUNCH)]
    for w, chunk in launches:
        start = time.perf_counter()
        todo = [c for _, c in chunk]
        folders = [os.path.join(root, f"config{i:03d}") for i, _ in chunk]
        straight = minidist.run(_rank, w, todo, folders, False, timeout=timeout)
        resumed = minidist.run(_rank, w, todo, folders, True, timeout=timeout)
        for j, c in enumerate(todo):
            worst, where = 0.0, ""
            for r in range(w):
                for k, (a, b) in enumerate(zip(straight[r][j], resumed[r][j])):
                    d = (a - b).abs().max().item() if a.numel() else 0.0
                    if d > worst or (d != d):
                        worst, where = d, f"rank {r}, parameter {k}"
            ok = worst == 0.0
            rows.append({**c, "world": w, "status": "✓" if ok else "✗",
                         "detail": "bitwise equal" if ok else f"{worst:.2e} off at {where}"})
        if progress:
            progress(f"W={w}: {len(todo)} configurations stopped, resumed and compared in "
                     f"{time.perf_counter() - start:.0f} s")
    return rows
