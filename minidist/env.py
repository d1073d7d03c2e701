"""Who am I? Rank, local rank and world size from the launcher; backend and device.

Device and backend are chosen here and nowhere else: a rank's device is ``cuda:LOCAL_RANK``
(never ``RANK``, never ``rank % device_count``); the backend is ``nccl`` when every local rank can
have its own GPU, else ``gloo``. Sources: torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE, ...),
Slurm's (SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS, ...; srun(1)) and the Kubeflow training
operator's (RANK, WORLD_SIZE, PET_*). The network-interface check and :class:`EnvError` live in
:mod:`minidist.netif`, re-exported here.

Design notes: docs/design/ground.md"""

from __future__ import annotations

import datetime
import os
import re
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .netif import EnvError, check_socket_ifnames, interfaces

__all__ = ["DistEnv", "detect", "choose_backend", "device_for", "set_device", "init", "EnvError",
           "DevicePlan", "plan_devices", "oom_hint",
           "parse_tasks_per_node", "check_socket_ifnames", "interfaces"]


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits; ``launcher``: torchrun, slurm, pytorchjob, minidist, env or single."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    launcher: str
    master_addr: str | None = None
    master_port: int | None = None


def _int(environ, key, default=None):
    value = environ.get(key)
    if value is None or value == "":
        return default
    try:
        return int(value.split("(")[0])  # SLURM_NTASKS_PER_NODE may read "4(x2)"
    except ValueError:
        raise EnvError(f"{key}={value!r} is not an integer") from None


_TASKS = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def parse_tasks_per_node(value: str) -> list[int]:
    """Slurm's ``SLURM_TASKS_PER_NODE`` -> the task count of each node, in node-list order.

    ``"4"`` -> ``[4]``; ``"2(x3),1"`` -> ``[2, 2, 2, 1]``. EnvError: a piece neither ``N`` nor ``N(xM)``."""
    counts = []
    for piece in value.split(","):
        m = _TASKS.match(piece.strip())
        if not m:
            raise EnvError(f"SLURM_TASKS_PER_NODE={value!r}: cannot read {piece!r} (expected a "
                           "comma-separated list of N or N(xM), e.g. 2(x3),1)")
        counts += [int(m[1])] * int(m[2] or 1)
    return counts


