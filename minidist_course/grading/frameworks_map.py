"""Grade exercise 10: a framework's construct → its minidist counterpart, and two traps in numbers.

* ``framework_map()`` → ``{construct: choice}`` for every construct of :data:`CONSTRUCTS`, each
  choice one of :data:`CHOICES`. The minidist names are built from the library's own objects
  (``ShardedOptimizer.__name__``, ``fully_shard.__name__``, ...), so a renamed API breaks this
  grader loudly instead of keeping a stale answer; the construct → name answers are chapter 10's
  table (DeepSpeed ZeRO stage s is chapter 09's ZeRO-s, ZeRO (Rajbhandari et al. 2020) §5).
* ``logged_loss(worker_losses)``: what tf_keras' ``model.fit`` logs under
  ``MultiWorkerMirroredStrategy`` when every worker holds an equal share of the global batch: the
  global mean loss (the mean of the workers' means) times the number of workers.
* ``clip_factor(grad_norm, max_norm=1.0)`` → ``(changes, factor)``: whether gradient clipping at
  ``max_norm`` (DeepSpeed's default ``gradient_clipping`` 1.0) changes the update of a gradient with
  that total L2 norm, and the factor the gradient is multiplied by. Graded against
  ``torch.nn.utils.clip_grad_norm_`` on a gradient of that norm (relative tolerance 1e-5, so the
  1e-6 its denominator adds does not matter).
"""

from __future__ import annotations

import torch

from minidist import collectives, env, launch
from minidist.data_parallel import BucketedDDP, broadcast_module
from minidist.grid import ProcessGrid
from minidist.sharding import ShardedOptimizer, fully_shard
from .core import Report
from .generated import generated_check, st

__all__ = ["CHOICES", "CONSTRUCTS", "grade_framework_map", "grade_logged_loss",
           "grade_clip_factor", "CLIP_NORMS"]

_STAGE = "stage"
assert _STAGE in ShardedOptimizer.__init__.__code__.co_varnames, "ShardedOptimizer lost stage="

DDP = BucketedDDP.__name__
BROADCAST = broadcast_module.__name__
ZERO1 = f"{ShardedOptimizer.__name__}({_STAGE}=1)"
ZERO2 = f"{ShardedOptimizer.__name__}({_STAGE}=2)"
ZERO3 = fully_shard.__name__
ALL_REDUCE = f"collectives.{collectives.all_reduce.__name__}"
RUN = f"minidist.{launch.run.__name__}"
DETECT = f"env.{env.detect.__name__}"
GRID = ProcessGrid.__name__

CHOICES = [DDP, BROADCAST, ZERO1, ZERO2, ZERO3, ALL_REDUCE, RUN, DETECT, GRID]

# construct -> (expected choice, why)
CONSTRUCTS = {
    "torch DistributedDataParallel": (DDP, "hooks on the gradients, buckets, averaged all-reduce"),
    "hvd.DistributedOptimizer": (DDP, "it averages the gradients with bucketed all-reduces "
                                      "(Horovod's 'tensor fusion') hooked on the gradients"),
    "hvd.broadcast_parameters": (BROADCAST, "rank 0's parameters copied to every rank at start"),
    "fleet.distributed_model": (DDP, "Paddle's data-parallel wrapper"),
    "DeepSpeed zero_optimization.stage 0": (DDP, "stage 0 shards nothing: plain data parallelism"),
    "DeepSpeed zero_optimization.stage 1": (ZERO1, "the optimizer state is sharded"),
    "DeepSpeed zero_optimization.stage 2": (ZERO2, "optimizer state and gradients are sharded "
                                                   "(gradients reduce-scattered)"),
    "DeepSpeed zero_optimization.stage 3": (ZERO3, "parameters are sharded too and all-gathered "
                                                   "per unit: ZeRO-3"),
    "FSDP2 fully_shard": (ZERO3, "ZeRO-3 with one all-gather unit per wrapped layer"),
    "tf.distribute replica context all_reduce('sum', grads)": (
        ALL_REDUCE, "each replica calls an all-reduce on its own gradients"),
    "TF_CONFIG": (DETECT, "it tells a process the cluster and its own index, like RANK / "
                          "WORLD_SIZE / MASTER_ADDR"),
    "Paddle hybrid topology (dp, mp, pp degrees)": (GRID, "one process group per dimension"),
    "torchrun": (RUN, "a launcher: it starts one process per rank"),
    "horovodrun": (RUN, "a launcher: it starts one process per rank"),
    "paddle.distributed.launch": (RUN, "a launcher: it starts one process per rank"),
}


MAP_RULES = {
    "dp": "DDP under every name (torch DDP, Horovod's optimizer, Fleet's model, ZeRO stage 0) is "
          "BucketedDDP",
    "zero": "ZeRO stages 1 and 2 shard the optimizer (and gradients); stage 3 and FSDP2 shard the "
            "parameters too (fully_shard)",
    "collective": "a broadcast of the parameters and a replica's all-reduce are collectives",
    "launch": "launchers start one process per rank (minidist.run); TF_CONFIG is the launch "
              "environment (env.detect)",
    "grid": "Paddle's hybrid topology is a process grid, one group per dimension",
}
_MAP_RULE = {}
LOSS_RULES = {
    "times_w": "the loss a worker logs is W x the true global loss (each worker divides its loss "
               "by the global batch, then the sum is logged)",
    "mean": "the true global loss is the mean of the workers' losses (equal shares)",
}
CLIP_RULES = {
    "shrink": "clipping only shrinks: below max_norm the factor is 1",
    "factor": "above max_norm the factor is max_norm / norm (torch.nn.utils.clip_grad_norm_)",
    "changes": "changes is True exactly when the factor is below 1",
}


