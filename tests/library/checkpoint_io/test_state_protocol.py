"""Every stateful object resumes exactly through ``save_checkpoint(states=...)``.

One launch trains every case without stopping *and* saves each at step K; a second launch
rebuilds everything from another seed, loads, and continues: the parameters must be bitwise equal
to the run that never stopped (same layout, same order of sums). The cases are the field's
reports: PowerSGD's error feedback, Q and step (pytorch#75666 made torch's checkpointable), top-k
error feedback, DiLoCo's outer momentum at a round boundary and each rank's replica mid-round
(torchft PR #277 added the outer optimizer's state), a DiLoCo inner optimizer local to each rank.
The same launch checks the refusals: replicas that differ, an object that is not stateful or not
plain data, an object or a numpy scalar in ``extra`` (written, then unreadable under
``weights_only``, before this check) — on every rank, naming the object, before anything is
written.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import minidist
from minidist.checkpoint_io import generations, list_generations
from minidist.data_parallel import BucketedDDP, DiLoCo, PowerSGD, TopK
from minidist.data_parallel.checkpoint import load_checkpoint, save_checkpoint

STEPS, K = 6, 3                  # save after step K (3 of a DiLoCo round of 2: mid-round)


def _model(seed: int):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 5))


def _data(rank: int, step: int):
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(8, 12, generator=g), torch.randn(8, 5, generator=g)


def _build(case: str, seed: int):
    """``(model to step, optimizer, saved-with-optimizer=, states, after-step hook)``."""
    model = _model(seed)
    if case in ("powersgd", "topk"):
        ddp = BucketedDDP(model, bucket_cap_mb=0.0005)
        obj = (PowerSGD(rank=1, start_iter=1, min_compression_rate=0.0) if case == "powersgd"
               else TopK(ratio=0.2))
        ddp.register_comm_hook(obj, type(obj).hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return ddp, opt, opt, {case: obj}, lambda: None
    sync = 3 if case == "diloco-boundary" else 2           # K = 3: a boundary, or mid-round
    dl = DiLoCo(model, sync_every=sync, outer_lr=0.7, outer_momentum=0.9)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)  # local to each rank: per rank
    return model, inner, None, {"diloco": dl, "inner": inner}, dl.step


def _train(net, opt, after, rank, start, stop):
    for step in range(start, stop):
        x, y = _data(rank, step)
        opt.zero_grad()
        F.mse_loss(net(x), y).backward()
        opt.step()
        after()


def _params(net):
    inner = getattr(net, "module", net)
    return [p.detach().clone() for p in inner.parameters()]


def _expect_refusal(fn, *words) -> str:
    try:
        fn()
    except (ValueError, TypeError, RuntimeError) as e:
        missing = [w for w in words if w not in str(e)]
        return f"refusal does not name {missing}: {e}" if missing else ""
    return f"not refused (expected {words})"


CASES = ("powersgd", "topk", "diloco-boundary", "diloco-mid")


def _first(rank, world, root):
    out = {}
    for case in CASES:
        net, opt, saved_opt, states, after = _build(case, seed=0)
        _train(net, opt, after, rank, 0, K)
        folder = os.path.join(root, case)
        if case == "diloco-mid":              # the replicas differ here: refused unless DiLoCo
            out["refused-model"] = _expect_refusal(            # saves each rank's replica
                lambda: save_checkpoint(folder, net), "the model differs", "rank(s) [1]")
            out["refused-optimizer"] = _expect_refusal(
                lambda: save_checkpoint(folder, net, opt, states={"diloco": states["diloco"]}),
                "the optimizer differs", "states=")
            assert not generations(folder), "a refused save wrote something"
        save_checkpoint(folder, net, saved_opt, extra={"step": K}, states=states)
        if case == "powersgd":   # an object (or a numpy scalar) in extra: refused before writing,
            obj = states[case]   # the one good generation kept (keep=1 would have retired it)
            out["extra-object"] = _expect_refusal(
                lambda: save_checkpoint(folder, net, saved_opt, extra={"hook": obj}, keep=1),
                "extra['hook'] is a PowerSGD", "states=")
            out["extra-numpy"] = _expect_refusal(
                lambda: save_checkpoint(folder, net, saved_opt, extra={"loss": np.float64(0.5)}),
                "extra['loss'] is a float64", "numpy scalar")
        _train(net, opt, after, rank, K, STEPS)
        out[case] = _params(net)
    out["not-stateful"] = _expect_refusal(
        lambda: save_checkpoint(os.path.join(root, "x"), _model(0), states={"lr": 0.1}),
        "states['lr']", "no state_dict")

    class Pickled:
        def state_dict(self):
            return {"fn": len}

        def load_state_dict(self, state):
            pass

    out["not-plain"] = _expect_refusal(
        lambda: save_checkpoint(os.path.join(root, "x"), _model(0), states={"odd": Pickled()}),
        "states['odd']", "weights_only")
    return out


def _resume(rank, world, root):
    out = {}
    for case in CASES:
        net, opt, saved_opt, states, after = _build(case, seed=1)    # another start: load it
        extra = load_checkpoint(os.path.join(root, case), net, saved_opt, states=states)
        assert extra == {"step": K}
        _train(net, opt, after, rank, K, STEPS)
        out[case] = _params(net)
    return out


def test_every_stateful_object_resumes_bitwise_and_bad_saves_are_refused(tmp_path):
    root = str(tmp_path)
    straight = minidist.run(_first, 2, root, timeout=180)
    for rank, out in enumerate(straight):
        for key in ("refused-model", "refused-optimizer", "not-stateful", "not-plain",
                    "extra-object", "extra-numpy"):
            assert out[key] == "", f"rank {rank}, {key}: {out[key]}"
    resumed = minidist.run(_resume, 2, root, timeout=180)
    for rank in range(2):
        for case in CASES:
            diff = max((a - b).abs().max().item()
                       for a, b in zip(straight[rank][case], resumed[rank][case]))
            assert diff == 0.0, f"rank {rank}, {case}: the resumed run is {diff:.2e} off"
    # (the refusal of the model above shows the DiLoCo replicas really differ at step K)
    assert [g["status"] for g in list_generations(os.path.join(root, "powersgd"))] == ["verified"]


def _per_rank_elsewhere(rank, world, root):
    net, opt, saved_opt, states, after = _build("topk", seed=1)
    try:
        load_checkpoint(os.path.join(root, "topk"), net, saved_opt, states=states)
    except ValueError as e:
        return str(e)
    return "loaded"


def test_per_rank_state_is_refused_on_another_world_size(tmp_path):
    root = str(tmp_path)

    def save(rank, world):
        net, opt, saved_opt, states, after = _build("topk", seed=0)
        _train(net, opt, after, rank, 0, 2)
        save_checkpoint(os.path.join(root, "topk"), net, saved_opt, states=states)

    minidist.run(save, 2, timeout=120)
    msgs = minidist.run(_per_rank_elsewhere, 3, root, timeout=120)
    assert all("['topk'] are per rank, saved by 2 ranks; this run has 3" in m for m in msgs), msgs


@pytest.mark.parametrize("scope", ["replicated", "per_rank"])
def test_one_process_round_trip_and_scope(tmp_path, scope):
    class Counter:
        checkpoint_scope = scope

        def __init__(self):
            self.n = torch.zeros(())

        def state_dict(self):
            return {"n": self.n.clone()}

        def load_state_dict(self, state):
            self.n = state["n"].clone()

    c = Counter()
    c.n += 7
    save_checkpoint(tmp_path, torch.nn.Linear(2, 2), states={"c": c})
    files = sorted(os.listdir(generations(tmp_path)[-1][1]))
    assert files == ["checkpoint.pt", "manifest.json", "rank00000.pt"]
    fresh = Counter()
    load_checkpoint(tmp_path, torch.nn.Linear(2, 2), states={"c": fresh})
    assert fresh.n.item() == 7
    with pytest.raises(KeyError, match=r"holds no state for \['other'\]"):
        load_checkpoint(tmp_path, torch.nn.Linear(2, 2), states={"other": Counter()})


def _extra_in_every_kind(rank, world, root):
    import _ckpt_kinds as kinds
    from minidist.hybrid.checkpoint import save_hybrid_checkpoint
    out = {}
    for name, (setup, save, _, _) in kinds.KINDS.items():
        model, opt, _ = setup(rank, world, 0, 1)
        folder = os.path.join(root, name)
        if name == "3d":
            save = lambda p, m, o, extra: save_hybrid_checkpoint(p, m, o, step=1, extra=extra)  # noqa: E731
        out[name] = _expect_refusal(lambda: save(folder, model, opt, extra={"hook": PowerSGD()}),
                                    "extra['hook'] is a PowerSGD", f"(rank {rank})", "states=")
        out[name] += "" if not generations(folder) else " and a generation was written"
    return out


def test_extra_is_plain_data_in_every_checkpoint_kind(tmp_path):
    """DDP, ZeRO-1/2/3 (full and sharded) and the 3-D save all check ``extra`` on every rank before
    writing (each used to write it, then fail to load under ``weights_only``)."""
    for rank, out in enumerate(minidist.run(_extra_in_every_kind, 2, str(tmp_path), timeout=180)):
        assert all(v == "" for v in out.values()), f"rank {rank}: {out}"
