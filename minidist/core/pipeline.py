"""Pipeline parallelism: the 1F1B schedule, and one rank's stage that runs it.

The model is cut by depth into P stages, one per rank of the pipeline group, and the batch into M
micro-batches. 1F1B (PipeDream-Flush) runs P-1-r warm-up forwards on stage r, then alternates one
forward and one backward, then drains the remaining backwards: GPipe's bubble (P-1)/(M+P-1), but
at most P-r micro-batches of activations held instead of M. Activations go forward and gradients
back point to point; every send is a non-blocking ``dist.isend``, so a stage only ever waits in the
receive its next op needs, and the stages' 1F1B orders fit together without a circular wait.
Sources: Narayanan et al. 2021 (PipeDream-Flush; Megatron-LM §2.2); Megatron-LM's
forward_backward_pipelining_without_interleaving; picotron's pipeline_parallel.py.
"""

import torch
import torch.distributed as dist


def one_f_one_b(P, M, rank):
    """Stage ``rank``'s ops in order: ``("F", m)`` / ``("B", m)``, forward / backward of micro-batch m."""
    warmup = min(P - 1 - rank, M)
    ops = [("F", m) for m in range(warmup)]
    for i in range(M - warmup):                                # steady state: one F, one B
        ops += [("F", warmup + i), ("B", i)]
    return ops + [("B", m) for m in range(M - warmup, M)]      # cool-down


class PipelineStage:
    """One rank's stage: ``module`` and its micro-batches in flight. ``inputs [N, ...]`` is read on
    the first stage, ``targets [N, ...]`` on the last (``loss_fn``: a mean over the micro-batch)."""

    WORK = {"F": "forward", "B": "backward"}

    def __init__(self, module, inputs, targets, loss_fn, M, group=None):
        self.module, self.loss_fn, self.group = module, loss_fn, group
        self.rank, self.P = dist.get_rank(group), dist.get_world_size(group)
        self.first, self.last = self.rank == 0, self.rank == self.P - 1
        if self.first:
            self.inputs = inputs.tensor_split(M)
        if self.last:
            self.targets = targets.tensor_split(M)
            self.weights = [len(t) / len(targets) for t in self.targets]   # n_m / N
        self.saved, self.sends, self.loss = {}, [], None

    def _send(self, tensor, to, shape=False):
        """Post ``tensor`` to stage ``to`` (first its shape, when the receiver cannot know it)."""
        tensor = tensor.detach().contiguous()
        msgs = [torch.tensor([tensor.dim(), *tensor.shape] + [0] * (7 - tensor.dim()))] if shape else []
        peer = to if self.group is None else dist.get_global_rank(self.group, to)
        for t in msgs + [tensor]:
            self.sends.append((dist.isend(t, peer, self.group), t))   # keep t alive until sent

    def _recv(self, frm, like=None):
        """Receive from stage ``frm``: a tensor shaped like ``like``, or of the shape sent first."""
        peer = frm if self.group is None else dist.get_global_rank(self.group, frm)
        if like is None:
            head = torch.empty(8, dtype=torch.int64)
            dist.recv(head, peer, self.group)
            like = torch.empty(head[1:1 + head[0]].tolist())   # in the default dtype
        out = torch.empty_like(like)
        dist.recv(out, peer, self.group)
        return out

    def forward(self, m):
        """F: micro-batch m through the stage; the last stage adds its share of the batch's loss."""
        x = self.inputs[m] if self.first else self._recv(self.rank - 1).requires_grad_()
        y = self.module(x)
        if self.last:
            y = self.loss_fn(y, self.targets[m]) * self.weights[m]
            self.loss = y.detach() if self.loss is None else self.loss + y.detach()
        else:
            self._send(y, self.rank + 1, shape=True)
        self.saved[m] = (x, y)   # kept until the backward: the activations 1F1B bounds

    def backward(self, m):
        """B: dL/dy from the next stage (the loss on the last), backpropagate, dL/dx to the previous."""
        x, y = self.saved.pop(m)
        dy = None if self.last else self._recv(self.rank + 1, like=y)
        torch.autograd.backward(y, dy)   # parameter gradients accumulate over the micro-batches
        if not self.first:
            self._send(x.grad, self.rank - 1)

    def run(self, ops):
        """Execute ``ops`` in order, wait for the sends; the batch's loss (last stage) or None."""
        for kind, m in ops:
            getattr(self, self.WORK[kind])(m)
        for work, _ in self.sends:
            work.wait()
        return None if self.loss is None else float(self.loss)


def pipeline_step(module, inputs, targets, loss_fn, M, group=None):
    """One step's forwards and backwards in 1F1B order; gradients accumulate into ``.grad``."""
    stage = PipelineStage(module, inputs, targets, loss_fn, M, group)
    return stage.run(one_f_one_b(stage.P, M, stage.rank))
