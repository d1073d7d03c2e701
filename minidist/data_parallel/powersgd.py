"""PowerSGD (Vogels et al. 2019, Algorithm 1): rank-r compression with error feedback as a DDP
communication hook, two all-reduces (P, Q) per matrix; semantics of torch's ``powerSGD_hook``.
Design notes: docs/design/data_parallel.md
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch

from ..state import load_numpy_rng_state, numpy_rng_state
from .compression import ring_allreduce_bytes

__all__ = ["PowerSGD", "orthogonalize_"]


def orthogonalize_(m: torch.Tensor, epsilon: float = 0.0) -> torch.Tensor:
    """Gram-Schmidt, in place, on the columns of ``m`` (n × r, r ≤ n): afterwards ``mᵀ m = I``."""
    if m.dim() != 2 or m.shape[1] > m.shape[0]:
        raise ValueError(f"orthogonalize_: expected an n x r matrix with r <= n, got {tuple(m.shape)}")
    for i in range(m.shape[1]):
        col = m[:, i:i + 1]
        col /= torch.linalg.vector_norm(col) + epsilon
        if i + 1 < m.shape[1]:
            rest = m[:, i + 1:]
            rest -= (col * rest).sum(dim=0, keepdim=True) * col
    return m


class PowerSGD:
    """PowerSGD state and hook, torch's settings: ``rank`` r ≥ 1, ``start_iter``,
    ``min_compression_rate`` (compress iff r·(n+m)·rate < n·m), ``error_feedback``, ``warm_start``,
    ``epsilon``, ``seed``. ``ValueError`` for rank < 1 or negative ``start_iter``/rate."""

    def __init__(self, rank: int = 1, start_iter: int = 10, min_compression_rate: float = 2.0,
                 error_feedback: bool = True, warm_start: bool = True, epsilon: float = 0.0,
                 seed: int = 0):
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"PowerSGD: rank must be an int >= 1, got {rank!r}")
        if isinstance(start_iter, bool) or not isinstance(start_iter, int) or start_iter < 0:
            raise ValueError(f"PowerSGD: start_iter must be an int >= 0, got {start_iter!r}")
        if not min_compression_rate >= 0:
            raise ValueError(f"PowerSGD: min_compression_rate must be >= 0, got {min_compression_rate!r}")
        self.rank, self.start_iter = rank, start_iter
        self.min_compression_rate, self.epsilon = min_compression_rate, epsilon
        self.error_feedback, self.warm_start = error_feedback, warm_start
        self.rng = np.random.RandomState(seed)
        self.iter = -1                      # the current step (counted at bucket 0)
        self.errors: dict[int, torch.Tensor] = {}
        self.qs: dict[int, list[torch.Tensor]] = {}
        self.sent_numel: dict[int, int] = {}  # per bucket: numbers one rank all-reduced last step

    checkpoint_scope = "per_rank"           # error feedback differs by rank (minidist.state)
    _SETTINGS = ("rank", "start_iter", "min_compression_rate", "error_feedback", "warm_start",
                 "epsilon")

    def state_dict(self) -> dict:
        """Everything a resume needs, as plain data: error feedback, warm-start Q's, step, random state."""
        return {"settings": {k: getattr(self, k) for k in self._SETTINGS}, "iter": self.iter,
                "rng": numpy_rng_state(self.rng),
                "errors": {b: e.clone() for b, e in self.errors.items()},
                "qs": {b: [q.clone() for q in qs] for b, qs in self.qs.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Continue where :meth:`state_dict` was taken; ``ValueError`` naming a mismatch."""
        differ = {k: (v, getattr(self, k)) for k, v in state["settings"].items()
                  if getattr(self, k) != v}
        if differ:
            raise ValueError("PowerSGD.load_state_dict: saved with other settings "
                             + ", ".join(f"{k}={a!r} (this one {b!r})" for k, (a, b) in differ.items()))
        load_numpy_rng_state(self.rng, state["rng"])
        self.iter = int(state["iter"])
        self.errors = {int(b): e.clone() for b, e in state["errors"].items()}
        self.qs = {int(b): [q.clone() for q in qs] for b, qs in state["qs"].items()}

    def _plan(self, bucket):
        """Per parameter of ``bucket``: its n × m view and its rank, or None (sent uncompressed)."""
        plan = []
        for i, p in enumerate(bucket.params):
            if p.numel() == 0:
                plan.append(None)
                continue
            n = p.shape[0] if p.dim() else 1
            m = p.numel() // n
            r = min(n, m, self.rank)
            plan.append((n, m, r) if r * (n + m) * self.min_compression_rate < n * m else None)
        return plan

    def numel_per_step(self, bucket) -> int:
        """Numbers one rank all-reduces for ``bucket`` in a compressed step."""
        return sum(p.numel() if s is None else s[2] * (s[0] + s[1])
                   for p, s in zip(bucket.params, self._plan(bucket)))

    def bytes_per_step(self, bucket, world_size: int) -> float:
        """Bytes one rank sends for ``bucket`` in a compressed step (ring all-reduces)."""
        plan, item = self._plan(bucket), bucket.buffer.element_size()
        unc = sum(p.numel() for p, s in zip(bucket.params, plan) if s is None)
        ps = sum(s[0] * s[2] for s in plan if s is not None)
        qs = sum(s[1] * s[2] for s in plan if s is not None)
        return sum(ring_allreduce_bytes(k, world_size, item) for k in (unc, ps, qs) if k)

    def residual(self) -> float:
        """Sum of |e| over buckets: what error feedback still has to deliver."""
        return float(sum(e.abs().sum() for e in self.errors.values()))

    @staticmethod
    def hook(state: "PowerSGD", bucket, comm) -> None:
        """Leave the PowerSGD average of ``bucket.buffer`` in place (the same on every rank)."""
        if bucket.index == 0:
            state.iter += 1
        buf = bucket.buffer
        if state.iter < state.start_iter:
            comm.all_reduce(buf, "avg")
            state.sent_numel[bucket.index] = buf.numel()
            return
        if state.error_feedback:
            if bucket.index in state.errors:
                buf.add_(state.errors[bucket.index])
            local = buf.clone()
        plan = state._plan(bucket)
        slots = [bucket.slot(i) for i in range(len(plan))]
        unc = [s for s, pl in zip(slots, plan) if pl is None]
        mats = [s.view(pl[0], pl[1]) for s, pl in zip(slots, plan) if pl is not None]
        ranks = [pl[2] for pl in plan if pl is not None]
        qs = state.qs.get(bucket.index) if state.warm_start else None
        if qs is None:
            gen = torch.Generator().manual_seed(int(state.rng.randint(1_000_000_000)))
            by_shape: dict = defaultdict(list)  # torch draws Q per shape group, in first-seen order
            for j, mat in enumerate(mats):
                by_shape[tuple(mat.shape)].append(j)
            drawn = {j: torch.randn(mats[j].shape[1], ranks[j], generator=gen, dtype=buf.dtype)
                     for group in by_shape.values() for j in group}  # on the CPU, as torch
            qs = [drawn[j].to(buf.device) for j in range(len(mats))]
            if state.warm_start:
                state.qs[bucket.index] = qs
        for q in qs:
            orthogonalize_(q, state.epsilon)
        flat_unc = torch.cat([u.reshape(-1) for u in unc]) if unc else buf.new_empty(0)
        comm.all_reduce(flat_unc, "avg")
        off = 0
        for u in unc:
            u.copy_(flat_unc[off:off + u.numel()])
            off += u.numel()
        ps = [mat @ q for mat, q in zip(mats, qs)]
        flat_p = torch.cat([p.reshape(-1) for p in ps]) if ps else buf.new_empty(0)
        comm.all_reduce(flat_p, "sum")  # torch sums P (orthogonalisation removes the scale)
        off = 0
        for p in ps:
            p.copy_(flat_p[off:off + p.numel()].view_as(p))
            off += p.numel()
            orthogonalize_(p, state.epsilon)
        new_qs = [mat.t() @ p for mat, p in zip(mats, ps)]
        flat_q = torch.cat([q.reshape(-1) for q in new_qs]) if new_qs else buf.new_empty(0)
        comm.all_reduce(flat_q, "avg")
        off = 0
        for q, mat, p in zip(qs, mats, ps):
            q.copy_(flat_q[off:off + q.numel()].view_as(q))
            off += q.numel()
            mat.copy_(p @ q.t())
        if state.error_feedback:
            state.errors[bucket.index] = local - buf
        state.sent_numel[bucket.index] = flat_unc.numel() + flat_p.numel() + flat_q.numel()
