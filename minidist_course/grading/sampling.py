"""Grade exercise 05: a distributed sampler against torch's, and an exact distributed evaluation
against one process.

* ``MySampler(n, num_replicas, rank, shuffle=True, seed=0)`` with ``set_epoch(epoch)``, ``__iter__``
  and ``__len__``: the same indices, in the same order, as ``torch.utils.data.DistributedSampler``
  (drop_last=False): shuffle with a generator seeded ``seed + epoch``, pad by wrapping around to a
  multiple of W, then rank r takes every W-th index from r. Checked for n = 10, 12, 3, 2 and 1
  (fewer samples than ranks, and padding longer than the data set: 1 sample on 4 ranks pads 3,
  so repeating the order once is not enough), W = 1..7, two epochs, with and without shuffling.
* ``evaluate_exact(model, x, y, rank, world_size)`` → ``(correct, count, loss_sum)`` over the whole
  data set, identical on every rank: each sample counted exactly once (no padding), integer counts
  all-reduced. Compared with one process on the full data, including a data set of 3 samples on 4
  ranks (one rank evaluates nothing but must still join the all-reduce).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DistributedSampler as TorchSampler

from .core import Report, check_on_ranks, tagged
from .generated import generated_check, generated_on_ranks, st

__all__ = ["grade_sampler", "grade_evaluation", "eval_model", "eval_data", "SAMPLER_RULES",
           "EVAL_RULES"]

SAMPLER_RULES = {
    "pad": "pad by wrapping around to a multiple of W, as often as needed (the padding may be "
           "longer than the data set): ceil(n / W) indices on every rank, as many as len() says",
    "epoch": "shuffle with a generator seeded seed + epoch: set_epoch changes the order",
    "order": "shuffle first, then pad, then rank r takes every W-th index from r",
    "equal": "the indices of torch's DistributedSampler (drop_last=False), in its order",
}
EVAL_RULES = {
    "once": "every sample counted exactly once (no padded training sampler)",
    "reduce": "counts and sums all-reduced: the whole data set's numbers on every rank",
    "join": "a rank with no samples still joins the all-reduce",
    "loss": "loss_sum is the sum of the per-sample losses (not a mean)",
}

# (n, W); (1, 4) and (2, 7) pad more than n: wrapping around once leaves ranks empty
_CASES = [(10, 4), (12, 3), (10, 1), (3, 4), (1, 2), (1, 4), (2, 7)]


def _torch_indices(n, w, r, shuffle, epoch):
    s = TorchSampler(range(n), num_replicas=w, rank=r, shuffle=shuffle, seed=0)
    s.set_epoch(epoch)
    return list(s)


def _check_sampler(cls, n, w, shuffle):
    for epoch in (0, 1):
        for r in range(w):
            s = cls(n, w, r, shuffle=shuffle, seed=0)
            s.set_epoch(epoch)
            got = [int(i) for i in s]
            want = _torch_indices(n, w, r, shuffle, epoch)
            if len(s) != len(want):
                return "pad", (f"n={n}, W={w}, rank {r}: len() is {len(s)}, expected {len(want)} "
                               f"(ceil(n / W): every rank takes the same number of steps)")
            if len(got) != len(s):
                return "pad", (f"n={n}, W={w}, rank {r}, epoch {epoch}: len() says {len(s)} but "
                               f"the iterator gives {len(got)} indices {got}: the ranks would "
                               "take different numbers of steps and the first collective hangs"
                               + (f" (the padding is {w * len(want) - n}, more than the {n} "
                                  "sample(s): repeat the order as often as needed, not once)"
                                  if w * len(want) - n > n else ""))
            if got != want:
                rule = "equal"
                if epoch and got == _torch_indices(n, w, r, shuffle, 0):
                    why, rule = " (epoch 0's order again: seed the shuffle with seed + epoch)", \
                        "epoch"
                elif sorted(got) == sorted(want):
                    why, rule = (" (same indices, another order: shuffle before padding and "
                                 "splitting?)"), "order"
                elif len(got) != len(want):
                    why = (f" ({len(got)} indices, expected {len(want)}: pad by wrapping around "
                           "to a multiple of W)")
                    rule = "pad"
                elif not shuffle and got == sorted(got) and len(set(got)) == len(got):
                    why, rule = " (contiguous blocks? rank r takes every W-th index from r)", \
                        "order"
                else:
                    why = ""
                return rule, (f"n={n}, W={w}, rank {r}, epoch {epoch}, shuffle={shuffle}: indices "
                              f"{got}, torch's DistributedSampler gives {want}{why}")
    return None


def grade_sampler(cls, total: float = 4) -> Report:
    """``cls(n, num_replicas, rank, shuffle, seed)`` against torch's DistributedSampler."""
    report = Report("Part A: MySampler against torch's DistributedSampler", total=total,
                    rules=SAMPLER_RULES)
    for shuffle in (False, True):
        for n, w in _CASES:
            note = " (fewer samples than ranks)" if n < w else ""
            report.check(f"n={n}, W={w}, shuffle={shuffle}{note}",
                         lambda n=n, w=w, s=shuffle: _check_sampler(cls, n, w, s))
    generated_check(report, "n = 1-100 samples, W = 1-8, shuffled or not",
                    st.tuples(st.integers(1, 100), st.integers(1, 8), st.booleans()),
                    lambda c: _check_sampler(cls, *c), max_examples=40,
                    describe=lambda c: "n={}, W={}, shuffle={}".format(*c), crash_rule="equal")
    return report


