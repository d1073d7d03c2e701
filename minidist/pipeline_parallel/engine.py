"""One engine runs every schedule: walk this rank's op list, receive, compute, send.

For each op of ``schedule[rank]`` (see ``schedules.py``):

* ``F(m, s)``: take micro-batch ``m`` of the input (stage 0) or receive the activation from stage
  ``s-1``; run stage ``s``; on the last stage compute ``(n_m/N) · loss_fn(y, target_m)``, else
  send ``y`` to stage ``s+1``. Keep ``(x, y)`` for the backward.
* ``B(m, s)``: receive ``∂L/∂y`` from stage ``s+1`` (the last stage starts from its loss),
  backpropagate through stage ``s`` (parameter gradients accumulate across micro-batches), send
  ``∂L/∂x`` to stage ``s-1``.
* If the rank's list also has ``W(m, s)``, the backward is split (zero-bubble schedules,
  :mod:`.zero_bubble`): ``B`` computes only ``∂L/∂x`` and sends it at once; ``W`` computes the
  weight gradients later (:mod:`.split_backward`). The saved activations are freed at ``W``.

Because each micro-batch's mean loss is weighted by its share of the batch, the summed loss and
the accumulated gradients equal one process on the whole batch (to fp32 rounding), for any batch
size N >= M. The engine knows stages and micro-batches only: composing it with data parallelism
(the replicas' gradient average, the loss and token count over replicas) is
:func:`minidist.hybrid.dp_pipeline.dp_pipeline_step`'s.

That weighting is right for a loss that is a mean over *samples*. Two other reductions
(``loss_reduction``, see :mod:`.microbatch`): ``"sum"`` (each micro-batch's sum, weight 1) and
``"per_token"`` — ``loss_fn`` returns ``(sum, count)``,
e.g. the cross-entropy summed over the positions that are not ``ignore_index`` and their number;
each backward starts from the sum, and after the last one the gradients are divided by the
*global* count (summed over micro-batches, sent from the last stage to every stage of the
pipeline). Megatron-Core's ``calculate_per_token_loss``. Weighting
a per-micro-batch token mean by ``n_m/N`` instead is wrong whenever micro-batches hold different
numbers of counted tokens.
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
    """``loss``: the full-batch loss (a float) on the rank holding the last stage, None elsewhere.
    ``events``: this rank's timeline (empty unless ``record=True``), times in seconds from a barrier.
    ``peak_inflight`` / ``peak_activation_bytes``: {stage: peak micro-batches / bytes saved for
    backward}, measured. ``t0``: add it to align events of ranks on one machine (same clock)."""

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
    """What the forward and backward ops of one step share on this rank."""

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
    """F(m, s): take micro-batch m (stage 0) or receive the activation from stage s-1; run stage s;
    on the last stage add (n_m/N)·loss to the total, else send y to stage s+1; keep (x, y)."""
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
    """The scalar micro-batch m backpropagates: weighted mean, sum, or the token-loss sum."""
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


def _backward_op(st: _StepState, m: int, s: int) -> None:
    """B(m, s): receive dL/dy from stage s+1 (the last stage starts from its loss), backpropagate
    through stage s (parameter gradients accumulate), send dL/dx to stage s-1."""
    x, y = st.saved.pop((m, s))
    last = st.schedule.n_stages - 1
    grad = None if s == last else st.transport.recv(st.schedule.owner(s + 1), "grad", m, s + 1, s)
    start = st.clock()
    if (m, s) in st.split:  # B of a split backward: the input gradient only, W comes later
        gx, st.pending_w[(m, s)] = backward_input(y, grad, x, st.modules[s].parameters())
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
    """W(m, s): the weight gradients of a split backward (accumulate into ``.grad``); frees the
    micro-batch's saved activations."""
    start = st.clock()
    ctx = (st.backward_context(s, m, st.last_backward[s] == m) if st.backward_context
           else contextlib.nullcontext())
    with ctx:
        backward_weight(st.pending_w.pop((m, s)))
    st.meter.backward(s, m)
    st.events.append(Event("W", start, st.clock(), rank=st.rank, mb=m, stage=s))