def _map_rule(want: str) -> str:
    if want in ("BucketedDDP",):
        return "dp"
    if want.startswith(("ShardedOptimizer", "fully_shard")):
        return "zero"
    if want in ("minidist.run", "env.detect"):
        return "launch"
    if want == "ProcessGrid":
        return "grid"
    return "collective"


def grade_framework_map(fn, total: float = 6) -> Report:
    """``fn()`` → ``{construct: choice}`` against :data:`CONSTRUCTS`."""
    report = Report("Part A: the same ideas under other names", total=total, rules=MAP_RULES)

    def one(construct):
        got = fn()
        if not isinstance(got, dict):
            return f"framework_map() should return a dict {{construct: choice}}, got {got!r}"
        want, why = CONSTRUCTS[construct]
        choice = got.get(construct)
        if choice is None:
            return f"no answer for {construct!r} (expected {want!r})"
        if choice not in CHOICES:
            return f"{choice!r} is not one of CHOICES {CHOICES}"
        if choice != want:
            return f"expected {want!r}, got {choice!r}: {why}"
        return None

    for construct in CONSTRUCTS:
        report.check(construct, lambda c=construct: one(c), rule=_map_rule(CONSTRUCTS[construct][0]))
    return report


LOSS_CASES = [[2.0, 2.0], [1.5, 0.5], [0.9, 1.1, 1.3, 0.7], [0.25], [0.2, 0.4, 0.6]]


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def grade_logged_loss(fn, total: float = 2) -> Report:
    """``fn(worker_losses)`` against the global mean times the number of workers."""
    report = Report("Part B: the loss a worker logs", total=total, rules=LOSS_RULES,
                    default_rule="mean")

    def one(losses):
        w = len(losses)
        true = sum(losses) / w
        want = true * w
        got = fn(list(losses))
        if not _number(got):
            return f"expected a number, got {type(got).__name__} {got!r}"
        if abs(got - want) <= 1e-9 * max(1.0, abs(want)):
            return None
        text = f"workers' losses {losses}: expected {want:g}, got {got:g}"
        if w > 1 and abs(got - true) <= 1e-9 * max(1.0, true):
            text += f" — that is the true global loss; the logged one is {w}x it (W = {w} workers)"
            return "times_w", text
        elif w > 1 and abs(got - true / w) <= 1e-9:
            text += " — divided by W instead of multiplied"
            return "times_w", text
        return "mean", text

    for losses in LOSS_CASES:
        report.check(f"{len(losses)} worker(s): {losses}", lambda ls=losses: one(ls))
    generated_check(report, "1 to 8 workers' losses", st.lists(
        st.floats(0.0, 20.0), min_size=1, max_size=8), one, max_examples=50,
        describe=lambda ls: f"losses {ls}", crash_rule="mean")
    return report


CLIP_NORMS = [0.0, 0.3, 0.999, 2.5, 40.0]


def _torch_factor(norm: float, max_norm: float) -> float:
    """The factor ``torch.nn.utils.clip_grad_norm_`` multiplies a gradient of this norm by."""
    g = torch.zeros(4, dtype=torch.float64)
    g[0] = norm
    p = torch.zeros(4, dtype=torch.float64, requires_grad=True)
    p.grad = g.clone()
    torch.nn.utils.clip_grad_norm_([p], max_norm)
    return float(p.grad[0] / norm) if norm else 1.0


def grade_clip_factor(fn, total: float = 3) -> Report:
    """``fn(grad_norm, max_norm)`` → ``(changes, factor)`` against ``clip_grad_norm_``."""
    report = Report("Part C: does default clipping change the update?", total=total,
                    rules=CLIP_RULES, default_rule="factor")

    def one(norm, max_norm):
        want = _torch_factor(norm, max_norm)
        changes = want < 1 - 1e-5
        got = fn(norm, max_norm)
        if not (isinstance(got, tuple) and len(got) == 2):
            return f"expected a tuple (changes, factor), got {got!r}"
        got_changes, got_factor = got
        if not _number(got_factor):
            return f"factor: expected a number, got {got_factor!r}"
        if abs(got_factor - want) > 1e-5 * want:
            hint = ""
            if norm and norm < max_norm and abs(got_factor - max_norm / norm) < 1e-9:
                hint = (" — below max_norm the gradient is left alone: clipping only shrinks "
                        "(factor min(1, max_norm / norm))")
            return ("shrink" if norm <= max_norm else "factor"), (
                f"grad norm {norm:g}, max_norm {max_norm:g}: factor expected {want:.6g} "
                f"(torch.nn.utils.clip_grad_norm_), got {got_factor:.6g}{hint}")
        if bool(got_changes) != changes or not isinstance(got_changes, bool):
            return "changes", (f"grad norm {norm:g}, max_norm {max_norm:g}: changes expected "
                               f"{changes}, got {got_changes!r}")
        return None

    for norm in CLIP_NORMS:
        report.check(f"grad norm {norm:g}, max_norm 1.0", lambda n=norm: one(n, 1.0))
    report.check("grad norm 3, max_norm 5 (a config that sets 5.0)", lambda: one(3.0, 5.0))
    report.check("grad norm 12, max_norm 5", lambda: one(12.0, 5.0))   # max_norm / norm, not 1 / norm
    # not within 1e-4 of max_norm, where torch's eps (max_norm / (norm + 1e-6)) decides "changes"
    cases = st.tuples(st.floats(0.0, 100.0), st.floats(0.1, 10.0)).filter(
        lambda c: abs(c[0] - c[1]) > 1e-4 * c[1])
    generated_check(report, "grad norms and max_norms", cases, lambda c: one(*c), max_examples=50,
                    describe=lambda c: f"grad norm {c[0]!r}, max_norm {c[1]!r}", crash_rule="factor")
    return report
