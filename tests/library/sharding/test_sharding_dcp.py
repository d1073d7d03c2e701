"""The bridge to torch's checkpoints: minidist ZeRO-3 ⇄ torch.distributed.checkpoint ⇄ FSDP2.

minidist at W = 2 saves with ``save_dcp``; torch FSDP2 at W = 3 loads it through
``get_model_state_dict`` / ``get_optimizer_state_dict`` + ``dcp.load`` (torchtitan's way), trains
on, saves with ``dcp.save``; minidist at W = 2 loads that. One process loads the first checkpoint
into the plain model with ``no_dist=True``. Every hand-over is compared bitwise: weights and the
AdamW moments and step, by parameter name. The model is the sharding tests' ``TiedLM``: a tied
embedding, a frozen parameter, a buffer, and no size divisible by 2 or 3 (so shards are uneven
and a rank's may be empty) — the cases field reports are about: loading another framework's
optimizer state into FSDP2 (pytorch/torchtitan#765, "shard index out of range"), and ranks whose
local shard is empty (NVIDIA/Megatron-LM PR #6215, DCP for Megatron-FSDP's optimizer).
"""

from __future__ import annotations

import os

import pytest
import torch

import minidist
from minidist.sharding import fsdp, fsdp_state
from minidist.sharding.dcp import load_dcp, save_dcp
from minidist_course.references.sharding import local_batch, loss_fn, make_model

dcp = pytest.importorskip("torch.distributed.checkpoint")


def _steps(model, opt, rank, world, start, n):
    for step in range(start, start + n):
        opt.zero_grad()
        x, y = local_batch(step, rank, world)
        loss_fn(model(x), y).backward()
        opt.step()


def _ours(seed):
    model = make_model(seed)
    for b in model.blocks:
        fsdp.fully_shard(b)
    fsdp.fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _full_ours(model, opt):
    return fsdp_state.full_state_dict(model), fsdp_state.full_optim_state_dict(model, opt)["state"]


def _minidist_saves(rank, world, path):
    model, opt = _ours(0)
    _steps(model, opt, rank, world, 0, 2)
    save_dcp(path, model, opt)
    return _full_ours(model, opt)


def _fsdp2_loads_trains_saves(rank, world, src, dst):
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict,
                                                         set_model_state_dict,
                                                         set_optimizer_state_dict)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (world,))
    model = make_model(seed=1)
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=src)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optimizer"])
    full = StateDictOptions(full_state_dict=True)

    def snapshot():                 # copies: the optimizer's step tensors change in place
        return _copy((get_model_state_dict(model, options=full),
                      get_optimizer_state_dict(model, opt, options=full)["state"]))

    loaded = snapshot()
    _steps(model, opt, rank, world, 2, 2)
    dcp.save({"model": get_model_state_dict(model),
              "optimizer": get_optimizer_state_dict(model, opt)}, checkpoint_id=dst)
    return loaded, snapshot()


def _copy(x):
    if isinstance(x, dict):
        return {k: _copy(v) for k, v in x.items()}
    if isinstance(x, tuple):
        return tuple(_copy(v) for v in x)
    return x.detach().clone() if torch.is_tensor(x) else x


def _minidist_loads(rank, world, path):
    model, opt = _ours(2)
    load_dcp(path, model, opt)
    return _full_ours(model, opt)


def _diff(a: dict, b: dict, what: str) -> None:
    assert set(a) == set(b), f"{what}: names differ: {sorted(set(a) ^ set(b))}"
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, dict):
            _diff(x, y, f"{what}[{k}]")
        else:
            assert torch.equal(torch.as_tensor(x).float(), torch.as_tensor(y).float()), \
                f"{what}[{k}] differs by {(torch.as_tensor(x) - torch.as_tensor(y)).abs().max()}"


def _no_frozen(optim_state: dict) -> dict:
    """Without frozen parameters (no state) and the tied head (minidist lists the tied weight
    under both names, torch's optimizer state dict under the first)."""
    return {k: v for k, v in optim_state.items() if v and k != "head.weight"}


@pytest.mark.timeout(300)
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")   # no_dist=True, on purpose
def test_minidist_fsdp2_round_trip_through_dcp_is_exact(tmp_path):
    ours_path, theirs_path = str(tmp_path / "minidist"), str(tmp_path / "fsdp2")
    saved = minidist.run(_minidist_saves, 2, ours_path, timeout=180)[0]
    loaded, trained = minidist.run(_fsdp2_loads_trains_saves, 3, ours_path, theirs_path,
                                   timeout=180)[0]
    _diff(loaded[0], saved[0], "FSDP2 loaded minidist's weights")
    _diff(_no_frozen(loaded[1]), _no_frozen(saved[1]), "FSDP2 loaded minidist's AdamW state")
    back = minidist.run(_minidist_loads, 2, theirs_path, timeout=180)[0]
    _diff(back[0], trained[0], "minidist loaded FSDP2's weights")
    _diff(_no_frozen(back[1]), _no_frozen(trained[1]), "minidist loaded FSDP2's AdamW state")
    assert not torch.equal(trained[0]["blocks.0.fc1.weight"], saved[0]["blocks.0.fc1.weight"])
    # one process, no process group: the plain model reads the sharded checkpoint
    plain = make_model(seed=3).state_dict()
    dcp.load({"model": plain}, checkpoint_id=ours_path, no_dist=True)
    _diff(dict(plain), saved[0], "one process loaded minidist's weights")
    assert os.path.exists(os.path.join(ours_path, ".metadata"))


def _flat(rank, world):
    model = make_model(0)
    fsdp.fully_shard(model, per_parameter=False)
    try:
        save_dcp("unused", model)
    except TypeError as e:
        return str(e)
    return "saved"


def test_the_flat_layout_is_refused_by_name():
    msgs = minidist.run(_flat, 2, timeout=120)
    assert all("flat layout (per_parameter=False)" in m for m in msgs), msgs

