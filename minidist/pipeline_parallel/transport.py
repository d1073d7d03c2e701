"""Activations forward, gradients backward: point-to-point with a small header (minidist.comm.p2p).

Each message is a header ``[kind, mb, from-stage, dtype, ndim, *shape]`` then the payload, checked
by the receiver. On gloo a payload of at most :data:`INLINE_BYTES` travels in the header's message
(the receiver posts a buffer that large: gloo accepts a longer buffer than the message, and moves a
message only once its receive is posted, so a second message would wait a round trip more). Sends
are non-blocking and waited for at the end of the step.
Design notes: docs/design/pipeline_parallel.md
"""

from __future__ import annotations

import math
import struct
import threading

import torch
import torch.distributed as dist

from ..comm import p2p
from ..trace import span

__all__ = ["Transport", "HEADER_LEN", "INLINE_BYTES", "TransportError"]

HEADER_LEN = 12
INLINE_BYTES = 1 << 12   # gloo: a payload this small rides in the header's message
_MAX_DIMS = HEADER_LEN - 5
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64]
_KINDS = {"act": 0, "grad": 1}
_ITEMSIZE = [torch.empty(0, dtype=d).element_size() for d in _DTYPES]
_HEADER = struct.Struct(f"<{HEADER_LEN}q")   # packed in Python: a message costs few tensor ops


class TransportError(RuntimeError):
    """A received header is not the message this stage expected (or a tensor cannot be sent)."""


def _tag(kind: str, mb: int, from_stage: int) -> int:
    return 1 + (mb * 1024 + from_stage) * 2 + _KINDS[kind]


