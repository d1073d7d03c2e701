"""The fault-tolerance chapter's rank functions (course/16): async checkpoints, the kill-a-rank lab,
and communication-efficient training against plain DDP.

Every function here is a rank function for :func:`minidist.run` (``fn(rank, world, ...)``) and
returns plain numbers, so the chapter and the tests compute and assert the same things:

- :func:`async_save_overlap`: ``torch.distributed.checkpoint.async_save`` next to the blocking
  ``dcp.save`` and minidist's own :func:`~minidist.data_parallel.save_checkpoint`: how long each
  blocks training, how many training steps run while the async save is written, and that the
  checkpoint holds the parameters *at the call* (staging copied them) though training went on.
- :func:`async_save_trap`: the deadlock public users hit (e.g. KempnerForge #104, a barrier on the
  default group while DCP's save thread runs its collectives on that same group): collectives from
  two threads on one process group are not ordered across ranks. With ``own_group=False`` rank 0's
  save thread is held back 3 s (a planner that sleeps), rank 1's main thread 1.5 s, so rank 0's
  ``all_reduce`` meets rank 1's save-planning gather: both wait forever. The fix (what torchtitan
  does): give ``async_save`` its own gloo group, ``dist.new_group(backend="gloo")``.
- :func:`dcp_replicated_trap`: a plain tensor with different values per rank under one key is
  saved once (DCP takes it to be replicated): every rank loads rank 0's values back.
- :func:`killed_mid_step`: a DDP step in which one rank SIGKILLs itself (the time of the kill is
  written to a file first, so the caller can measure the time to detect).
- :func:`communication_curves`: the same model, data and steps with plain DDP, PowerSGD (rank r)
  and DiLoCo (H inner steps): the loss every step and the bytes each rank sent.
- :func:`dcp_bridge`: a minidist ZeRO-3 model saved through ``torch.distributed.checkpoint``
  and loaded by torch FSDP2 (and back): the way from the course to torchtitan.
- :func:`resume_compressed`: PowerSGD and DiLoCo stopped mid-run, saved with their state
  (``save_checkpoint(states=...)``), resumed in a new launch: the final parameters, to compare
  with a run that never stopped, and with a resume that forgets their state.
"""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.nn.functional as F

__all__ = ["async_save_overlap", "async_save_trap", "dcp_replicated_trap", "killed_mid_step",
           "communication_curves", "resume_compressed", "dcp_bridge", "digits_mlp"]


def digits_mlp() -> torch.nn.Module:
    """The course MLP on the 8x8 digits: 64 -> 64 -> 10 (seed 0)."""
    from minidist.models import MLP
    torch.manual_seed(0)
    return MLP(64, (64,), 10)


# ----------------------------------------------------------------------------- async checkpoints
def _train_step(model, opt, ddp, step):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(16, model.net[0].in_features, generator=g), torch.randint(0, 10, (16,), generator=g)
    opt.zero_grad()
    F.cross_entropy(ddp(x), y).backward()
    opt.step()


