"""Checkpoint and resume of a 3-D run, bit for bit: N steps straight (saving after K of them)
equal K steps, a save, fresh processes, a load and N-K steps — the same losses and parameters
(``==`` in fp32, not a tolerance), with dropout on, ZeRO-1 on an 8-rank grid and bucketed DDP on a
4-rank one. A resume that does not restore the dropout tracker's generators (the usual mistake:
re-seeding) gives other losses, so the test sees the RNG state. Other grids, an unfinished save
and a mix of two saves are clear errors."""

import os
import re
import shutil

import pytest
import torch

import minidist
from minidist.checkpoint_io import newest
from minidist.grid import ProcessGrid
from minidist.hybrid import HybridGPT, make_optimizer, train_step, wrap_stages
from minidist.hybrid.checkpoint import load_hybrid_checkpoint, rank_file, save_hybrid_checkpoint
from minidist.models.gpt import GPTConfig
from minidist.tensor_parallel.random import grid_seed

CFG = GPTConfig(vocab_size=50, block_size=8, n_layer=4, n_head=4, n_embd=16, dropout=0.2,
                attn_dropout=0.2, tie_embeddings=True)
N, K, SEED = 4, 2, 1234


class Batches:
    """The global batch stream (the same on every rank): its position is its generator's state."""

    def __init__(self, seed=3, batch=4):
        self.gen, self.batch, self.served = torch.Generator().manual_seed(seed), batch, 0

    def next(self):
        self.served += 1
        ids = torch.randint(0, CFG.vocab_size, (self.batch, CFG.block_size), generator=self.gen)
        return ids, torch.roll(ids, -1, dims=1)

    def state_dict(self):
        return {"gen": self.gen.get_state(), "served": self.served}

    def load_state_dict(self, state):
        self.gen.set_state(state["gen"])
        self.served = state["served"]


def _setup(dims, dp_mode, chunks=1, sp=False):
    grid = ProcessGrid(*dims)
    model = HybridGPT(CFG, grid, chunks=chunks, sequence_parallel=sp, seed=0)
    modules = wrap_stages(model, dp_mode)
    opt = make_optimizer(model, dp_mode, torch.optim.AdamW, lr=1e-2)
    grid_seed(SEED, grid)
    return grid, model, modules, opt, Batches()


def _steps(model, modules, opt, data, n, dp_mode):
    losses = []
    for _ in range(n):
        ids, tgt = data.next()
        out = train_step(model, opt, modules, ids, tgt, microbatches=2, dp_mode=dp_mode,
                         max_norm=1.0)
        losses.append(out.loss)
    return losses


def _params(model):
    return {f"{s}.{k}": v.clone() for s, m in model.stages.items()
            for k, v in m.state_dict().items()}


def _straight(rank, world, dims, dp_mode, folder, layout):
    grid, model, modules, opt, data = _setup(dims, dp_mode, **layout)
    losses = _steps(model, modules, opt, data, K, dp_mode)
    save_hybrid_checkpoint(folder, model, opt, step=K, states={"data": data}, extra={"losses": losses})
    losses += _steps(model, modules, opt, data, N - K, dp_mode)    # saving changes nothing
    return {"losses": losses, "params": _params(model)}


def _resumed(rank, world, dims, dp_mode, folder, layout):
    grid, model, modules, opt, data = _setup(dims, dp_mode, **layout)
    info = load_hybrid_checkpoint(folder, model, opt, states={"data": data})
    losses = info["extra"]["losses"] + _steps(model, modules, opt, data, N - info["step"], dp_mode)
    out = {"losses": losses, "params": _params(model), "step": info["step"],
           "served": data.served}
    grid_seed(SEED, grid)                         # a naive resume: data and weights, fresh masks
    load_hybrid_checkpoint(folder, model, opt, states={"data": data}, restore_rng=False)
    out["naive"] = info["extra"]["losses"] + _steps(model, modules, opt, data, N - K, dp_mode)
    return out


