"""SyncBatchNorm from scratch: statistics over the *global* batch — [Σx, Σx², n] all-reduced in
forward, [Σdy, Σdy·x̂] in backward, float64 (Ioffe & Szegedy 2015, §3; ``torch.nn.SyncBatchNorm``).
Design notes: docs/design/data_parallel.md
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..communicator import Communicator

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm"]


def _reduce_dims(x: torch.Tensor) -> list[int]:
    return [0] + list(range(2, x.dim()))


def _bcast(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return v.view(1, -1, *([1] * (x.dim() - 2)))


class _SyncBN(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, group, collectives):
        dims, C = _reduce_dims(x), x.shape[1]
        xd = x.double()
        stats = torch.cat([xd.sum(dims), (xd * xd).sum(dims),
                           torch.tensor([x.numel() // C if C else 0], dtype=torch.float64, device=x.device)])
        if dist.get_world_size(group) > 1:
            Communicator(collectives, group).all_reduce(stats, "sum")
        n = stats[-1]
        if n < 2 and running_var is not None:
            raise ValueError(f"SyncBatchNorm (rank {dist.get_rank(group)}): {int(n)} value(s) per "
                             "channel over all ranks; need at least 2 in training mode")
        mean = stats[:C] / n
        var = (stats[C:2 * C] / n - mean * mean).clamp_min(0)
        invstd = torch.rsqrt(var + eps)
        xhat = ((xd - _bcast(mean, x)) * _bcast(invstd, x)).to(x.dtype)
        y = xhat * _bcast(weight, x) + _bcast(bias, x) if weight is not None else xhat
        if running_mean is not None:
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(momentum * mean.to(running_mean.dtype))
                unbiased = var * n / (n - 1)
                running_var.mul_(1 - momentum).add_(momentum * unbiased.to(running_var.dtype))
        ctx.save_for_backward(xhat, weight, invstd.to(x.dtype))
        ctx.n, ctx.group, ctx.collectives = float(n), group, collectives
        return y

    @staticmethod
    def backward(ctx, dy):
        xhat, weight, invstd = ctx.saved_tensors
        dims, C = _reduce_dims(dy), dy.shape[1]
        sum_dy = dy.sum(dims)
        sum_dy_xhat = (dy * xhat).sum(dims)
        grad_w = sum_dy_xhat.clone() if weight is not None else None
        grad_b = sum_dy.clone() if weight is not None else None
        both = torch.cat([sum_dy, sum_dy_xhat])
        if dist.get_world_size(ctx.group) > 1:
            Communicator(ctx.collectives, ctx.group).all_reduce(both, "sum")
        g_dy, g_dy_xhat = both[:C], both[C:]
        scale = invstd if weight is None else invstd * weight
        dx = _bcast(scale / ctx.n, dy) * (ctx.n * dy - _bcast(g_dy, dy) - xhat * _bcast(g_dy_xhat, dy))
        return dx, grad_w, grad_b, None, None, None, None, None, None


class SyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm over [N, C, *] with training statistics over every rank of ``group``; as
    ``nn.BatchNorm1d/2d/3d`` plus ``group`` and ``collectives``. Collective forward and backward."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True, group=None,
                 collectives: str = "hand-built"):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.group, self.collectives = group, collectives

    def _check_input_dim(self, x):
        if x.dim() < 2:
            raise ValueError(f"SyncBatchNorm: expected input [N, C, *], got shape {tuple(x.shape)}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        if x.shape[1] != self.num_features:
            raise ValueError(f"SyncBatchNorm: expected {self.num_features} channels, got "
                             f"{x.shape[1]} (input shape {tuple(x.shape)})")
        use_batch_stats = self.training or not self.track_running_stats
        if not use_batch_stats:
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                                False, 0.0, self.eps)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                factor = 1.0 / float(self.num_batches_tracked)
        track = self.training and self.track_running_stats
        return _SyncBN.apply(x, self.weight, self.bias, self.running_mean if track else None,
                             self.running_var if track else None, self.eps, factor, self.group,
                             self.collectives)


def convert_sync_batchnorm(module: nn.Module, group=None,
                           collectives: str = "hand-built") -> nn.Module:
    """Replace every ``nn.BatchNorm1d/2d/3d`` in ``module`` by a :class:`SyncBatchNorm` (same state);
    returns the (possibly new) module."""
    out = module
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, SyncBatchNorm):
        out = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, group, collectives)
        if module.affine:
            with torch.no_grad():
                out.weight.copy_(module.weight)
                out.bias.copy_(module.bias)
            out.weight.requires_grad_(module.weight.requires_grad)
            out.bias.requires_grad_(module.bias.requires_grad)
        if module.track_running_stats:
            out.running_mean.copy_(module.running_mean)
            out.running_var.copy_(module.running_var)
            out.num_batches_tracked.copy_(module.num_batches_tracked)
        out.train(module.training)
    for name, child in module.named_children():
        out.add_module(name, convert_sync_batchnorm(child, group, collectives))
    return out