def pipeline_step(schedule: Schedule, modules: dict[int, nn.Module], inputs, targets, loss_fn,
                  group=None, record: bool = False, device=None,
                  prefetch: bool | None = None, loss_reduction: str = "mean",
                  backward_context=None, autocast_dtype: torch.dtype | None = None) -> StepResult:
    """Run one training step's forwards and backwards of ``schedule`` on this rank.

    Args:
        schedule: a :class:`Schedule` whose ``P`` equals the size of ``group``.
        modules: {stage: module} for exactly the stages this rank holds (:func:`local_stages`).
        inputs: the whole batch ``[N, ...]`` — used on the rank holding stage 0 (None elsewhere).
        targets: the whole batch's targets ``[N, ...]`` — used on the rank holding the last stage.
        loss_fn: ``loss_fn(output, target) -> scalar``, a *mean* over the micro-batch (or as
            ``loss_reduction`` says).
        group: the pipeline process group (ranks inside it are pipeline ranks); default: world.
        loss_reduction: ``"mean"`` (over samples; weights ``n_m/N``), ``"sum"`` or
            ``"per_token"`` (``loss_fn`` returns ``(sum, count)``; gradients divided by the global
            count).
        backward_context: ``f(stage, mb, last) -> context manager`` entered around each backward;
            ``last`` is True for the stage's last backward of the step (its last W when the
            backward is split: where the weight gradients are final) (where a bucketed DDP wrapper
            must synchronise, Narayanan et al. 2021 §3.3).
        autocast_dtype: mixed precision: each forward (stage and loss) runs under
            ``torch.autocast(device.type, dtype=autocast_dtype)`` (e.g. ``torch.bfloat16``), the
            backwards outside it, as torch's AMP recipe says; parameters and their gradients stay
            in their own dtype, activations travel in the dtype the stage returns.
        record: keep a timeline of compute and communication events.
        device: where received tensors and micro-batches go (default ``minidist.env.device()``:
            ``cuda:LOCAL_RANK`` with nccl, the CPU with gloo); the modules must already be there.
        prefetch: receive on a background thread in schedule order (overlaps comm and compute);
            False: receive when the op needs it (simplest). Default: True on gloo; False on other
            backends (NCCL matches messages in issue order, so one thread keeps the schedule's
            order — see ``simulator.message_order_mismatches``).

    Gradients accumulate into ``.grad`` (zero them before the step). The optimizer step is yours.

    Raises:
        ValueError: the schedule does not fit the group, the modules are not this rank's stages,
            or the batch has fewer than M samples, or ``loss_reduction`` is unknown.
        ScheduleError: a list that misses, repeats or misplaces an op (a W before its B).
    """
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
    if record:
        dist.barrier(group=group)
    t0 = time.perf_counter()

    def clock():
        return time.perf_counter() - t0

    transport = Transport(group, device, clock if record else None)
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
    events = []
    if record:
        events = st.events + [Event(k, a, b, rank=rank, mb=mb, stage=s)
                              for k, mb, s, a, b in transport.events]
        events.sort(key=lambda e: e.start)
    local = None if st.total is None else float(st.total)
    if local is not None and loss_reduction == "per_token":
        local = local / st.count if st.count else float("nan")
    return StepResult(local, events, dict(st.meter.peak_inflight), dict(st.meter.peak_bytes), t0,
                      global_loss, tokens)


def scale_gradients(modules: dict[int, nn.Module], scale: float) -> None:
    """Multiply every gradient of this rank's stages ``modules`` by ``scale``, each parameter once
    (a tied parameter two of its stages share is scaled once)."""
    seen: set[int] = set()
    for s in sorted(modules):
        for p in modules[s].parameters():
            if p.grad is not None and id(p) not in seen:
                seen.add(id(p))
                p.grad.mul_(scale)


def _reduce_loss(st: _StepState, modules, group, reduction: str):
    """Sum [loss, count] over the pipeline (only the last stage's are non-zero: a broadcast to
    every stage); "per_token": divide this rank's gradients by the count, so they are the
    gradient of the batch's token mean."""
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
