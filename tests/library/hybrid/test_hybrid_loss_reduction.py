"""A loss reduced over micro-batches and DP replicas equals the global batch's, for every reduction.

DP=2 x PP=2 (1F1B with 3 uneven micro-batches, and interleaved 1F1B with 4), a token classifier
(embedding, MLP, vocabulary head) with cross-entropy, compared with one process on the global
batch (12 sequences of 5 tokens):

* ``"mean"`` over samples: micro-batch means weighted ``n_m/N`` (the engine's default);
* ``"sum"``: micro-batch sums, summed over replicas (the DP average is undone);
* ``"per_token"`` with ``ignore_index=-100`` on about half the positions, spread unevenly:
  ``loss_fn`` returns ``(sum, count)`` and the gradients are divided by the global count
  (Megatron-Core's ``calculate_per_token_loss``), also when one replica counts no token at all.

The engine alone (no DP) and its composition with DP (``minidist.hybrid.dp_pipeline``) both.

And the trap: a per-micro-batch token mean weighted ``n_m/N`` is *not* the global token mean when
micro-batches hold different numbers of counted tokens — the test asserts it differs (by more than
1e-3 relative here) while ``"per_token"`` matches to 1e-6.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import minidist
from minidist.grid import ProcessGrid
from minidist.pipeline_parallel import make_schedule
from minidist.hybrid.dp_pipeline import dp_pipeline_step
from minidist.pipeline_parallel.engine import local_stages, pipeline_step

V, H, N, S = 11, 8, 12, 5
TOL = 1e-6


class Flat(nn.Module):
    """[b, s, h] -> [b·s, h]: the head's logits meet flattened targets."""

    def forward(self, x):
        return x.reshape(-1, x.shape[-1])


def make_model():
    torch.manual_seed(2)
    return nn.Sequential(nn.Embedding(V, H), nn.Linear(H, H), nn.Tanh(), nn.Linear(H, H),
                         nn.Tanh(), nn.Linear(H, V), Flat())


def make_batch():
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, V, (N, S), generator=g)
    targets = torch.randint(0, V, (N, S), generator=g)
    ignore = torch.rand(N, S, generator=g) < torch.linspace(0.0, 0.9, N).unsqueeze(1)
    return ids, targets, targets.masked_fill(ignore, -100)


LOSS_FNS = {
    "mean": lambda y, t: F.cross_entropy(y, t.reshape(-1)),
    "sum": lambda y, t: F.cross_entropy(y, t.reshape(-1), reduction="sum"),
    "per_token": lambda y, t: (F.cross_entropy(y, t.reshape(-1), reduction="sum"),
                               (t != -100).sum()),
    # the trap: each micro-batch's token mean, weighted by its share of the samples
    "token-mean-weighted-by-samples": lambda y, t: F.cross_entropy(y, t.reshape(-1)),
}
ENGINE_REDUCTION = {"mean": "mean", "sum": "sum", "per_token": "per_token",
                    "per_token/replica-empty": "per_token", "token-mean-weighted-by-samples": "mean"}
LOSS_FNS["per_token/replica-empty"] = LOSS_FNS["per_token"]


def ignored_targets(kind, ignored):
    """"per_token/replica-empty": replica 1 (the second half of the batch) counts no token at all."""
    if kind == "per_token/replica-empty":
        ignored = ignored.clone()
        ignored[N // 2:] = -100
    return ignored


def split_model(model, n):
    layers = list(model)
    bounds = [(0, 2), (2, 4), (4, 5), (5, 7)] if n == 4 else [(0, 3), (3, 7)]
    return [nn.Sequential(*layers[a:b]) for a, b in bounds]


def _rank(rank, world, kind, name, M):
    grid = ProcessGrid(dp=2, pp=2)
    schedule = make_schedule(name, 2, M, v=2)
    model = make_model()
    mods = local_stages(split_model(model, schedule.n_stages), schedule, grid.pp_rank)
    ids, targets, ignored = make_batch()
    t = targets if kind in ("mean", "sum") else ignored_targets(kind, ignored)
    ids, t = ids.tensor_split(2)[grid.dp_rank], t.tensor_split(2)[grid.dp_rank]
    res = dp_pipeline_step(schedule, mods, ids, t, LOSS_FNS[kind], grid.pp_group, grid.dp_group,
                           loss_reduction=ENGINE_REDUCTION[kind])
    mine = {id(p) for m in mods.values() for p in m.parameters()}
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if id(p) in mine}
    return res.global_loss, res.tokens, grads


