"""Independent references for the sharding tests, the lesson and the bench: a toy model with the
awkward parts (tied weights, a frozen parameter, a buffer, sizes not divisible by W), its data, and
one process training on the global batch.

    model = make_model()                 # identical on every rank (seeded)
    x, y = global_batch(step)            # x [12, 5] int64 tokens, y [12, 5] int64 targets
    single = train_single(torch.optim.AdamW, steps=5, lr=1e-2)   # {name: tensor}
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Block", "TiedLM", "make_model", "global_batch", "local_batch", "loss_fn",
           "train_single", "param_groups", "as_groups", "named_state", "max_abs_diff", "OPTIMIZERS"]

VOCAB, DIM, HIDDEN, SEQ, BATCH = 11, 7, 13, 5, 12

OPTIMIZERS = {  # name: (class, hyperparameters) used by the equality tests
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
}


class Block(nn.Module):
    """Residual MLP block: x [B, T, dim] → x + W2 tanh(W1 x) (+ dropout if p > 0)."""

    def __init__(self, dim: int = DIM, hidden: int = HIDDEN, dropout: float = 0.0):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return x + self.drop(self.fc2(torch.tanh(self.fc1(x))))


class TiedLM(nn.Module):
    """Tokens [B, T] int64 → logits [B, T, vocab]. The head's weight *is* the embedding's (tied);
    ``frozen`` [dim] has ``requires_grad=False``; ``scale`` is a buffer. 11·7 = 77, 7·13 = 91 ...:
    no parameter size is divisible by 2, 3 or 4."""

    def __init__(self, vocab: int = VOCAB, dim: int = DIM, hidden: int = HIDDEN, blocks: int = 2,
                 dropout: float = 0.0, frozen: bool = True):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, hidden, dropout) for _ in range(blocks))
        self.head = nn.Linear(dim, vocab)
        self.head.weight = self.emb.weight
        self.frozen = nn.Parameter(torch.randn(dim) * 0.1, requires_grad=False) if frozen else None
        self.register_buffer("scale", torch.tensor(0.75))

    def forward(self, idx):
        h = self.emb(idx)
        for b in self.blocks:
            h = b(h)
        h = h * self.scale
        return self.head(h if self.frozen is None else h + self.frozen)


def make_model(seed: int = 0, **kw) -> TiedLM:
    torch.manual_seed(seed)
    return TiedLM(**kw)


def global_batch(step: int, size: int = BATCH, seed: int = 0):
    """The global batch of ``step``: tokens x [size, SEQ] and next-token targets y [size, SEQ]."""
    g = torch.Generator().manual_seed(1000 * seed + step)
    x = torch.randint(0, VOCAB, (size, SEQ + 1), generator=g)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def local_batch(step: int, rank: int, world: int, size: int = BATCH):
    """Rank ``rank``'s contiguous piece of the global batch (``size`` divisible by ``world``)."""
    x, y = global_batch(step, size)
    if size % world:
        raise ValueError(f"global batch {size} is not divisible by the world size {world}")
    n = size // world
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def loss_fn(logits, y):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def named_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers by name (tied ones once), detached copies."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def param_groups(model: nn.Module) -> list[dict]:
    """Two param groups with different hyperparameters: the blocks, and the rest (lr x 0.5)."""
    blocks = list(model.blocks.parameters())
    rest = [p for p in model.parameters() if all(p is not q for q in blocks)]
    return [{"params": blocks}, {"params": rest, "lr_scale": 0.5}]


def as_groups(groups: list[dict], hyper: dict) -> list[dict]:
    """``lr_scale`` → an explicit ``lr`` (so every optimizer sees the same numbers)."""
    return [{"params": g["params"], "lr": hyper["lr"] * g.get("lr_scale", 1.0)} for g in groups]


def train_single(optimizer_class, steps: int = 5, groups: bool = False, with_optimizer=False,
                 **hyper):
    """One process, the whole global batch every step; returns :func:`named_state` after
    (and the optimizer's ``state_dict()`` with ``with_optimizer=True``)."""
    model = make_model()
    params = as_groups(param_groups(model), hyper) if groups else model.parameters()
    opt = optimizer_class(params, **hyper)
    for step in range(steps):
        opt.zero_grad()
        x, y = global_batch(step)
        loss_fn(model(x), y).backward()
        opt.step()
    return (named_state(model), opt.state_dict()) if with_optimizer else named_state(model)


def max_abs_diff(a: dict, b: dict) -> float:
    """Largest |a - b| over the tensors of two name → tensor dicts with the same names."""
    if set(a) != set(b):
        raise KeyError(f"different names: {sorted(set(a) ^ set(b))}")
    return max(float((a[k].float() - b[k].float()).abs().max()) if a[k].numel() else 0.0
               for k in a)
