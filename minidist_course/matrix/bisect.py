"""``minidist bisect``: one configuration of the composition matrix (its features as options) run by
:func:`minidist_course.references.bisect.bisect` against one process — the first tensor that diverges, its
rank and a diagnosis, then the next few; optionally with a bug of :mod:`minidist_course.zoo` injected.

    minidist bisect --dp 2 --tp 2 --bug dp-sum-not-average
    minidist bisect --cp ring/zigzag --loss per_token --steps 3
"""

from __future__ import annotations

import argparse
import functools
import sys

from minidist.hybrid import wrap_stages
from minidist_course.references.bisect import bisect

from .. import zoo
from ..references import hybrid as ref_hybrid
from .covering import DIMENSIONS, refusal, world_size
from .run import BATCH, _autocast_dtype, _cfg, _ignore, build

__all__ = ["run_bisect", "main"]


def _build(rank, world, config):
    model = build(config)
    return model, wrap_stages(model, config["dp_mode"])


def run_bisect(config: dict, steps: int = 2, bug: str | None = None, lr: float = 0.1):
    """The :class:`~minidist_course.references.bisect.Report` of one matrix configuration. A
    ``"sum"`` loss's gradient is the token count times a mean's: the SGD step between the compared
    steps takes ``lr`` per token then, so that every reduction moves the weights alike (a step
    hundreds of times larger leaves bf16's rounding budget by the second step)."""
    ids, targets = ref_hybrid.batch(BATCH, _cfg(config), _ignore(config))
    if config["loss"] == "sum":
        lr = lr / int((targets != -100).sum())
    return bisect(functools.partial(_build, config=config), world_size(config), ids, targets,
                  config["microbatches"], steps=steps, lr=lr,
                  context=functools.partial(zoo.inject, bug) if bug else None,
                  schedule=config["schedule"], dp_mode=config["dp_mode"],
                  loss_reduction=config["loss"], autocast_dtype=_autocast_dtype(config))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="minidist bisect", description="Run one configuration of "
                                "the training step and one process from the same seed and batch; "
                                "name the first tensor that leaves the one-process run (step, "
                                "forward / backward / gradients, rank, error against its budget) "
                                "and what its error looks like. Exit 1 when something diverges.")
    defaults = {"schedule": "1f1b", "dp_mode": "flat", "recompute": "none", "cp": "1", "tp": "1",
                "loss": "per_token", "dp": 2, "tie": False, "moe": "none", "precision": "fp32",
                "microbatches": 4}
    for dim, default in defaults.items():
        kind = int if dim in ("dp", "microbatches") else str
        p.add_argument("--" + dim.replace("_", "-"), default=default, type=kind,
                       choices=[v for v in DIMENSIONS[dim]] if kind is str and dim != "tie" else None,
                       help=f"one of {list(DIMENSIONS[dim])} (default {default})")
    p.add_argument("--steps", type=int, default=2, help="training steps compared (default 2)")
    p.add_argument("--bug", choices=sorted(zoo.BUGS), help="switch on a bug of the zoo")
    p.add_argument("--top", type=int, default=5, help="divergences shown (default 5)")
    a = p.parse_args(argv)
    config = {dim: getattr(a, dim) for dim in defaults}
    config["tie"] = str(config["tie"]).lower() in ("true", "1", "yes")
    words = refusal(config)
    if words is not None:
        print(f"minidist bisect: the library refuses this combination ({', '.join(words)})",
              file=sys.stderr)
        return 2
    print(f"bisect: {' '.join(f'{k}={v}' for k, v in config.items())} on {world_size(config)} "
          f"ranks, {a.steps} steps{f', bug {a.bug!r}' if a.bug else ''}", flush=True)
    report = run_bisect(config, a.steps, a.bug)
    for step, (par, one) in enumerate(report.losses):
        print(f"  step {step}: loss {par:.6f} (one process {one:.6f})")
    print(report.format(a.top))
    if a.bug and report.first is None:
        print(f"(the bug {a.bug!r} — {zoo.BUGS[a.bug][0]} — changes nothing in this "
              "configuration: choose one that uses what it breaks)")
    return 1 if report.first is not None else 0


if __name__ == "__main__":
    sys.exit(main())
