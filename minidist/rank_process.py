"""What runs inside each rank that :func:`minidist.run` starts.

In order: one intra-op thread (a forked child of a process that already used intra-op threads
hangs on its first parallel op otherwise), die with the parent (PR_SET_PDEATHSIG), environment
like torchrun's (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT), stdout/stderr forwarded to the
parent line by line, a faulthandler stack dump on SIGUSR1 (the launcher's timeout report), the
rendezvous (rank 0 binds the TCPStore on a free port), the process group, the user's function, and
the result or the traceback sent back as bytes.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import signal
import sys
import threading
import traceback

import cloudpickle
import torch
import torch.distributed as dist

from . import env as _env
from .comm import p2p

class _QueueWriter:
    """Replaces sys.stdout/sys.stderr in a rank: forwards text to the parent line by line."""

    def __init__(self, q, rank: int, stream: str):
        self.q, self.rank, self.stream, self.buf = q, rank, stream, ""

    def write(self, text: str) -> int:
        self.buf += text
        if "\n" in text or "\r" in text or len(self.buf) > 4096:
            self.flush()
        return len(text)

    def flush(self) -> None:
        if self.buf:
            self.q.put(("out", self.rank, self.stream, self.buf))
            self.buf = ""

    def isatty(self) -> bool:
        return False

    @property
    def encoding(self) -> str:
        return "utf-8"


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu() if obj.device.type != "cpu" else obj.detach()
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(_to_cpu(o) for o in obj)
    if isinstance(obj, dict) and type(obj) is dict:
        return {k: _to_cpu(v) for k, v in obj.items()}
    return obj


def main(rank, world_size, payload, rendezvous, backend, pg_timeout_s, q, shm, dump_path):
    torch.set_num_threads(1)  # first: see the module docstring
    _die_with_parent()
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      OMP_NUM_THREADS="1", MINIDIST_RUN="1")
    sys.stdout = _QueueWriter(q, rank, "stdout")
    sys.stderr = _QueueWriter(q, rank, "stderr")
    dump = open(dump_path, "w")
    dump.write(f"main thread 0x{threading.main_thread().ident:016x}\n")
    dump.flush()
    # all threads: a process-directed signal may land on a gloo thread with no Python frames
    faulthandler.register(signal.SIGUSR1, file=dump, all_threads=True)
    p2p._install_shared_buffer(shm)
    code = 0
    try:
        fn, args = cloudpickle.loads(payload) if isinstance(payload, bytes) else payload
        timeout = datetime.timedelta(seconds=pg_timeout_s)
        store = _rendezvous(rank, world_size, rendezvous, timeout)
        _env.set_device(backend, local_rank=rank)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timeout)
        p2p.publish("running user code (no minidist op yet)")
        result = fn(rank, world_size, *args)
        q.put(("result", rank, cloudpickle.dumps(_to_cpu(result))))
    except BaseException as e:  # noqa: BLE001 - everything must reach the parent
        code = 1
        summary = f"{type(e).__name__}: {e}".strip()
        q.put(("error", rank, summary, traceback.format_exc()))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        if code == 0 and dist.is_initialized():
            dist.destroy_process_group()
    sys.exit(code)


def _rendezvous(rank, world_size, rendezvous, timeout):
    """Rank 0 binds a TCPStore on a free port (port 0) and publishes it; the others connect.

    The parent holds no store: forking a process whose store-server thread holds a lock can
    deadlock the child (seen here about once in 200 launches), so the parent stays thread-free.
    """
    port_value, ready = rendezvous
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, timeout=timeout,
                              wait_for_workers=False)
        port_value.value = store.port
        ready.set()
    else:
        if not ready.wait(timeout.total_seconds()):
            raise TimeoutError(f"rank {rank}: rank 0 did not publish the store port in time")
        store = dist.TCPStore("127.0.0.1", port_value.value, world_size, is_master=False,
                              timeout=timeout)
    os.environ["MASTER_PORT"] = str(port_value.value)
    return store