def reference(kind):
    model = make_model()
    ids, targets, ignored = make_batch()
    y = model(ids)
    if kind == "mean":
        loss = F.cross_entropy(y, targets.reshape(-1))
    elif kind == "sum":
        loss = F.cross_entropy(y, targets.reshape(-1), reduction="sum")
    else:
        ignored = ignored_targets(kind, ignored)
        loss = F.cross_entropy(y, ignored.reshape(-1))   # mean over the counted tokens
    loss.backward()
    return loss.item(), {k: p.grad for k, p in model.named_parameters()}, int((ignored != -100).sum())


def worst_error(results, ref):
    got = {}
    for _, _, grads in results:
        for k, g in grads.items():
            if k in got:
                assert torch.equal(got[k], g), f"DP replicas differ on {k}"
            got[k] = g
    assert set(got) == set(ref)
    return max(((got[k] - ref[k]).norm() / ref[k].norm()).item() for k in ref)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind,name,M", [
    (kind, name, M) for kind in ("mean", "sum", "per_token") for name, M in (("1f1b", 3), ("interleaved", 4))
] + [("per_token/replica-empty", "1f1b", 3)])   # a replica with no counted token: no nan, no 0/0
def test_reduction_equals_global_batch(kind, name, M):
    results = minidist.run(_rank, 4, kind, name, M, timeout=90)
    ref_loss, ref, count = reference(kind)
    assert worst_error(results, ref) <= TOL
    for global_loss, tokens, _ in results:
        if kind == "mean":
            assert global_loss is None and tokens is None   # "mean" adds no collective
        else:
            assert global_loss == pytest.approx(ref_loss, rel=TOL)
            assert tokens == (count if kind.startswith("per_token") else None)


@pytest.mark.timeout(120)
def test_token_mean_weighted_by_samples_is_wrong_with_ignored_positions():
    results = minidist.run(_rank, 4, "token-mean-weighted-by-samples", "1f1b", 3, timeout=90)
    _, ref, _ = reference("per_token")
    assert worst_error(results, ref) > 1e-3, "the n_m/N weighting should miss the token mean"


@pytest.mark.timeout(90)
def test_unknown_reduction_and_bad_loss_fn_are_errors():
    def fn(rank, world, reduction, loss_fn, composed=False):
        model = make_model()
        schedule = make_schedule("1f1b", 1, 2)
        mods = {0: model}   # one stage: the whole model
        ids, targets, _ = make_batch()
        if composed:   # with DP (here a DP group of one): the composition checks its loss_fn too
            dp_pipeline_step(schedule, mods, ids, targets, loss_fn, None, None,
                             loss_reduction=reduction)
        else:
            pipeline_step(schedule, mods, ids, targets, loss_fn, loss_reduction=reduction)
    with pytest.raises(minidist.RankError, match="loss_reduction must be one of"):
        minidist.run(fn, 1, "median", LOSS_FNS["mean"], timeout=30)
    with pytest.raises(minidist.RankError, match=r"pipeline_step \(rank 0\).*needs loss_fn to return \(sum, count\)"):
        minidist.run(fn, 1, "per_token", LOSS_FNS["mean"], timeout=30)
    with pytest.raises(minidist.RankError, match=r"dp_pipeline_step \(rank 0\).*needs loss_fn to return \(sum, count\)"):
        minidist.run(fn, 1, "per_token", LOSS_FNS["mean"], True, timeout=30)
