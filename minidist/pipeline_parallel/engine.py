"""One engine runs every schedule: walk this rank's op list, receive, compute, send.

F runs a stage (the last adds its weighted loss), B backpropagates, W (split backward) computes
weight gradients later. Weighted micro-batch losses make the step equal one process on the batch.
Design notes: docs/design/pipeline_parallel.md
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from .. import collectives as C, env
from ..trace import Event
from . import microbatch
from .memory import StageActivationMeter
from .schedules import Schedule, ScheduleError, validate
from .split_backward import backward_input, backward_weight
from .transport import Transport

__all__ = ["pipeline_step", "StepResult", "local_stages", "recv_plan"]


@dataclass
class StepResult:
    """``loss``: full-batch loss on the last stage's rank (None elsewhere); ``events``: the F, B
    and W ops run (the transport's sends and receives are spans: observe a
    :class:`~minidist.trace.Timeline`); ``peak_inflight`` / ``peak_activation_bytes``: {stage:
    peak}; ``t0``: clock offset."""

    loss: float | None
    events: list = field(default_factory=list)
    peak_inflight: dict = field(default_factory=dict)
    peak_activation_bytes: dict = field(default_factory=dict)
    t0: float = 0.0  # this rank's time.perf_counter() at the start (events are relative to it)
    global_loss: float | None = None  # "sum"/"per_token": the loss of the global batch (all ranks)
    tokens: float | None = None       # "per_token": the global count the gradients were divided by


def local_stages(stages: list[nn.Module], schedule: Schedule, rank: int) -> dict[int, nn.Module]:
    """{stage index: module} of the stages ``rank`` holds (``stages`` has all ``P·v`` of them)."""
    if len(stages) != schedule.n_stages:
        raise ValueError(f"schedule {schedule.name} has {schedule.n_stages} stages (P={schedule.P} x "
                         f"v={schedule.v}), but the model was split into {len(stages)}")
    return {s: stages[s] for s in schedule.stages_of(rank)}


def recv_plan(schedule: Schedule, rank: int) -> list[tuple]:
    """The receives ``rank`` makes, in schedule order: (peer, kind, mb, from_stage, to_stage)."""
    last, plan = schedule.n_stages - 1, []
    for op in schedule[rank]:
        if op.kind == "F" and op.stage > 0:
            plan.append((schedule.owner(op.stage - 1), "act", op.mb, op.stage - 1, op.stage))
        elif op.kind == "B" and op.stage < last:
            plan.append((schedule.owner(op.stage + 1), "grad", op.mb, op.stage + 1, op.stage))
    return plan


@dataclass
class _StepState:

    schedule: Schedule
    modules: dict
    rank: int
    device: object
    transport: Transport
    meter: StageActivationMeter
    clock: object
    loss_fn: object
    mb_inputs: list | None = None     # on the rank holding stage 0
    mb_targets: list | None = None    # on the rank holding the last stage
    weights: list | None = None       # n_m / N per micro-batch (last stage)
    reduction: str = "mean"
    backward_context: object = None   # (stage, mb, last) -> context manager around a backward
    autocast_dtype: torch.dtype | None = None   # mixed precision: the forwards' autocast dtype
    last_backward: dict = field(default_factory=dict)  # stage -> mb of its last B op here
    count: float = 0.0                # "per_token": counted tokens so far (last stage)
    saved: dict = field(default_factory=dict)   # (mb, stage) -> (x, y) kept for the backward
    split: set = field(default_factory=set)     # (mb, stage) whose backward is B then W
    pending_w: dict = field(default_factory=dict)  # (mb, stage) -> WeightGrad, from B to W
    events: list = field(default_factory=list)
    total: torch.Tensor | None = None             # the summed weighted loss (last stage)


def _forward_op(st: _StepState, m: int, s: int) -> None:
    """F(m, s): input or receive; run stage s; loss on the last stage, else send."""
    last = st.schedule.n_stages - 1
    if s == 0:
        x = st.mb_inputs[m].to(st.device)
    else:
        x = st.transport.recv(st.schedule.owner(s - 1), "act", m, s - 1, s)
        if x.is_floating_point():
            x.requires_grad_()
    start = st.clock()
    autocast = (torch.autocast(torch.device(str(st.device)).type, dtype=st.autocast_dtype)
                if st.autocast_dtype is not None else contextlib.nullcontext())
    with st.meter.forward(s, m), autocast:
        y = st.modules[s](x)
        if s == last:
            y = _micro_loss(st, st.loss_fn(y, st.mb_targets[m].to(st.device)), m)
    st.events.append(Event("F", start, st.clock(), rank=st.rank, mb=m, stage=s))
    if s == last:
        st.total = y.detach() if st.total is None else st.total + y.detach()
    else:
        st.transport.send(y, st.schedule.owner(s + 1), "act", m, s, s + 1)
    st.saved[(m, s)] = (x, y)


def _micro_loss(st: _StepState, out, m: int) -> torch.Tensor:
    if st.reduction == "mean":
        return out * st.weights[m]
    if st.reduction == "sum":
        return out
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise ValueError(f"pipeline_step (rank {st.rank}): loss_reduction='per_token' needs "
                         f"loss_fn to return (sum, count), got {type(out).__name__}")
    total, count = out
    st.count += float(count)
    return total


def _weight_leaves(module: nn.Module) -> list:
    """Where W's weight gradients accumulate: the parameters, and each ``fully_shard`` unit's
    gathered buffer (the forward used views of it; its hook reduce-scatters), as torch's pipelining
    runs W on whatever parameters FSDP2 has registered while unsharded."""
    units = [getattr(m, "_fsdp", None) for m in module.modules()]
    return list(module.parameters()) + [u.full for u in units
                                        if u is not None and getattr(u, "layout", None) is not None]


def _backward_op(st: _StepState, m: int, s: int) -> None:
    """B(m, s): receive dL/dy (or start from the loss), backpropagate, send dL/dx."""
    x, y = st.saved.pop((m, s))
    last = st.schedule.n_stages - 1
    grad = None if s == last else st.transport.recv(st.schedule.owner(s + 1), "grad", m, s + 1, s)
    start = st.clock()
    if (m, s) in st.split:  # B of a split backward: the input gradient only, W comes later
        gx, st.pending_w[(m, s)] = backward_input(y, grad, x, _weight_leaves(st.modules[s]))
        st.events.append(Event("B", start, st.clock(), rank=st.rank, mb=m, stage=s))
        if s > 0:
            gx = gx if gx is not None else torch.zeros_like(x)
            st.transport.send(gx, st.schedule.owner(s - 1), "grad", m, s, s - 1)
        return
    if y.requires_grad:
        ctx = (st.backward_context(s, m, st.last_backward[s] == m) if st.backward_context
               else contextlib.nullcontext())
        with ctx:
            torch.autograd.backward(y, grad)
    st.meter.backward(s, m)
    st.events.append(Event("B", start, st.clock(), rank=st.rank, mb=m, stage=s))
    if s > 0:
        gx = x.grad if x.grad is not None else torch.zeros_like(x)
        st.transport.send(gx, st.schedule.owner(s - 1), "grad", m, s, s - 1)


def _weight_op(st: _StepState, m: int, s: int) -> None:
    """W(m, s): a split backward's weight gradients; frees the saved activations."""
    start = st.clock()
    ctx = (st.backward_context(s, m, st.last_backward[s] == m) if st.backward_context
           else contextlib.nullcontext())
    with ctx:
        backward_weight(st.pending_w.pop((m, s)))
    st.meter.backward(s, m)
    st.events.append(Event("W", start, st.clock(), rank=st.rank, mb=m, stage=s))


