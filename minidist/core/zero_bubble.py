"""Zero-bubble pipelines: each backward split into B (the input gradient) and W (the weight gradients).

The previous stage waits for dL/dx only; nobody needs dL/dW before the optimizer step. So B computes
dL/dx alone and sends it at once, and W, placed later where the rank would idle, computes the
weight gradients. ZB-H1 keeps 1F1B's order of F and B, and on stage r runs W of micro-batch k after
B of k + r: with F, B and W of equal cost, a third of 1F1B's bubble is left.
Here W runs the backward again into the parameters only, repeating B's work on the input path above
them (the library's split_backward keeps B's gradients at that boundary instead, as
torch.distributed.pipelining's stage_backward_weight does).
Source: Qi et al. 2023, "Zero Bubble Pipeline Parallelism" §2-3 (arXiv:2401.10241).
"""

import torch

from .pipeline import PipelineStage


def backward_input(y, dy, x):
    """B: dL/dx for the stage output ``y`` (``dy`` None: y is the loss); no ``.grad`` changes."""
    (dx,) = torch.autograd.grad(y, x, dy, retain_graph=True)   # the graph stays for W
    return dx


def backward_weight(y, dy, params):
    """W: the weight gradients of ``y``, accumulated into ``.grad``; frees the graph."""
    torch.autograd.backward(y, dy, inputs=list(params))


def zb_h1(P, M, rank):
    """Stage ``rank``'s ops: 1F1B's F and B, each ``("W", k)`` after ``("B", k + rank)``."""
    warmup = min(P - 1 - rank, M)
    ops = [("F", m) for m in range(warmup)]
    for b in range(M):
        if warmup + b < M:
            ops.append(("F", warmup + b))
        ops.append(("B", b))
        if b >= rank:   # W lags its B by `rank` backwards: they fill the drain's idle time
            ops.append(("W", b - rank))
    return ops + [("W", m) for m in range(max(M - rank, 0), M)]


class ZeroBubbleStage(PipelineStage):
    """A pipeline stage whose backward is B now, W later."""

    WORK = {**PipelineStage.WORK, "W": "weight"}

    def backward(self, m):
        """B: receive dL/dy, send dL/dx at once; keep dL/dy and the graph for W."""
        x, y = self.saved[m]
        dy = None if self.last else self._recv(self.rank + 1, like=y)
        self.saved[m] = (x, y, dy)
        if not self.first:
            self._send(backward_input(y, dy, x), self.rank - 1)

    def weight(self, m):
        """W: the weight gradients of micro-batch m; its activations are freed."""
        _, y, dy = self.saved.pop(m)
        backward_weight(y, dy, self.module.parameters())


def pipeline_step(module, inputs, targets, loss_fn, M, group=None):
    """One step in ZB-H1 order; gradients accumulate into ``.grad``; the loss on the last stage."""
    stage = ZeroBubbleStage(module, inputs, targets, loss_fn, M, group)
    return stage.run(zb_h1(stage.P, M, stage.rank))