# --------------------------------------------------------------------------- evaluation
def eval_model() -> nn.Module:
    """A fixed classifier: 4 features, 3 classes."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def eval_data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` samples: x [n, 4] float32, y [n] int64 in 0..2."""
    g = torch.Generator().manual_seed(n)
    return torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)


def _one_process(n):
    model, (x, y) = eval_model(), eval_data(n)
    with torch.no_grad():
        logits = model(x)
    return (int((logits.argmax(1) == y).sum()), n,
            float(F.cross_entropy(logits, y, reduction="sum")))


def _check_eval(rank, world, fn, n):
    x, y = eval_data(n)
    got = fn(eval_model(), x, y, rank, world)
    if not isinstance(got, (tuple, list)) or len(got) != 3:
        return tagged(EVAL_RULES, "reduce", "evaluate_exact should return (correct, count, "
                                            f"loss_sum), got {got!r}")
    correct, count, loss_sum = (float(v) for v in got)
    want_c, want_n, want_l = _one_process(n)
    if count != want_n:
        if count > want_n:
            return tagged(EVAL_RULES, "once", f"count {count:g}, expected {want_n} = every sample "
                                              "once (samples counted twice: a padded training "
                                              "sampler?)")
        return tagged(EVAL_RULES, "reduce", f"count {count:g}, expected {want_n} = every sample "
                                            "once (the other ranks' counts are missing: "
                                            "all-reduce them)")
    if correct != want_c:
        return tagged(EVAL_RULES, "reduce", f"correct {correct:g}, one process on all {n} samples "
                                            f"gives {want_c}")
    if abs(loss_sum - want_l) > 1e-4 * max(1.0, abs(want_l)):
        return tagged(EVAL_RULES, "loss", f"loss_sum {loss_sum:.6f}, one process gives "
                                          f"{want_l:.6f} (sum of per-sample losses)")
    return None


def grade_evaluation(fn, total: float = 4, timeout: float = 20.0) -> Report:
    """``fn(model, x, y, rank, world_size)`` on W ranks against one process on all samples."""
    report = Report("Part B: exact distributed evaluation", total=total, rules=EVAL_RULES)
    check_on_ranks("10 samples", _check_eval, (1, 2, 3, 4), fn, 10, timeout=timeout, report=report,
                   rule="reduce")
    check_on_ranks("3 samples (fewer than ranks)", _check_eval, (4,), fn, 3, timeout=timeout,
                   report=report, rule="join")
    generated_on_ranks(report, "0-60 samples", _check_eval, st.integers(0, 60), 8, args=(fn,),
                       describe=lambda n: f"{n} samples", timeout=timeout, rule="reduce")
    return report