def pipeline_step(schedule: Schedule, modules: dict[int, nn.Module], inputs, targets, loss_fn,
                  group=None, device=None,
                  prefetch: bool | None = None, loss_reduction: str = "mean",
                  backward_context=None, autocast_dtype: torch.dtype | None = None) -> StepResult:
    """Run one step's forwards and backwards of ``schedule`` on this rank.

    ``modules``: {stage: module} of this rank (:func:`local_stages`); ``inputs`` ``[N, ...]`` (stage 0's
    rank) and ``targets`` ``[N, ...]`` (last stage's rank); ``loss_fn(output, target)``: a mean
    (``loss_reduction="mean"``), a sum (``"sum"``) or ``(sum, count)`` (``"per_token"``).
    ``backward_context(stage, mb, last)``: a context manager around each backward; ``autocast_dtype``:
    forwards under autocast; ``prefetch``: receive on a thread (default: gloo only). Gradients
    accumulate into ``.grad``; the optimizer step is yours.

    Raises ``ValueError`` (schedule does not fit the group, wrong modules, fewer than M samples,
    unknown ``loss_reduction``) and ``ScheduleError`` (an op missing, repeated or misplaced)."""
    rank = dist.get_rank(group)
    P = dist.get_world_size(group)
    try:
        validate(schedule)  # every rank checks every list: all raise, none waits for the others
    except ScheduleError as e:
        raise ScheduleError(f"pipeline_step (rank {rank}): {e}") from None
    if schedule.P != P:
        raise ValueError(f"pipeline_step (rank {rank}): schedule {schedule.name} is for P={schedule.P} "
                         f"ranks, the pipeline group has {P}")
    if sorted(modules) != schedule.stages_of(rank):
        raise ValueError(f"pipeline_step (rank {rank}): got modules for stages {sorted(modules)}, "
                         f"this rank holds stages {schedule.stages_of(rank)} (use local_stages)")
    if loss_reduction not in microbatch.REDUCTIONS:
        raise ValueError(f"pipeline_step (rank {rank}): loss_reduction must be one of "
                         f"{microbatch.REDUCTIONS}, got {loss_reduction!r}")
    device = device or env.device()
    M, last = schedule.M, schedule.n_stages - 1
    mb_inputs = microbatch.split(inputs, M, "input batch") if 0 in modules else None
    mb_targets = microbatch.split(targets, M, "target batch") if last in modules else None
    weights = microbatch.loss_weights(targets.shape[0], M) if last in modules else None
    t0 = time.perf_counter()

    def clock():
        return time.perf_counter() - t0

    transport = Transport(group, device)
    split = schedule.split(rank)
    st = _StepState(schedule, modules, rank, device, transport, StageActivationMeter(modules), clock,
                    loss_fn, mb_inputs, mb_targets, weights, loss_reduction, backward_context,
                    autocast_dtype,
                    {op.stage: op.mb for op in schedule[rank]
                     if op.kind == "W" or (op.kind == "B" and (op.mb, op.stage) not in split)},
                    split=split)
    if prefetch if prefetch is not None else dist.get_backend(group) == "gloo":
        transport.start_prefetch(recv_plan(schedule, rank))
    run_op = {"F": _forward_op, "B": _backward_op, "W": _weight_op}
    for op in schedule[rank]:
        run_op[op.kind](st, op.mb, op.stage)
    transport.finish()
    global_loss = tokens = None
    if loss_reduction != "mean":
        global_loss, tokens = _reduce_loss(st, modules, group, loss_reduction)
    local = None if st.total is None else float(st.total)
    if local is not None and loss_reduction == "per_token":
        local = local / st.count if st.count else float("nan")
    return StepResult(local, st.events, dict(st.meter.peak_inflight), dict(st.meter.peak_bytes), t0,
                      global_loss, tokens)


def scale_gradients(modules: dict[int, nn.Module], scale: float) -> None:
    """Multiply every gradient of ``modules`` by ``scale``, each (tied) parameter once."""
    seen: set[int] = set()
    for s in sorted(modules):
        for p in modules[s].parameters():
            if p.grad is not None and id(p) not in seen:
                seen.add(id(p))
                p.grad.mul_(scale)


def _reduce_loss(st: _StepState, modules, group, reduction: str):
    """Sum [loss, count] over the pipeline; per_token: divide the gradients by the count."""
    stats = torch.tensor([0.0 if st.total is None else float(st.total), st.count],
                         dtype=torch.float64, device=st.device)
    if dist.get_world_size(group) > 1:
        C.all_reduce(stats, "sum", group=group)
    loss_sum, count = stats.tolist()
    if reduction == "sum":
        scale, value, count = 1.0, loss_sum, None
    else:  # count 0 (every position ignored): nan, as F.cross_entropy's mean
        scale = 1 / count if count else float("nan")
        value = loss_sum / count if count else float("nan")
    if scale != 1.0:
        scale_gradients(modules, scale)
    return value, count