def _slurm_local_world(environ, node: int, world: int, nnodes: int) -> int:
    """Tasks on this node: SLURM_TASKS_PER_NODE at SLURM_NODEID (nodes may differ: 2,1)."""
    value = environ.get("SLURM_TASKS_PER_NODE")
    if value:
        counts = parse_tasks_per_node(value)
        if not 0 <= node < len(counts):
            raise EnvError(f"SLURM_NODEID={node} but SLURM_TASKS_PER_NODE={value!r} lists "
                           f"{len(counts)} node(s)")
        return counts[node]
    return _int(environ, "SLURM_NTASKS_PER_NODE") or max(1, world // max(1, nnodes))


def detect(environ=None) -> DistEnv:
    """Read the launch environment (``os.environ`` by default); pure. EnvError: RANK without a local
    rank, srun and torchrun both multi-process, a multi-node MASTER_ADDR of localhost, bad indices.
    """
    environ = os.environ if environ is None else environ
    slurm_tasks_per_node = _int(environ, "SLURM_NTASKS_PER_NODE")
    slurm_nnodes = _int(environ, "SLURM_NNODES", 1)
    under_torchrun = "TORCHELASTIC_RUN_ID" in environ or "GROUP_RANK" in environ
    if "PET_NNODES" in environ and not under_torchrun:
        pod = _kubeflow_pod(environ)        # a Kubernetes pod whose command is not torchrun
        if pod is not None:
            return pod
    if "RANK" in environ and "WORLD_SIZE" in environ:
        launcher = "torchrun" if under_torchrun else "minidist" if "MINIDIST_RUN" in environ else "env"
        local_rank = _int(environ, "LOCAL_RANK")
        if local_rank is None:
            local_rank = _int(environ, "SLURM_LOCALID")
        if local_rank is None:
            raise EnvError("RANK is set but LOCAL_RANK is not (and no SLURM_LOCALID): the device "
                           "cannot be chosen. Launch with torchrun, or export LOCAL_RANK.")
        local_world = _int(environ, "LOCAL_WORLD_SIZE", 1)
        if under_torchrun and slurm_tasks_per_node and slurm_tasks_per_node > 1 and local_world > 1:
            total = slurm_tasks_per_node * local_world * slurm_nnodes
            raise EnvError(
                f"srun started {slurm_tasks_per_node} tasks per node and torchrun started "
                f"{local_world} processes in each: {total} processes instead of "
                f"{local_world * slurm_nnodes}. Use `#SBATCH --ntasks-per-node=1` with torchrun, "
                "or drop torchrun and let srun start one task per GPU.")
        rank, world = _int(environ, "RANK"), _int(environ, "WORLD_SIZE")
        node = _int(environ, "GROUP_RANK", _int(environ, "SLURM_NODEID", 0))
    elif "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ:
        launcher = "slurm"
        rank, world = _int(environ, "SLURM_PROCID"), _int(environ, "SLURM_NTASKS")
        local_rank = _int(environ, "SLURM_LOCALID", 0)
        node = _int(environ, "SLURM_NODEID", 0)  # SLURM_PROCID is a task id, not a node index
        local_world = _slurm_local_world(environ, node, world, slurm_nnodes)
    else:
        return DistEnv(0, 0, 1, 1, 0, "single")
    if not 0 <= rank < world or not 0 <= local_rank < max(local_world, 1):
        raise EnvError(f"inconsistent launch environment: rank={rank}, world_size={world}, "
                       f"local_rank={local_rank}, local_world_size={local_world}")
    addr = environ.get("MASTER_ADDR")
    port = _int(environ, "MASTER_PORT")
    nnodes = slurm_nnodes if launcher == "slurm" else max(1, world // max(local_world, 1))
    if addr in ("localhost", "127.0.0.1", "::1") and nnodes > 1:
        raise EnvError(f"MASTER_ADDR={addr} but the job spans {nnodes} nodes: the other nodes "
                       "would connect to themselves. Set MASTER_ADDR to the first node's hostname "
                       "(e.g. `scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1`).")
    return DistEnv(rank, local_rank, world, local_world, node, launcher, addr, port)


def _kubeflow_pod(environ) -> DistEnv | None:
    """The place of a Kubeflow pod started without torchrun (one process per pod), else refused; or None."""
    nnodes, nproc = environ.get("PET_NNODES", ""), environ.get("PET_NPROC_PER_NODE", "")
    fix = ("make the container's command `python -m torch.distributed.run train.py`: torchrun "
           "reads the PET_* variables as its arguments and starts the processes")
    if "RANK" in environ and "WORLD_SIZE" in environ:
        if "LOCAL_RANK" in environ:
            return None                    # the user exported the rest: read it as given
        if nproc not in ("", "auto", "1"):
            raise EnvError(f"PET_NPROC_PER_NODE={nproc} but this process was not started by "
                           f"torchrun: the Kubeflow operator set WORLD_SIZE={environ['WORLD_SIZE']} "
                           f"(pods x processes per pod) and RANK={environ['RANK']} (the pod's "
                           f"index) for torchrun to split; {fix}.")
        rank, world = _int(environ, "RANK"), _int(environ, "WORLD_SIZE")
        if not 0 <= rank < world:
            raise EnvError(f"inconsistent launch environment: rank={rank}, world_size={world}")
        return DistEnv(rank, 0, world, 1, _int(environ, "PET_NODE_RANK", rank), "pytorchjob",
                       environ.get("MASTER_ADDR"), _int(environ, "MASTER_PORT"))
    if nnodes == "1" and nproc in ("", "1"):
        return None                        # one process in one pod: a single process
    raise EnvError(f"PET_NNODES={nnodes} and PET_NPROC_PER_NODE={nproc or '(unset)'} are set (a "
                   "Kubeflow PyTorchJob or TrainJob pod) but RANK and WORLD_SIZE are not: they are "
                   f"torchrun's arguments, and without torchrun every pod would train alone; {fix}.")


def choose_backend(backend: str = "auto", local_world_size: int = 1) -> str:
    """``"nccl"`` when every local rank can have its own GPU, else ``"gloo"``; checks explicit choices."""
    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {backend!r}")
    if backend == "auto":
        gpus = torch.cuda.device_count() if dist.is_nccl_available() else 0
        return "nccl" if gpus >= local_world_size > 0 else "gloo"
    if backend == "nccl" and torch.cuda.device_count() < local_world_size:
        raise ValueError(f"backend 'nccl' needs one GPU per local rank: {local_world_size} ranks, "
                         f"{torch.cuda.device_count()} GPUs visible (NCCL refuses two ranks on one "
                         "device). Use backend='gloo'" + (", with device='cuda' to share the GPU"
                                                        if torch.cuda.device_count() else "") + ".")
    return backend


def device_for(backend: str, local_rank: int) -> torch.device:
    """The device a rank computes on: ``cuda:local_rank`` with nccl, the CPU with gloo."""
    return torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")


def set_device(backend: str, local_rank: int, device: str | None = None,
               local_world_size: int = 1, memory_fraction: float | None = None) -> torch.device:
    """Make this rank's device current. ``device="cuda"`` (or ``MINIDIST_DEVICE=cuda``): GPU
    ``local_rank % gpus``, and when ranks share it, at most ``memory_fraction`` of its memory
    (default 1 / ranks per GPU; ``torch.cuda.set_per_process_memory_fraction``)."""
    device = device or os.environ.get("MINIDIST_DEVICE") or None
    if device != "cuda":
        chosen = device_for(backend, local_rank)
        if chosen.type == "cuda":
            torch.cuda.set_device(chosen)
        return chosen
    os.environ["MINIDIST_DEVICE"] = "cuda"  # device() below and the lessons read it
    gpus = torch.cuda.device_count()
    plan = plan_devices("cuda", backend, local_world_size, gpus)
    chosen = torch.device("cuda", local_rank % gpus)
    torch.cuda.set_device(chosen)
    fraction = memory_fraction if memory_fraction is not None else plan.memory_fraction
    if fraction is not None:
        torch.cuda.set_per_process_memory_fraction(fraction, chosen)
        os.environ["MINIDIST_MEMORY_FRACTION"] = str(fraction)
    return chosen


def device() -> torch.device:
    """The current rank's device (after the process group is initialised)."""
    if os.environ.get("MINIDIST_DEVICE") == "cuda":  # ranks sharing a GPU, gloo between them
        return torch.device("cuda", torch.cuda.current_device())
    backend = dist.get_backend() if dist.is_initialized() else "gloo"
    return device_for(backend, detect().local_rank)


def init(backend: str = "auto", timeout: float = 300.0, check_hosts: bool = True,
         device: str | None = None, memory_fraction: float | None = None) -> DistEnv:
    """Initialise the process group for a script run by torchrun, srun or plain python; returns the
    :class:`DistEnv`. Checks interface names, picks backend and device (``device="cuda"`` /
    ``MINIDIST_DEVICE=cuda``: the GPU even when shared, :func:`plan_devices`), initialises (env://)
    and refuses a repeated ``(hostname, local_rank)``; without a launcher, a single-rank group.
    """
    info = detect()
    check_socket_ifnames()  # a wrong interface name fails here, not in a hang
    device = device or os.environ.get("MINIDIST_DEVICE") or None
    if device in (None, "auto"):
        backend = choose_backend(backend, info.local_world_size)
    else:
        backend = plan_devices(device, backend, info.local_world_size, torch.cuda.device_count(),
                               dist.is_nccl_available()).backend
    set_device(backend, info.local_rank, device if device != "auto" else None,
               info.local_world_size, memory_fraction)
    kwargs: dict = dict(backend=backend, timeout=datetime.timedelta(seconds=timeout))
    if info.launcher == "single":
        store = dist.HashStore()
        dist.init_process_group(store=store, rank=0, world_size=1, **kwargs)
        return info
    if info.master_addr is None or info.master_port is None:
        raise EnvError("MASTER_ADDR and MASTER_PORT must be set (torchrun sets them; under srun "
                       "export them in the sbatch script).")
    dist.init_process_group(init_method="env://", rank=info.rank, world_size=info.world_size,
                            **kwargs)
    if check_hosts:
        hosts: list = [None] * info.world_size
        dist.all_gather_object(hosts, (socket.gethostname(), info.local_rank))
        dup = {h for h in hosts if hosts.count(h) > 1}
        if dup:
            raise EnvError(f"rank {info.rank}: (hostname, local_rank) pairs {sorted(dup)} appear "
                           "more than once: two processes share a device. Check LOCAL_RANK.")
    return info


# --------------------------------------------------------------------------- shared GPUs
# Several ranks may share one GPU: each rank is its own process with its own CUDA context, gloo
# carries the messages (CUDA tensors staged through pinned CPU buffers, minidist.comm.staging)
# and each rank may use 1 / (ranks per GPU) of the device's memory. NCCL refuses two ranks on one
# device, so a plan that asks for it is an error that says so.
@dataclass(frozen=True)
class DevicePlan:
    """Where a job's ranks compute and what carries their messages (:func:`plan_devices`); with
    ``ranks_per_gpu`` > 1 gloo moves the bytes and each rank may use ``memory_fraction`` of the GPU."""

    backend: str  # "gloo" | "nccl"
    device: str  # "cpu" | "cuda"
    ranks_per_gpu: int = 1

    @property
    def memory_fraction(self) -> float | None:
        return 1.0 / self.ranks_per_gpu if self.ranks_per_gpu > 1 else None


def plan_devices(device: str | None, backend: str, local_world_size: int, gpus: int,
                 nccl_available: bool = True) -> DevicePlan:
    """Backend and device for ``local_world_size`` ranks on ``gpus`` GPUs; pure. ``device`` None/"auto"
    as :func:`choose_backend`, "cpu" gloo, "cuda" a GPU each or shared over gloo. ValueError: unknown
    device/backend, "cuda" without a GPU, nccl on "cpu" or with more ranks than GPUs.
    """
    if device in (None, "auto"):
        chosen = choose_backend(backend, local_world_size)
        return DevicePlan(chosen, "cuda" if chosen == "nccl" else "cpu")
    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {backend!r}")
    if device == "cpu":
        if backend == "nccl":
            raise ValueError("backend 'nccl' moves CUDA tensors only; device='cpu' needs "
                             "backend='gloo' (or 'auto')")
        return DevicePlan("gloo", "cpu")
    if device != "cuda":
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if gpus < 1:
        raise ValueError("device='cuda' but torch sees no GPU (torch.cuda.device_count() == 0; "
                         "check CUDA_VISIBLE_DEVICES and the driver, e.g. with `minidist doctor`). "
                         "Use device='cpu'.")
    if backend == "nccl" and gpus < local_world_size:
        raise ValueError(
            f"backend 'nccl' with device='cuda': {local_world_size} ranks but {gpus} GPU(s). NCCL "
            "refuses two ranks on one device (each NCCL rank needs a GPU of its own), so ranks "
            "cannot share a GPU over NCCL. Use backend='gloo' (or 'auto'): every rank still "
            "computes on the GPU, gloo carries the messages.")
    if backend == "auto":
        backend = "nccl" if nccl_available and gpus >= local_world_size else "gloo"
    return DevicePlan(backend, "cuda", max(1, -(-local_world_size // gpus)))


def oom_hint(error: BaseException) -> str:
    """A sentence to append to an out-of-memory error raised inside a rank (empty for others)."""
    if not isinstance(error, getattr(torch, "OutOfMemoryError", ())):
        return ""
    frac = os.environ.get("MINIDIST_MEMORY_FRACTION")
    if frac:
        return (f" [this rank ran out of GPU memory: it may use {float(frac):.0%} of a GPU it shares "
                "with other ranks; use fewer ranks per GPU, a smaller batch, or a larger "
                "memory_fraction]")
    return " [this rank ran out of GPU memory: use a smaller batch or model]"