class Transport:
    """Pipeline messages for one rank of ``group``: ``send`` non-blocking (kept alive until
    :meth:`finish`), ``recv`` blocking. Under a :meth:`minidist.trace.Timeline.observe`: spans
    ``"send"`` (posting), ``"recv"`` (waiting for a message) and ``"send wait"`` (the end)."""

    def __init__(self, group=None, device=None):
        self.group = group
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.device = device or torch.device("cpu")
        self.pending = []  # (works, tensors) until finish()
        self.mailbox = {}  # local hand-offs
        self._thread = None
        self.inline = dist.is_initialized() and dist.get_backend(group) == "gloo"

    def _label(self, what: str, kind: str, mb: int, a: int, b: int) -> str:
        return f"pp/{what} {kind} mb {mb} stage {a}->{b}"

    def send(self, tensor: torch.Tensor, peer: int, kind: str, mb: int, from_stage: int,
             to_stage: int) -> None:
        """Post ``tensor`` (activation or gradient of micro-batch ``mb``) to group rank ``peer``."""
        tensor = tensor.detach()
        if peer == self.rank:
            self.mailbox[(kind, mb, from_stage)] = tensor
            return
        with span("send", rank=self.rank, mb=mb, stage=from_stage):
            self._post(tensor, peer, kind, mb, from_stage, to_stage)

    def _post(self, tensor, peer: int, kind: str, mb: int, from_stage: int, to_stage: int) -> None:
        if tensor.dim() > _MAX_DIMS or tensor.dtype not in _DTYPES:
            raise TransportError(f"pipeline send (rank {self.rank}, stage {from_stage}->{to_stage}): "
                                 f"cannot send a {tensor.dim()}-d {tensor.dtype} tensor (at most "
                                 f"{_MAX_DIMS} dims, dtypes {_DTYPES})")
        fields = (_KINDS[kind], mb, from_stage, _DTYPES.index(tensor.dtype), tensor.dim(),
                  *tensor.shape)
        header = _HEADER.pack(*fields, *(0,) * (HEADER_LEN - len(fields)))
        tag = _tag(kind, mb, from_stage)
        nbytes = tensor.numel() * tensor.element_size()
        if self.inline and nbytes <= INLINE_BYTES:   # one message: header bytes, then payload bytes
            payload = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            parts = [torch.frombuffer(bytearray(header + payload), dtype=torch.uint8)]
        else:
            parts = [torch.frombuffer(bytearray(header), dtype=torch.int64).to(self.device),
                     tensor.contiguous()]
        with p2p.collective(self._label("send", kind, mb, from_stage, to_stage)):
            works = [p2p.isend(t, peer, self.group, tag=tag) for t in parts]
        self.pending.append((works, parts))

    def recv(self, peer: int, kind: str, mb: int, from_stage: int, to_stage: int) -> torch.Tensor:
        """Block until the ``kind`` message of micro-batch ``mb`` from ``from_stage`` arrives."""
        if peer == self.rank:
            key = (kind, mb, from_stage)
            if key not in self.mailbox:
                raise TransportError(f"pipeline recv (rank {self.rank}, stage {to_stage}): {kind} of "
                                     f"micro-batch {mb} from stage {from_stage} (same rank) was "
                                     "never produced: the schedule runs this op too early")
            return self.mailbox.pop(key)
        with span("recv", rank=self.rank, mb=mb, stage=to_stage):
            return self._recv_remote(peer, kind, mb, from_stage, to_stage)

    def _recv_remote(self, peer: int, kind: str, mb: int, from_stage: int, to_stage: int):
        if self._thread is not None:
            # say what the main thread waits for (the launcher's timeout report shows it); the
            # receive thread publishes its own op too, whichever speaks last is shown
            p2p.publish(f"{self._label('recv', kind, mb, from_stage, to_stage)}: waiting for the "
                         f"prefetch thread (receiving from rank {peer})")
            return self._take((kind, mb, from_stage))
        return self._recv_now(peer, kind, mb, from_stage, to_stage)

    def _recv_now(self, peer: int, kind: str, mb: int, from_stage: int, to_stage: int):
        tag = _tag(kind, mb, from_stage)
        with p2p.collective(self._label("recv", kind, mb, from_stage, to_stage)):
            if self.inline:
                message = torch.empty(8 * HEADER_LEN + INLINE_BYTES, dtype=torch.uint8)
                p2p.recv(message, peer, self.group, tag=tag)
                header = message[:8 * HEADER_LEN].view(torch.int64)
            else:
                header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
                p2p.recv(header, peer, self.group, tag=tag)
            h = _HEADER.unpack(header.cpu().numpy().tobytes())
            want = [_KINDS[kind], mb, from_stage]
            if list(h[:3]) != want:
                names = {v: k for k, v in _KINDS.items()}
                raise TransportError(
                    f"pipeline recv (rank {self.rank}, stage {to_stage}): expected {kind} of "
                    f"micro-batch {mb} from stage {from_stage}, got {names.get(h[0], h[0])} of "
                    f"micro-batch {h[1]} from stage {h[2]}: the two stages' schedules disagree")
            shape, dtype = h[5:5 + h[4]], _DTYPES[h[3]]
            nbytes = math.prod(shape) * _ITEMSIZE[h[3]]
            if self.inline and nbytes <= INLINE_BYTES:
                start = 8 * HEADER_LEN
                return message[start:start + nbytes].view(dtype).reshape(shape).to(self.device,
                                                                                     copy=True)
            out = torch.empty(shape, dtype=dtype, device=self.device)
            p2p.recv(out, peer, self.group, tag=tag)
        return out

    # ---- prefetch: receive ahead, in schedule order, on a background thread ------------------
    def start_prefetch(self, plan: list[tuple]) -> None:
        """Receive ``plan`` [(peer, kind, mb, from_stage, to_stage), ...] in schedule order on a
        background thread."""
        plan = [p for p in plan if p[0] != self.rank]
        if not plan:
            return
        self._ready: dict = {}
        self._error, self._cv = None, threading.Condition()

        def loop():
            try:
                for peer, kind, mb, a, b in plan:
                    t = self._recv_now(peer, kind, mb, a, b)
                    with self._cv:
                        self._ready[(kind, mb, a)] = t
                        self._cv.notify_all()
            except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
                with self._cv:
                    self._error = e
                    self._cv.notify_all()

        self._thread = threading.Thread(target=loop, name="pp-recv", daemon=True)
        self._thread.start()

    def _take(self, key):
        with self._cv:
            while key not in self._ready:
                if self._error is not None:
                    raise self._error
                self._cv.wait(0.5)
            return self._ready.pop(key)

    def finish(self) -> None:
        """Wait for every posted send (call at the end of a step)."""
        with p2p.collective("pp/finish sends"):
            if self.pending:   # a span only where sends were posted (pp = 1 posts none)
                with span("send wait", rank=self.rank):
                    p2p.wait_all(w for works, _ in self.pending for w in works)
        self.pending.clear()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.mailbox:
            raise TransportError(f"pipeline (rank {self.rank}): messages never consumed: "
                                 f"{sorted(self.mailbox)}")