def async_save_overlap(rank: int, world: int, path: str, numel: int = 4_000_000,
                       train_steps: int = 100) -> dict:
    """Seconds each save blocks the training loop, and the steps run during the async write.

    The state: the course MLP plus a ``numel``-float buffer per rank (the bulk of the bytes).
    After ``async_save`` returns, ``train_steps`` DDP steps run; ``steps_during_async`` counts
    those that started while the save was still being written (the minimum over ranks; the
    first one does whenever the call returns before the write ends, which is the point).
    Returns ``{"blocking_dcp_s", "minidist_s", "async_call_s", "async_total_s",
    "steps_during_async", "saved_equals_state_at_call", "changed_after_call"}``.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from minidist.data_parallel import BucketedDDP, save_checkpoint
    model = digits_mlp()
    ddp = BucketedDDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    bulk = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    # a key per rank: DCP takes a plain tensor under one key to be replicated (dcp_replicated_trap)
    state = {"model": model.state_dict(), f"bulk{rank}": bulk}
    out = {}
    t = time.perf_counter()
    dcp.save(state, checkpoint_id=os.path.join(path, "dcp-blocking"))
    out["blocking_dcp_s"] = time.perf_counter() - t
    t = time.perf_counter()
    save_checkpoint(os.path.join(path, "minidist"), ddp, opt, extra={"bulk": bulk})
    out["minidist_s"] = time.perf_counter() - t
    group = dist.new_group(backend="gloo")       # the save's own group (see async_save_trap)
    at_call = {k: v.clone() for k, v in model.state_dict().items()}
    t = time.perf_counter()
    fut = dcp.async_save(state, checkpoint_id=os.path.join(path, "dcp-async"), process_group=group)
    out["async_call_s"] = time.perf_counter() - t
    steps = 0
    for s in range(train_steps):                 # training goes on while the files are written
        steps += not fut.done()                  # (a fixed count: DDP steps are collective, and
        _train_step(model, opt, ddp, s)          # ranks may see the save finish at other times)
    fut.result()
    out["async_total_s"] = time.perf_counter() - t
    # ranks agree on how many steps they took (DDP steps are collective: they are equal anyway)
    n = torch.tensor([steps])
    dist.all_reduce(n, op=dist.ReduceOp.MIN)
    out["steps_during_async"] = int(n)
    loaded = {"model": {k: torch.zeros_like(v) for k, v in at_call.items()},
              f"bulk{rank}": torch.zeros_like(bulk)}
    dcp.load(loaded, checkpoint_id=os.path.join(path, "dcp-async"))
    out["saved_equals_state_at_call"] = all(torch.equal(loaded["model"][k], v) for k, v in
                                            at_call.items()) and torch.equal(loaded[f"bulk{rank}"], bulk)
    out["changed_after_call"] = any(not torch.equal(v, at_call[k])
                                    for k, v in model.state_dict().items())
    ddp.close()
    dist.destroy_process_group(group)
    return out


def async_save_trap(rank: int, world: int, path: str, own_group: bool) -> list[float]:
    """An ``async_save`` whose planning collectives and the main thread's ``all_reduce`` are
    issued in a different order on the two ranks; returns the all-reduce result (ones * 3 at W=2).
    With ``own_group=False`` (the default group for both) this deadlocks: run it with a short
    ``minidist.run`` timeout."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class LatePlanner(DefaultSavePlanner):
        """Rank 0's save thread reaches its planning gather 3 s late."""

        def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False):
            if dist.get_rank() == 0:
                time.sleep(3.0)
            return super().set_up_planner(state_dict, storage_meta, is_coordinator)

    group = dist.new_group(backend="gloo") if own_group else None
    fut = dcp.async_save({"w": torch.full((1000,), float(rank))}, checkpoint_id=path,
                         planner=LatePlanner(), process_group=group)
    if rank == 1:
        time.sleep(1.5)              # rank 1's save thread issues its collectives first
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t)               # e.g. a loss average, or a barrier after the save
    fut.result()
    return t.tolist()


def dcp_replicated_trap(rank: int, world: int, path: str) -> list[float]:
    """``dcp.save`` of a plain tensor that differs per rank under one key, then ``dcp.load``:
    DCP takes plain (non-DTensor) tensors to be replicated, writes one copy (rank 0's) and every
    rank loads it back — the other ranks' values are gone, silently. Returns what this rank loads."""
    import torch.distributed.checkpoint as dcp
    dcp.save({"x": torch.full((4,), float(rank))}, checkpoint_id=path)
    back = {"x": torch.zeros(4)}
    dcp.load(back, checkpoint_id=path)
    return back["x"].tolist()


