"""ZeRO-1/2 state dicts: the consolidated (full) optimizer state in torch's format, on every rank.

:meth:`state_dict` all-gathers every slice-shaped state tensor into its parameters' shapes;
:meth:`load_state_dict` keeps this rank's slices of a full state saved at any world size (or by a
plain ``torch.optim`` optimizer over the same parameters). Mixed into :class:`~.zero.ShardedOptimizer`.
"""

from __future__ import annotations

import torch

from ..communicator import Communicator

__all__: list[str] = []


class _ConsolidatedState:
    """The state-dict methods of :class:`~.zero.ShardedOptimizer`."""

    buckets: list
    all_params: list
    comm: Communicator
    optim: torch.optim.Optimizer
    rank: int
    _group_meta: list[int]

    checkpoint_scope = "replicated"         # state_dict() is the consolidated state (minidist.state)

    def state_dict(self) -> dict:
        """The full optimizer state, torch's format; ``state`` keyed by parameter index at construction.

        Collective: every rank must call it. Frozen parameters count in the index (no state)."""
        state: dict = {}
        index = {id(p): i for i, p in enumerate(self.all_params)}
        for b in self.buckets:
            own = self.optim.state.get(b.shard, {})
            for key in sorted(own):
                val = own[key]
                if torch.is_tensor(val) and val.shape == b.shard.shape:
                    full = b.layout.empty(val.dtype, zero=False)
                    self.comm.all_gather(full, val)
                    for p, v in zip(b.params, b.layout.views(full)):
                        state.setdefault(index[id(p)], {})[key] = v.clone()
                else:
                    for p in b.params:
                        state.setdefault(index[id(p)], {})[key] = (
                            val.clone() if torch.is_tensor(val) else val)
        groups, start = [], 0
        for g, n in zip(self.optim.param_groups, self._group_meta):
            groups.append({**{k: v for k, v in g.items() if k != "params"},
                           "params": list(range(start, start + n))})
            start += n
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a full optimizer state (any world size, or a plain ``torch.optim`` one); keep this
        rank's slices. Raises ``ValueError`` when the number of param groups differs."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.optim.param_groups):
            raise ValueError(f"load_state_dict (rank {self.rank}): {len(groups)} param groups, "
                             f"this optimizer has {len(self.optim.param_groups)}")
        for mine, saved in zip(self.optim.param_groups, groups):
            mine.update({k: v for k, v in saved.items() if k != "params"})
        full = {int(k): v for k, v in state_dict["state"].items()}
        index = {id(p): i for i, p in enumerate(self.all_params)}
        for b in self.buckets:
            per = [full.get(index[id(p)], {}) for p in b.params]
            keys = set().union(*per)
            new = {}
            for key in sorted(keys):
                vals = [s.get(key) for s in per]
                if key != "step" and all(torch.is_tensor(v) and v.shape == p.shape
                                         for v, p in zip(vals, b.params)):
                    flat = b.layout.pack(vals, dtype=vals[0].dtype)
                    new[key] = b.layout.shard(flat).clone()
                else:
                    new[key] = vals[0].clone() if torch.is_tensor(vals[0]) else vals[0]
            self.optim.state[b.shard] = new
