"""The user-loop matrix: the library's wrappers called from a user's own training loop, against one
process on the global batch and against torch's own wrapper in the same launch.

The composition matrix (:mod:`.run`) drives the library through its own training step. Users
write their own loop instead, and that is where wrappers break: an evaluation forward between
backward and step, a reentrant checkpoint inside the model, a state dict taken mid-accumulation.
A cell is (a user-written module, a wrapper, a loop event):

* **modules** (:mod:`.user_models`: :data:`MODELS`, or drawn by hypothesis in the tests);
* **wrappers** (:data:`WRAPPERS`): NaiveDDP, FlatDDP, BucketedDDP (small buckets; with
  ``find_unused_parameters``), ZeRO-1/2, ``fully_shard`` per parameter and flat, resharding after
  forward or not, HSDP, ``replicate``; torch's DDP and FSDP2 (:data:`TORCH`) run beside them;
* **events** (:data:`EVENTS`): see each one's line below.

Every cell trains :data:`STEPS` steps of AdamW and must give the one-process weights, evaluation
outputs and mid-accumulation state dicts, or be refused by name (:mod:`.user_verdicts`).
``minidist matrix --user-loop`` prints the table.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import tempfile

import torch
import torch.nn.functional as F

from .user_models import BASE, BATCH, MODELS, UserNet, batch
from .user_verdicts import TOL, format_table, judge, torch_fails

__all__ = ["MODELS", "WRAPPERS", "TORCH", "EVENTS", "TOL", "STEPS", "cells", "run_cells", "train",
           "reference", "judge", "format_table"]

STEPS = 3
WRAPPERS = ("naive", "flat", "bucketed", "bucketed-unused", "zero1", "zero2", "fsdp", "fsdp-keep",
            "fsdp-flat", "fsdp-flat-keep", "hsdp", "replicate")
TORCH = ("torch-ddp", "torch-fsdp2", "torch-fsdp2-keep")
EVENTS = {
    "plain": "forward, backward, step",
    "eval after step": "a torch.no_grad() evaluation forward after every step",
    "eval before step": "a torch.no_grad() evaluation forward between backward and step",
    "inference_mode eval": "a torch.inference_mode() evaluation between backward and step",
    "two forwards": "two forwards (halves of the batch), one backward of their summed loss",
    "accumulate": "two micro-batches, the first without gradient sync; the state dict between",
    "freeze mid-run": "requires_grad_(False) on one weight before step 1",
    "two optimizers": "SGD for the blocks, AdamW for the rest",
    "save and load": "the library's checkpoint saved after step 1 and loaded back",
}


def _wrap(how, model, world):
    from minidist.data_parallel import BucketedDDP, FlatDDP, NaiveDDP
    from minidist.sharding import fsdp, replicate
    if how in ("naive", "flat"):
        return (NaiveDDP if how == "naive" else FlatDDP)(model)
    if how.startswith("bucketed"):
        return BucketedDDP(model, bucket_cap_mb=0.0002, find_unused_parameters="unused" in how)
    if how == "hsdp":   # R x S = 2 x W/2 (W = 2: replicated over 2, shard groups of 1)
        from minidist.sharding import hsdp_mesh
        mesh = hsdp_mesh(2, world // 2)
        for b in model.blocks:
            fsdp.fully_shard(b, mesh=mesh)
        return fsdp.fully_shard(model, mesh=mesh)
    if how.startswith("fsdp"):
        opts = dict(per_parameter="flat" not in how, reshard_after_forward="keep" not in how)
        for b in model.blocks:
            fsdp.fully_shard(b, **opts)
        return fsdp.fully_shard(model, **opts)
    if how == "replicate":
        return replicate(model)
    if how == "torch-ddp":
        return torch.nn.parallel.DistributedDataParallel(model,
                                                          find_unused_parameters=True)
    if how.startswith("torch-fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh, keep = init_device_mesh("cpu", (world,)), how.endswith("keep")
        for b in model.blocks:
            fully_shard(b, mesh=mesh, reshard_after_forward=not keep)
        return fully_shard(model, mesh=mesh, reshard_after_forward=not keep)
    return model


def _optimizers(how, model, event):
    from minidist.sharding import ShardedOptimizer
    named = [(n, p) for n, p in model.named_parameters()]
    parts = ([[p for n, p in named if n.startswith("blocks")],
              [p for n, p in named if not n.startswith("blocks")]]
             if event == "two optimizers" else [[p for _, p in named]])
    kinds = [torch.optim.SGD, torch.optim.AdamW] if event == "two optimizers" else [torch.optim.AdamW]
    out = []
    for params, cls in zip(parts, kinds):
        hyper = dict(lr=0.05, momentum=0.9) if cls is torch.optim.SGD else dict(lr=0.02)
        if how in ("zero1", "zero2"):
            out.append(ShardedOptimizer(params, cls, stage=int(how[-1]), grads="local", **hyper))
        else:
            out.append(cls(params, **hyper))
    return out


def _no_sync(how, model):
    from minidist.sharding import fsdp
    if how in ("naive", "flat") or how.startswith("bucketed") or how == "torch-ddp":
        return model.no_sync()
    if how.startswith(("fsdp", "hsdp")) or how == "replicate":
        fsdp.set_requires_gradient_sync(model, False)
        return contextlib.nullcontext()
    if how.startswith("torch-fsdp2"):
        model.set_requires_gradient_sync(False)
        return contextlib.nullcontext()
    return contextlib.nullcontext()


def _sync_on(how, model):
    from minidist.sharding import fsdp
    if how.startswith(("fsdp", "hsdp")) or how == "replicate":
        fsdp.set_requires_gradient_sync(model, True)
    elif how.startswith("torch-fsdp2"):
        model.set_requires_gradient_sync(True)


def _full_state(how, model) -> dict:
    from minidist.sharding import fsdp_state
    if how.startswith(("fsdp", "hsdp")) or how == "replicate":
        return fsdp_state.full_state_dict(model)
    inner = getattr(model, "module", model)
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in inner.state_dict().items()}


def _rows(ranks, world: int, part: int, parts: int) -> torch.Tensor:
    """The rows of the global batch that ``ranks`` hold in micro-batch ``part`` of ``parts``."""
    n = BATCH // world
    return torch.cat([torch.arange(r * n + part * n // parts, r * n + (part + 1) * n // parts)
                      for r in ranks])


def _save_load(how, model, opts, folder):
    if how.startswith("torch"):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        msd, osd = get_state_dict(model, opts[0])
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=folder)
        msd, osd = get_state_dict(model, opts[0])
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=folder)
        set_state_dict(model, opts[0], model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        return
    if how.startswith(("fsdp", "hsdp")) or how == "replicate":
        from minidist.sharding.checkpoints import load_full_checkpoint, save_full_checkpoint
        save_full_checkpoint(folder, model, opts[0], extra={"step": 1})
        load_full_checkpoint(folder, model, opts[0])
        return
    from minidist.data_parallel.checkpoint import load_checkpoint, save_checkpoint
    save_checkpoint(folder, model, opts[0], extra={"step": 1})
    load_checkpoint(folder, model, opts[0])


def train(spec: dict, how: str, event: str, rank: int = 0, world: int = 1,
          folder: str | None = None, ranks=None):
    """One cell: ``{"final", "evals", "mids"}`` (``how="single"``: one process, global batch of
    ``world`` ranks' rows), or the error's text ``"error: ..."``."""
    spec = {**BASE, **spec}
    torch.manual_seed(0)
    inner = UserNet(spec)
    model = _wrap(how, inner, world)
    opts = _optimizers(how, inner, event)
    mine = list(range(world)) if how == "single" else [rank]
    evals, mids = [], []
    guard = torch.inference_mode if event == "inference_mode eval" else torch.no_grad
    parts = 2 if event in ("accumulate", "two forwards") else 1
    try:
        for step in range(STEPS):
            x, y = batch(step, spec)
            if event == "freeze mid-run" and step == 1:
                inner.blocks[1].fc1.weight.requires_grad_(False)
            for o in opts:
                o.zero_grad()
            if event == "two forwards":
                a, b = _rows(mine, world, 0, 2), _rows(mine, world, 1, 2)
                (F.mse_loss(model(x[a]), y[a]) + F.mse_loss(model(x[b]), y[b])).backward()
            else:
                for k in range(parts):
                    rows = _rows(mine, world, k, parts)
                    last = k == parts - 1
                    ctx = contextlib.nullcontext() if last or how == "single" else \
                        _no_sync(how, model)
                    with ctx:
                        (F.mse_loss(model(x[rows]), y[rows]) / parts).backward()
                    if not last:
                        _sync_on(how, model)
                        mids.append(_full_state(how, model))
            if hasattr(model, "sync_gradients") and how in ("naive", "flat"):
                model.sync_gradients()
            if event in ("eval before step", "inference_mode eval"):
                with guard():
                    evals.append(model(batch(99, spec)[0][:4]).clone())
            for o in opts:
                o.step()
            if event == "eval after step":
                with torch.no_grad():
                    evals.append(model(batch(99, spec)[0][:4]).clone())
            if event == "save and load" and step == 1 and how != "single":
                _save_load(how, model, opts, os.path.join(folder or ".", f"ckpt-{how}"))
        return {"final": _full_state(how, model), "evals": evals, "mids": mids}
    except (RuntimeError, ValueError, TypeError, KeyError) as e:
        return f"error: {type(e).__name__}: {e}"
    finally:
        for o in opts:
            if hasattr(o, "close"):
                o.close()
        if hasattr(model, "close"):
            model.close()


def cells(models=None, wrappers=WRAPPERS + TORCH, events=tuple(EVENTS)) -> list[tuple]:
    """Every (model name, wrapper, event) of the given lists (default: all)."""
    return list(itertools.product(models or list(MODELS), wrappers, events))


def _launch(rank, world, todo, specs):
    with tempfile.TemporaryDirectory(prefix="minidist-user-loop-") as folder:
        folder = _shared(folder)
        out = {}
        for name, how, event in todo:
            if torch_fails(specs[name], how) is None:
                out[name, how, event] = train(specs[name], how, event, rank, world,
                                              os.path.join(folder, f"{len(out)}"))
        return out


def _shared(folder: str) -> str:
    """Rank 0's temporary folder, on every rank (the checkpoints are collective)."""
    import torch.distributed as dist
    got = [folder]
    dist.broadcast_object_list(got, src=0)
    return got[0]


def reference(spec: dict, event: str, world: int):
    return train(spec, "single", event, 0, world)


def run_cells(todo: list[tuple], world: int = 2, specs: dict | None = None,
              timeout: float = 600) -> list[dict]:
    """Run ``todo`` (:func:`cells`) in one launch of ``world`` ranks; one row per cell with its
    status and detail (rank 0's; every rank's values are compared through the full state)."""
    import minidist
    specs = {**MODELS, **(specs or {})}
    got = minidist.run(_launch, world, todo, specs, timeout=timeout)[0]
    refs: dict = {}
    rows = []
    for name, how, event in todo:
        key = (name, event)
        if key not in refs:
            refs[key] = reference(specs[name], event, world)
        known = torch_fails(specs[name], how)
        status, detail = (("✗", f"not run: {known}") if known else
                          judge(got[name, how, event], refs[key]))
        rows.append(dict(model=name, wrapper=how, event=event, status=status, detail=detail,
                         world=world))
    return rows