# ----------------------------------------------------------------------------- the kill-a-rank lab
def killed_mid_step(rank: int, world: int, victim: int, step: int, stamp: str) -> None:
    """DDP training on the course MLP; rank ``victim`` SIGKILLs itself inside step ``step``
    (after its forward, before its gradients are all-reduced), having written ``time.time()`` to
    ``stamp``. The others then wait inside the all-reduce for a rank that is gone."""
    from minidist.data_parallel import BucketedDDP
    model = digits_mlp()
    ddp = BucketedDDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for s in range(step + 10):
        g = torch.Generator().manual_seed(100 * rank + s)
        x, y = torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)
        opt.zero_grad()
        loss = F.cross_entropy(ddp(x), y)
        if rank == victim and s == step:
            with open(stamp, "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        loss.backward()
        opt.step()


# ----------------------------------------------------------------------------- slow links
def communication_curves(rank: int, world: int, steps: int = 60, batch: int = 32,
                         powersgd_rank: int = 2, powersgd_start: int = 10, diloco_h: int = 10,
                         lr: float = 3e-3) -> dict:
    """Plain DDP, PowerSGD and DiLoCo on the same model (:func:`digits_mlp`), the same data (the
    digits training set, a seeded permutation split into per-rank batches) and the same inner
    optimizer (AdamW ``lr``). Per method: the local batch loss every step, the bytes this rank
    sent every step, and the final model's loss on the whole training set.

    DiLoCo's outer step: Nesterov SGD (lr 0.7, momentum 0.9), every ``diloco_h`` steps (use a
    ``steps`` that ``diloco_h`` divides, so the replicas are equal at the end)."""
    from minidist.comm import p2p
    from ..data import load_digits
    from minidist.data_parallel import BucketedDDP, DiLoCo, PowerSGD
    train, _ = load_digits()
    x_all, y_all = train.tensors
    perm = torch.randperm(len(y_all), generator=torch.Generator().manual_seed(0))
    out = {}
    for method in ("ddp", "powersgd", "diloco"):
        model = digits_mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        ddp = dl = None
        if method == "diloco":
            dl, net = DiLoCo(model, sync_every=diloco_h), model
        else:
            ddp = BucketedDDP(model)
            if method == "powersgd":
                ddp.register_comm_hook(PowerSGD(rank=powersgd_rank, start_iter=powersgd_start),
                                       PowerSGD.hook)
            net = ddp
        losses, sent = [], []
        for s in range(steps):
            i = (s * world + rank) * batch % (len(perm) - batch)
            idx = perm[i:i + batch]
            with p2p.count_traffic() as t:
                opt.zero_grad()
                loss = F.cross_entropy(net(x_all[idx]), y_all[idx])
                loss.backward()
                opt.step()
                if dl is not None:
                    dl.step()
            losses.append(loss.item())
            sent.append(t.bytes_sent)
        with torch.no_grad():
            final = F.cross_entropy(model(x_all), y_all).item()
        out[method] = dict(loss=losses, sent=sent, final_loss=final,
                           params=sum(p.numel() for p in model.parameters()))
        if ddp is not None:
            ddp.close()
    return out


def _compressed(method: str, lr: float):
    """``(model, net to call, inner optimizer, DiLoCo or None, {name: stateful})``."""
    from minidist.data_parallel import BucketedDDP, DiLoCo, PowerSGD
    model = digits_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    if method == "diloco":
        dl = DiLoCo(model, sync_every=10)
        return model, model, opt, dl, {"diloco": dl, "inner": opt}   # AdamW is local: per rank
    ddp = BucketedDDP(model)
    ps = PowerSGD(rank=2, start_iter=5)
    ddp.register_comm_hook(ps, PowerSGD.hook)
    return model, ddp, opt, None, {"powersgd": ps, "optimizer": opt}


def resume_compressed(rank: int, world: int, path: str, mode: str, steps: int = 30,
                      stop: int = 15, lr: float = 3e-3) -> dict:
    """PowerSGD (rank 2, from step 5) and DiLoCo (H = 10) on :func:`digits_mlp`, per-rank batches
    of the digits. ``mode``:

    * ``"straight"`` — ``steps`` steps; returns ``{method: final parameters}``;
    * ``"save"`` — ``stop`` steps, then first a save of the model alone (DiLoCo: refused, the
      replicas differ mid-round; the message is returned under ``"refused"``), then
      ``save_checkpoint(path/method, ..., states=...)``;
    * ``"resume"`` / ``"forget"`` — a new model (another seed), ``load_checkpoint`` with its
      states (or only the model and the optimizer: ``"forget"``), the remaining steps; returns
      the parameters.
    """
    from minidist.data_parallel import load_checkpoint, save_checkpoint
    from ..data import load_digits
    x_all, y_all = load_digits()[0].tensors
    out: dict = {}
    for method in ("powersgd", "diloco"):
        if mode in ("resume", "forget"):
            torch.manual_seed(1)                          # nothing of the first run survives
        model, net, opt, dl, states = _compressed(method, lr)
        folder = os.path.join(path, method)
        start, end = 0, steps if mode == "straight" else stop
        if mode in ("resume", "forget"):
            keep = states if mode == "resume" else {      # "forget": the optimizer only
                k: v for k, v in states.items() if k in ("optimizer", "inner")}
            load_checkpoint(folder, model, states=keep)
            start, end = stop, steps
        for s in range(start, end):
            g = torch.Generator().manual_seed(1000 * rank + s)
            idx = torch.randint(0, len(y_all), (32,), generator=g)
            opt.zero_grad()
            F.cross_entropy(net(x_all[idx]), y_all[idx]).backward()
            opt.step()
            if dl is not None:
                dl.step()
        if mode == "save":
            try:
                save_checkpoint(folder, model)
            except ValueError as e:
                out["refused"] = str(e)
            save_checkpoint(folder, model, states=states)
        if net is not model:
            net.close()
        out[method] = [p.detach().clone() for p in model.parameters()]
    return out


def dcp_bridge(rank: int, world: int, path: str, side: str) -> dict:
    """``side="minidist"``: :func:`digits_mlp` sharded by minidist's ZeRO-3, two AdamW steps,
    saved with :func:`minidist.sharding.dcp.save_dcp` to ``path``; ``side="fsdp2"``: the same
    model (another seed) sharded by torch's ``fully_shard``, loaded from ``path`` the way
    torchtitan loads (``get_model_state_dict`` / ``get_optimizer_state_dict``, ``dcp.load``,
    ``set_*``). Returns the full weights and AdamW step per parameter name."""
    import torch.distributed.checkpoint as dcp
    from minidist.sharding import fsdp, fsdp_state
    from minidist.sharding.dcp import save_dcp
    torch.manual_seed(0 if side == "minidist" else 1)
    from minidist.models import MLP
    model = MLP(64, (64,), 10)
    if side == "minidist":
        fsdp.fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for s in range(2):
            g = torch.Generator().manual_seed(100 * rank + s)
            opt.zero_grad()
            F.cross_entropy(model(torch.randn(16, 64, generator=g)),
                            torch.randint(0, 10, (16,), generator=g)).backward()
            opt.step()
        save_dcp(path, model, opt)
        osd = fsdp_state.full_optim_state_dict(model, opt)["state"]
        return {"weights": fsdp_state.full_state_dict(model),
                "step": {k: float(v["step"]) for k, v in osd.items()}}
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict,
                                                         set_model_state_dict,
                                                         set_optimizer_state_dict)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optimizer"])
    full = StateDictOptions(full_state_dict=True)
    weights = {k: v.detach().clone() for k, v in get_model_state_dict(model, options=full).items()}
    osd = get_optimizer_state_dict(model, opt, options=full)["state"]
    return {"weights": weights, "step": {k: float(v["step"]) for k, v in osd.items()}}
