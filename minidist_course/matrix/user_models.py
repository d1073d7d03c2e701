"""The user-written modules of the user-loop matrix (:mod:`.user_loop`): one class, :class:`UserNet`,
whose ``spec`` switches on what users' models have and wrappers get wrong — tied input/output
weights, a frozen parameter, a buffer, a block run twice, a branch no sample of the last rank
reaches (a parameter unused on one rank), recomputation by torch's checkpoint (reentrant or not)
or minidist's. :data:`MODELS` names the matrix's specs; the tests draw others with hypothesis.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

__all__ = ["BASE", "MODELS", "UserNet", "batch", "BATCH"]

BATCH, D_IN, D = 16, 5, 6
BASE = dict(tie=False, frozen=False, buffer=False, reuse=False, unused=False, recompute=None)
MODELS = {
    "plain": {},
    "tied+frozen+buffer": dict(tie=True, frozen=True, buffer=True),
    "reused block": dict(reuse=True),
    "unused on a rank": dict(unused=True),
    "torch reentrant checkpoint": dict(recompute="torch-reentrant", tie=True),
    "torch checkpoint": dict(recompute="torch", buffer=True),
    "minidist checkpoint": dict(recompute="minidist", frozen=True),
}


class _Block(nn.Module):
    def __init__(self, spec):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, 8), nn.Linear(8, D)
        self.recompute = spec["recompute"]
        if spec["buffer"]:
            self.register_buffer("shift", 0.1 * torch.randn(D))
        else:
            self.shift = None

    def _f(self, x):
        y = x + self.fc2(torch.tanh(self.fc1(x)))
        return y if self.shift is None else y + self.shift

    def forward(self, x):
        if self.recompute is None or not torch.is_grad_enabled():
            return self._f(x)
        if self.recompute == "minidist":
            from minidist.sharding import checkpoint
            return checkpoint(self._f, x)
        return torch_checkpoint(self._f, x, use_reentrant=self.recompute == "torch-reentrant")


class UserNet(nn.Module):
    """A user's module of ``spec`` (:data:`BASE`'s keys): input [B, 5] → output [B, 5]."""

    def __init__(self, spec):
        super().__init__()
        self.spec = spec
        self.inp = nn.Linear(D_IN, D)
        self.blocks = nn.ModuleList(_Block(spec) for _ in range(2))
        self.side = nn.Linear(D, D)              # the branch only some samples take
        self.head = None if spec["tie"] else nn.Linear(D, D_IN)
        if spec["frozen"]:
            self.blocks[0].fc1.bias.requires_grad_(False)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        if self.spec["reuse"]:
            h = self.blocks[0](h)
        take = x[:, :1] > 0 if self.spec["unused"] else None
        if take is None or bool(take.any()):
            h = h + (self.side(h) if take is None else take * self.side(h))
        return h @ self.inp.weight if self.head is None else self.head(h)


def batch(step: int, spec) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7 + step)
    x, y = torch.randn(BATCH, D_IN, generator=g), torch.randn(BATCH, D_IN, generator=g)
    if spec["unused"]:
        x[BATCH // 2:, 0] = -x[BATCH // 2:, 0].abs() - 0.1  # the last rank's samples skip it
    return x, y
