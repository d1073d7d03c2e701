"""Local SGD and DiLoCo (Douillard et al. 2023, Algorithm 1): H inner steps per rank without
communication, then Δ = mean(θ - θ_rank) in one all-reduce and an outer Nesterov SGD step on θ.
Local SGD (Stich 2019) is outer lr 1, no momentum.
Design notes: docs/design/data_parallel.md
"""

from __future__ import annotations

import torch
from torch import nn

from ..communicator import Communicator
from .compression import ring_allreduce_bytes

__all__ = ["DiLoCo"]


class DiLoCo:
    """Call :meth:`step` after every inner ``optimizer.step()``; every ``sync_every``-th (H) call runs
    the outer SGD (``outer_lr``, ``outer_momentum``, ``nesterov``), an all-reduce. ``ValueError``
    for ``sync_every`` < 1 or ``outer_lr`` <= 0."""

    def __init__(self, model: nn.Module, sync_every: int = 500, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, nesterov: bool = True,
                 collectives: str = "hand-built", group=None):
        self.comm = Communicator(collectives, group, where="DiLoCo")
        where = f"DiLoCo (rank {self.comm.rank})"
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"{where}: sync_every must be an int >= 1, got {sync_every!r}")
        if not outer_lr > 0:
            raise ValueError(f"{where}: outer_lr must be > 0, got {outer_lr!r}")
        self.model, self.sync_every = model, sync_every
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.anchor = [p.detach().clone() for p in self.params]
        self.outer = torch.optim.SGD(self.anchor, lr=outer_lr, momentum=outer_momentum,
                                     nesterov=nesterov and outer_momentum > 0)
        self.inner_steps, self.rounds = 0, 0

    @torch.no_grad()
    def step(self) -> bool:
        """Count one inner step; at the end of a round, run the outer step. Returns True then."""
        self.inner_steps += 1
        if self.inner_steps % self.sync_every:
            return False
        delta = torch.cat([(a - p).reshape(-1) for a, p in zip(self.anchor, self.params)])
        self.comm.all_reduce(delta, "avg")          # the outer (pseudo-)gradient
        off = 0
        for a in self.anchor:
            a.grad = delta[off:off + a.numel()].view_as(a)
            off += a.numel()
        self.outer.step()
        for a, p in zip(self.anchor, self.params):
            p.copy_(a)
        self.rounds += 1
        return True

    checkpoint_scope = "per_rank"           # mid-round, each rank's replica is its own

    @property
    def holds_replica(self) -> bool:
        """True between synchronisations (the replicas differ: state is per rank)."""
        return self.inner_steps % self.sync_every != 0

    def state_dict(self) -> dict:
        """The anchor θ, the outer optimizer, the position in the round and, mid-round, this replica."""
        return {"sync_every": self.sync_every, "inner_steps": self.inner_steps,
                "rounds": self.rounds, "anchor": [a.detach().clone() for a in self.anchor],
                "outer": self.outer.state_dict(),
                "replica": ([p.detach().clone() for p in self.params] if self.holds_replica
                            else None)}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (after the model's own state is loaded)."""
        where = f"DiLoCo.load_state_dict (rank {self.comm.rank})"
        if state["sync_every"] != self.sync_every:
            raise ValueError(f"{where}: saved with sync_every={state['sync_every']}, this one "
                             f"has {self.sync_every}")
        shapes = [tuple(a.shape) for a in state["anchor"]]
        if shapes != [tuple(a.shape) for a in self.anchor]:
            raise ValueError(f"{where}: saved for parameters of shapes {shapes[:3]}..., this "
                             "model's differ")
        for a, s in zip(self.anchor, state["anchor"]):
            a.copy_(s)
        self.outer.load_state_dict(state["outer"])
        self.inner_steps, self.rounds = int(state["inner_steps"]), int(state["rounds"])
        if state["replica"] is not None:
            for p, s in zip(self.params, state["replica"]):
                p.copy_(s)

    def numel(self) -> int:
        """Parameters in one all-reduce of the round."""
        return sum(p.numel() for p in self.params)

    def bytes_per_step(self) -> float:
        """Bytes one rank sends per inner step, on average: one ring all-reduce / H."""
        return ring_allreduce_bytes(self.numel(), self.comm.world_size) / self.sync_every
