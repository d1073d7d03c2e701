"""Train the tiny GPT with data x tensor x pipeline parallelism (3-D parallelism), on CPU or GPU.

    torchrun --standalone --nproc-per-node 8 course/scripts/train_3d.py --dp 2 --tp 2 --pp 2
    torchrun --standalone --nproc-per-node 4 course/scripts/train_3d.py --pp 2 --chunks 2 \\
        --tp 2 --sequence-parallel --dp-mode bucketed --microbatches 4
    python course/scripts/train_3d.py --reference          # the same run on one process
    torchrun --standalone --nproc-per-node 4 --max-restarts 1 course/scripts/train_3d.py \
        --tp 2 --pp 2 --checkpoint ckpt --kill-rank 1 --kill-step 3   # a rank dies; resumed

Every rank builds the same full GPT after ``torch.manual_seed(seed)`` and keeps its shards of its
pipeline stages (:class:`minidist.hybrid.HybridGPT`); every step draws the same global batch on
every rank (a seeded generator), each DP replica takes its slice, and
:func:`minidist.hybrid.train_step` runs the pipeline schedule (1F1B, interleaved with --chunks > 1),
the TP/SP, tied-embedding and DP gradient duties, global-norm clipping and AdamW. Rank 0 prints
``step i loss x`` (the global batch's loss): the one-process run (``--reference``) prints the same
numbers, to fp32 rounding. :func:`train` is what the tests call under ``minidist.run``.

With ``--checkpoint DIR`` every rank saves after every step
(:func:`minidist.hybrid.checkpoint.save_hybrid_checkpoint`: its shards, the optimizer, every
generator, the losses so far) and, started again, resumes from the newest complete generation.
``--kill-rank R --kill-step S`` makes rank R kill itself (SIGKILL) at the start of step S in
torchrun's first attempt (``TORCHELASTIC_RESTART_COUNT`` 0): under ``--max-restarts 1`` torchrun
restarts every worker, they resume, and the printed losses are the uninterrupted run's, bit for bit.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import torch
import torch.nn.functional as F

import minidist
from minidist.grid import ProcessGrid
from minidist.hybrid import HybridGPT, make_optimizer, train_step, wrap_stages
from minidist.models.gpt import GPT, GPTConfig

CONFIG = dict(vocab_size=93, block_size=16, n_layer=8, n_head=4, n_embd=32)


def make_batch(step: int, batch: int, seq: int, vocab: int, seed: int = 0):
    """The global batch of ``step``: sequences that count up by a stride of 1-3 (mod ``vocab``),
    so the model has something to learn. ``ids``, ``targets``: int64 ``[batch, seq]``."""
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    stride = torch.randint(1, 4, (batch, 1), generator=g)
    tokens = (start + stride * torch.arange(seq + 1)) % vocab
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def train(dp: int = 1, tp: int = 1, pp: int = 1, chunks: int = 1, microbatches: int = 4,
          sequence_parallel: bool = False, dp_mode: str = "flat", steps: int = 20, seed: int = 0,
          batch: int = 16, lr: float = 3e-3, max_norm: float = 1.0, tie: bool = False,
          verbose: bool = False, checkpoint: str | None = None,
          kill: tuple[int, int] | None = None) -> list[float]:
    """Train on the current process group (dp·tp·pp ranks) and return the losses (every rank).
    ``checkpoint``: a folder to save to after every step and resume from; ``kill``:
    ``(rank, step)`` to SIGKILL in torchrun's first attempt (see the module notes)."""
    from minidist.checkpoint_io import newest
    from minidist.hybrid.checkpoint import load_hybrid_checkpoint, save_hybrid_checkpoint
    cfg = GPTConfig(**CONFIG, tie_embeddings=tie)
    grid = ProcessGrid(dp, pp, tp)
    model = HybridGPT(cfg, grid, chunks=chunks, sequence_parallel=sequence_parallel, seed=seed)
    modules = wrap_stages(model, dp_mode)
    opt = make_optimizer(model, dp_mode, torch.optim.AdamW, lr=lr)
    losses, start = [], 0
    if checkpoint and newest(checkpoint):
        info = load_hybrid_checkpoint(checkpoint, model, opt)
        start, losses = info["step"], info["extra"]["losses"]
        if verbose and grid.rank == 0:
            print(f"resumed from {os.path.basename(info['generation'])} at step {start}",
                  flush=True)
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    for step in range(start, steps):
        if kill is not None and (grid.rank, step) == tuple(kill) and first_attempt:
            os.kill(os.getpid(), signal.SIGKILL)           # the others wait mid-step
        ids, targets = make_batch(step, batch, cfg.block_size, cfg.vocab_size, seed)
        out = train_step(model, opt, modules, ids, targets, microbatches, dp_mode=dp_mode,
                         max_norm=max_norm)
        losses.append(out.loss)
        if verbose and grid.rank == 0:
            print(f"step {step} loss {out.loss:.8f}", flush=True)
        if checkpoint:
            save_hybrid_checkpoint(checkpoint, model, opt, step=step + 1,
                                   extra={"losses": losses})
    return losses


def train_rank(rank: int, world_size: int, kwargs: dict) -> list[float]:
    """``minidist.run(train_rank, W, kwargs)``: :func:`train` on every rank."""
    return train(**kwargs)


def reference(steps: int = 20, seed: int = 0, batch: int = 16, lr: float = 3e-3,
              max_norm: float = 1.0, tie: bool = False, verbose: bool = False) -> list[float]:
    """The same training on one process: the plain GPT, the whole batch, the same AdamW."""
    cfg = GPTConfig(**CONFIG, tie_embeddings=tie)
    torch.manual_seed(seed)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        ids, targets = make_batch(step, batch, cfg.block_size, cfg.vocab_size, seed)
        opt.zero_grad(set_to_none=True)
        logits, _ = model(ids)
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), targets.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        losses.append(loss.item())
        if verbose:
            print(f"step {step} loss {loss.item():.8f}", flush=True)
    return losses


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--chunks", "-v", type=int, default=1, help="model chunks per pipeline rank")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--dp-mode", choices=["flat", "bucketed", "zero1"], default="flat")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=16, help="global batch (samples)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--max-norm", type=float, default=1.0)
    p.add_argument("--tie-embeddings", action="store_true")
    p.add_argument("--reference", action="store_true", help="one process, no parallelism")
    p.add_argument("--checkpoint", help="save to this folder after every step; resume from it")
    p.add_argument("--kill-rank", type=int, help="this rank SIGKILLs itself (first attempt only)")
    p.add_argument("--kill-step", type=int, default=0, help="... at the start of this step")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse(argv)
    common = dict(steps=a.steps, seed=a.seed, batch=a.batch, lr=a.lr, max_norm=a.max_norm,
                  tie=a.tie_embeddings, verbose=True)
    if a.reference:
        reference(**common)
        return 0
    info = minidist.init(timeout=300)
    if info.world_size != a.dp * a.tp * a.pp:
        print(f"rank {info.rank}: dp x tp x pp = {a.dp * a.tp * a.pp}, but {info.world_size} "
              "processes were started", file=sys.stderr)
        return 2
    train(a.dp, a.tp, a.pp, a.chunks, a.microbatches, a.sequence_parallel, a.dp_mode, **common,
          checkpoint=a.checkpoint,
          kill=None if a.kill_rank is None else (a.kill_rank, a.kill_step))
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
