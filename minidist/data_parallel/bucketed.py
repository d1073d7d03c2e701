"""DDP, version 3: gradient hooks fill buckets (packed as torch's DDP, :mod:`.buckets`), launched in
bucket order onto the communication thread while backward continues; at the end of backward each
``p.grad`` is a view of its averaged slot. Li et al. 2020, "PyTorch Distributed", §3.2.3, §4.
Design notes: docs/design/data_parallel.md
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from ..backward import in_nested_backward, sink
from .usage import gradient_users
from ..comm import bucket_size, tuner
from ..communicator import CommThread, Communicator
from ..trace import mark, span
from .base import DataParallelBase
from .buckets import Bucket, build_buckets, check_bucket_cap, pack_by_size  # noqa: F401  (re-exported)

__all__ = ["BucketedDDP", "Bucket", "build_buckets", "pack_by_size", "allreduce_hook"]


def allreduce_hook(state, bucket: Bucket, comm: Communicator) -> None:
    """The default communication hook: average ``bucket.buffer`` over ranks, in place."""
    comm.all_reduce(bucket.buffer, "avg")


class BucketedDDP(DataParallelBase):
    """Bucketed DDP, communication overlapped with backward. Besides the base's: ``bucket_cap_mb``
    (default: :func:`minidist.comm.bucket_size.bucket_cap_bytes`), ``first_bucket_cap_mb`` (bucket 0).
    Under a :meth:`minidist.trace.Timeline.observe`: "ready bK" marks, "all-reduce bK" on the comm
    lane, the end of backward's "wait" on main."""

    def __init__(self, module: nn.Module, bucket_cap_mb: float | None = None,
                 first_bucket_cap_mb: float | None = None, **kwargs):
        super().__init__(module, **kwargs)
        if bucket_cap_mb is None:   # the model's size (hand-built auto; torch's 25 MiB otherwise)
            comm = self.communicator
            auto = comm.collectives == "hand-built" and comm.algorithm == "auto"
            bucket_cap_mb = (bucket_size.bucket_cap_bytes(tuner.agreed_table(comm.group),
                                                          self.world_size) / 2**20
                             if auto else bucket_size.BUCKET_FLOOR / 2**20)
        check_bucket_cap(f"BucketedDDP (rank {self.rank})", "bucket_cap_mb", bucket_cap_mb)
        check_bucket_cap(f"BucketedDDP (rank {self.rank})", "first_bucket_cap_mb",
                         first_bucket_cap_mb, allow_none=True)
        self.bucket_cap_mb = bucket_cap_mb
        first = None if first_bucket_cap_mb is None else int(first_bucket_cap_mb * 2**20)
        self.buckets = build_buckets(self.params, self.param_names, int(bucket_cap_mb * 2**20),
                                     self.reduce_dtype, first, fill=True)
        # per parameter: its bucket, its index there, and its slot shaped like it (built once:
        # the hooks run 62 times a step on ResNet-18, on the thread that runs backward)
        self._where = {p: (b, i, b.views[i]) for b in self.buckets for i, p in enumerate(b.params)}
        self._hook, self._hook_state = allreduce_hook, None
        # the communication thread, on a process group of its own (see minidist.communicator)
        self._worker = CommThread(self.communicator)
        me = weakref.ref(self)  # neither the thread nor the hooks keep the wrapper alive
        self._me = me
        self._handles = [p.register_post_accumulate_grad_hook(_weak_hook(me))
                         for p in self.params]
        # when the wrapper is closed or garbage-collected: hooks removed, thread stopped
        self._finalizer = weakref.finalize(self, _shutdown, self._handles, self._worker)
        self._in_backward = False
        self._from_sink = False
        self._sink_task: int | None = None   # the graph task through forward's outputs, if any
        self._next_launch = 0
        self._spent: list[torch.Tensor] = []  # autograd's gradients, freed at the next forward
        self.ready_order: list[str] = []  # names, in the order the last backward produced them
        # (bucket index, gradients ready when it was launched): launched before the last gradient
        # was ready = its all-reduce overlapped the rest of backward
        self.launch_log: list[tuple[int, int]] = []

    # ------------------------------------------------------------------ inspection
    def bucket_layout(self) -> list[dict]:
        """One row per bucket: index, parameter names (in bucket order), elements and bytes."""
        return [{"bucket": b.index, "params": list(b.names), "numel": b.numel,
                 "bytes": b.numel * b.buffer.element_size()} for b in self.buckets]

    def register_comm_hook(self, state, hook) -> None:
        """Replace the bucket average by ``hook(state, bucket, communicator)`` (on the comm thread)."""
        if self._in_backward:
            raise RuntimeError("register_comm_hook during backward")
        self._hook, self._hook_state = hook, state

    def forward(self, *args, **kwargs):
        self._spent = []  # spent gradients (design notes, step 5): their pages go to this forward
        self._sink_task = None
        # the backward through these outputs tells the wrapper which graph task it is (so the
        # end-of-backward callback goes there, not on a reentrant checkpoint's nested one)
        return sink(super().forward(*args, **kwargs), self._on_outputs_backward)

    def _on_outputs_backward(self) -> None:
        task = torch._C._current_graph_task_id()
        if self._sink_task != task:    # once per graph task (several forwards: several sinks)
            self._sink_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_outputs_task)

    def _end_of_outputs_task(self) -> None:
        """The graph task through forward's outputs ended: finish the backward."""
        self._sink_task = None
        if self._in_backward:
            self._finish_backward()

    # ------------------------------------------------------------------ backward
    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if not self._check_decision("backward"):
            return  # inside no_sync(): p.grad accumulates locally
        if not self._in_backward:
            self._start_backward()
        bucket, i, view = self._where[p]
        if i in bucket.seen:
            raise RuntimeError(
                f"BucketedDDP (rank {self.rank}): gradient of {bucket.names[i]} produced twice in "
                "one backward: it is used both inside and outside a torch.utils.checkpoint("
                "use_reentrant=True) region (whose backward is a separate one), or a backward "
                "ran twice through one forward. Use checkpoint(..., use_reentrant=False); "
                "torch's DDP refuses this too ('Expected to mark a variable ready only once') "
                "unless static_graph=True")
        grad = p.grad
        if grad is not view and grad.data_ptr() != view.data_ptr():
            view.copy_(grad)  # else p.grad already is the slot (see _finish_backward)
        bucket.seen.add(i)
        bucket.filled += 1
        self.ready_order.append(bucket.names[i])
        if bucket.ready:
            mark(f"ready b{bucket.index}", "main")
            self._launch_in_order()

    def _start_backward(self) -> None:
        self._in_backward, self._from_sink = True, self._sink_task is not None
        self._next_launch = 0
        self.ready_order = []
        self.launch_log = []
        for b in self.buckets:
            b.filled, b.error = 0, None
            b.seen.clear()
            b.done.clear()
        if not self._from_sink:   # forward's outputs were not on this backward's path
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _launch_in_order(self) -> None:
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].ready:
            self.launch_log.append((self._next_launch, len(self.ready_order)))
            bucket = self.buckets[self._next_launch]
            self._worker.submit(f"all-reduce of bucket {bucket.index}", _run_bucket, self._me,
                                bucket)
            self._next_launch += 1

    def _run_bucket(self, bucket: Bucket, comm: Communicator) -> None:
        """On the comm thread: apply the hook (default: average) to one bucket."""
        try:
            with span(f"all-reduce b{bucket.index}", "comm"):
                self._hook(self._hook_state, bucket, comm)
        except BaseException as e:  # noqa: BLE001 - re-raised on the main thread
            bucket.error = e
        finally:
            bucket.done.set()

    def _finish_backward(self) -> None:
        """End of backward: handle missing gradients, wait for every bucket, copy averages back."""
        if not self._from_sink and in_nested_backward():
            # started by a gradient inside a reentrant checkpoint: the outer backward goes on
            raise RuntimeError(
                f"BucketedDDP (rank {self.rank}): the backward began inside a torch.utils."
                "checkpoint(use_reentrant=True) region, whose backward ends before the "
                "parameters outside it have gradients, because forward's output holds no tensor "
                "the wrapper could see (return tensors, or lists/tuples/dicts of them). Or use "
                "checkpoint(..., use_reentrant=False)")
        self._in_backward = False
        missing = [(b, i) for b in self.buckets for i in range(len(b.params)) if i not in b.seen]
        for b, i in missing:  # a zero contribution (refused below without find_unused_parameters)
            b.slot(i).zero_()
            b.filled += 1
        self._launch_in_order()
        with span("wait", "main"):
            for b in self.buckets:
                b.done.wait()
        for b in self.buckets:
            if b.error is not None:
                raise RuntimeError(f"BucketedDDP (rank {self.rank}): all-reduce of bucket "
                                   f"{b.index} failed: {b.error}") from b.error
        # which parameters did each rank use? Every rank asks (one small all-reduce), so that a
        # gradient missing on one rank is refused on all of them, after the buckets' collectives
        # matched: a rank raising alone would leave the others waiting in a bucket's all-reduce
        used = [i in b.seen for b in self.buckets for i in range(len(b.params))]
        flat = [b.params[i] for b in self.buckets for i in range(len(b.params))]
        box: list = []   # asked on the comm thread, on its group: the main thread issues no
        self._worker.submit(f"usage mask (rank {self.rank})", _ask_users, used, box,
                            flat[0].device if flat else None).wait()
        users = box[0]   # collective, so a profile of the main thread shows none of minidist's
        self._refuse_short(flat, users)
        unused_everywhere = {id(p) for p, u in zip(flat, users) if not u}
        spent = self._spent
        with torch.no_grad():
            for p, (_, _, avg) in self._where.items():
                if id(p) in unused_everywhere:
                    continue
                if p.grad is not None and p.grad is not avg:
                    spent.append(p.grad)   # freed at the next forward (design notes, step 5)
                if p.dtype != avg.dtype:   # e.g. bf16 parameters, fp32 buckets
                    p.grad = avg.to(p.dtype)
                elif p.grad is not avg:
                    # gradient as a view of its bucket (torch's gradient_as_bucket_view): no
                    # copy back now, and with zero_grad(set_to_none=False) backward then
                    # accumulates straight into the bucket, no copy in either
                    p.grad = avg

    def sync_gradients(self) -> None:
        """Nothing left to do: backward already waited for every bucket (kept for a uniform loop)."""
        if self._in_backward:
            raise RuntimeError("sync_gradients() called during backward")

    def close(self) -> None:
        """Remove the hooks and stop the communication thread."""
        self._finalizer()
        self._worker.close()
        self._spent = []


def _weak_hook(ref):
    def hook(p):
        ddp = ref()
        if ddp is not None:
            ddp._on_grad_ready(p)
    return hook


def _ask_users(comm: Communicator, used: list[bool], box: list, device) -> None:
    """On the communication thread: who gave each parameter a gradient (:mod:`.usage`)."""
    box.append(gradient_users(used, comm.rank, comm.world_size, comm.group, device))


def _run_bucket(comm: Communicator, ref, bucket: Bucket) -> None:
    """On the communication thread, in launch order: the bucket's hook or the average."""
    ddp = ref()
    if ddp is None:
        bucket.done.set()
        return
    ddp._run_bucket(bucket, comm)


def _shutdown(handles, worker: CommThread) -> None:
    for h in handles:
        h.remove()
    handles.clear()
    worker.stop()
