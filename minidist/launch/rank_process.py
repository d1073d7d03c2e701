"""What runs inside each rank that :func:`minidist.run` starts.

In order: one intra-op thread, die with the parent (PR_SET_PDEATHSIG) and lead a process group of
its own, torchrun's environment variables, output forwarded line by line, a stack dump on SIGUSR1
(for the timeout report), the rendezvous (a ``FileStore`` in the launch's private folder, gloo on
loopback: no network port), the process group, a barrier (so no rank exits while another is
still connecting), the user's function, and the result or traceback sent back as bytes.

Design notes: docs/design/ground.md"""

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

from .. import env as _env
from ..comm import p2p, threads, topology

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


def _all_connected(store, rank: int, world_size: int) -> None:
    """Wait until every rank has returned from init_process_group (see the module docstring)."""
    store.set(f"minidist/connected/{rank}", b"1")
    store.wait([f"minidist/connected/{r}" for r in range(world_size)])


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu() if obj.device.type != "cpu" else obj.detach()
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(_to_cpu(o) for o in obj)
    if isinstance(obj, dict) and type(obj) is dict:
        return {k: _to_cpu(v) for k, v in obj.items()}
    return obj


def main(rank, world_size, payload, tmpdir, backend, pg_timeout_s, q, shm, dump_path,
         device=None, memory_fraction=None):
    torch.set_num_threads(1)  # first: see the module docstring
    _die_with_parent()
    os.setpgrp()  # the launcher stops this rank's whole group: the rank and what it started
    for var in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "GROUP_RANK"):
        os.environ.pop(var, None)  # an outer torchrun's values do not describe this job
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), GLOO_SOCKET_IFNAME="lo",
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
        store = dist.FileStore(os.path.join(tmpdir, "store"), world_size)
        store.set_timeout(timeout)
        _env.set_device(backend, local_rank=rank, device=device, local_world_size=world_size,
                        memory_fraction=memory_fraction)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timeout)
        _all_connected(store, rank, world_size)
        topology.reload()   # $MINIDIST_TOPOLOGY as this launch set it (a fork inherits old state)
        p2p.publish("running user code (no minidist op yet)")
        result = fn(rank, world_size, *args)
        q.put(("result", rank, cloudpickle.dumps(_to_cpu(result)), p2p.progress()[0]))
    except BaseException as e:  # noqa: BLE001 - everything must reach the parent
        code = 1
        summary = f"{type(e).__name__}: {e}".strip() + _env.oom_hint(e)
        q.put(("error", rank, summary, traceback.format_exc(), p2p.progress()))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        # no library thread may be inside gloo while it goes away (after an error: do not wait)
        stuck = threads.stop_all(timeout=10.0 if code == 0 else 0.5)
        if code == 0 and dist.is_initialized() and not stuck:
            dist.destroy_process_group()
    sys.exit(code)