@pytest.mark.parametrize("dims,dp_mode,layout", [
    ((2, 2, 2), "zero1", {"sp": True}),           # ZeRO-1 shards, sequence parallelism
    ((2, 2, 1), "bucketed", {"chunks": 2}),       # interleaved 1F1B: two model chunks per rank
])
def test_resume_is_bit_identical(tmp_path, dims, dp_mode, layout):
    """(dp, pp, tp) grids; the embedding is tied to the head (a copy on the last stage)."""
    world = dims[0] * dims[1] * dims[2]
    folder = str(tmp_path / "ckpt")
    straight = minidist.run(_straight, world, dims, dp_mode, folder, layout, timeout=300)
    assert os.listdir(folder) == ["gen-000001"]
    assert sorted(os.listdir(newest(folder))) == (["manifest.json"] +
                                                  [f"rank{r:05d}.pt" for r in range(world)])
    resumed = minidist.run(_resumed, world, dims, dp_mode, folder, layout, timeout=300)
    for r, (a, b) in enumerate(zip(straight, resumed)):
        assert b["step"] == K and b["served"] == N
        assert a["losses"] == b["losses"], (r, a["losses"], b["losses"])
        assert a["params"].keys() == b["params"].keys()
        for k in a["params"]:
            assert torch.equal(a["params"][k], b["params"][k]), (r, k)
        assert b["naive"][K:] != a["losses"][K:], \
            "re-seeding instead of restoring the dropout generators must change the run"
    assert len(set(tuple(x["losses"]) for x in straight)) == 1, "every rank reports the same loss"


def _save_only(rank, world, dims, folder, step):
    grid, model, modules, opt, data = _setup(dims, "flat")
    save_hybrid_checkpoint(folder, model, opt, step=step, states={"data": data})


def _load_only(rank, world, dims, folder):
    """Each rank's error as (type name, message): every rank's, whatever the timing."""
    grid, model, modules, opt, data = _setup(dims, "flat")
    try:
        return load_hybrid_checkpoint(folder, model, opt, states={"data": data})["step"]
    except Exception as e:
        return type(e).__name__, str(e)


def test_other_grid_unfinished_save_and_mixed_files_are_clear_errors(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    minidist.run(_save_only, 4, (2, 2, 1), a, 0, timeout=120)
    minidist.run(_save_only, 4, (2, 2, 1), b, 1, timeout=120)
    for r, (kind, msg) in enumerate(minidist.run(_load_only, 4, (1, 2, 2), a, timeout=120)):
        assert kind == "ValueError" and msg.startswith(f"load_hybrid_checkpoint (rank {r}, "), msg
        assert ("saved on grid dp=2 pp=2 tp=1 chunks=1 sequence_parallel=False, this run is "
                "dp=1 pp=2 tp=2 chunks=1") in msg, msg
    shutil.copy(rank_file(b, 1), rank_file(a, 1))          # a file of another save
    errors = minidist.run(_load_only, 4, (2, 2, 1), a, timeout=120)
    # its size or (same size) its SHA-256 differs from the manifest's
    changed = re.compile(r"rank00001\.pt is (truncated or was changed|corrupted: its SHA-256)")
    assert errors[1][0] == "ValueError" and changed.search(errors[1][1]), errors[1]
    for r in (0, 2, 3):   # the ranks that could load refuse too (else they would hang later)
        kind, msg = errors[r]
        assert kind == "RuntimeError" and msg.startswith(
            f"load_hybrid_checkpoint (rank {r}, {a!r}): rank(s) [1] could not load their part of "
            "the checkpoint (rank 1: ValueError: "), errors[r]
        assert changed.search(msg) and msg.endswith("no rank resumes"), msg
    os.remove(os.path.join(newest(b), "manifest.json"))     # a save that did not finish
    for kind, msg in minidist.run(_load_only, 4, (2, 2, 1), b, timeout=120):
        assert kind == "FileNotFoundError" and "no complete checkpoint" in msg, msg
        assert "1 unfinished save(s) without manifest.json" in msg, msg
