"""``minidist doctor``: what this machine offers for distributed training, checked before a run.

Most multi-node failures are environment problems that show up only as a hang or a timeout minutes
into a job: a hostname that resolves to 127.0.1.1 on every node (each node rendezvouses with
itself), a ``GLOO_SOCKET_IFNAME`` naming an interface this node does not have, a port already in
use, srun and torchrun both starting processes. :func:`doctor` looks for them in a fraction of a
second and says what to change.

Checks (each row is ``(check, status, detail)``, status one of ``ok``, ``info``, ``warn``, ``fail``):

* torch version, Python, CPU cores; the backends torch was built with (gloo, nccl) and the devices;
* hostname and the address it resolves to — a warning on 127.x when more than one node is expected;
* network interfaces and their IPv4 addresses;
* ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` name interfaces that exist
  (:func:`minidist.netif.check_socket_ifnames`, the check ``minidist.init`` makes);
* NCCL: the version torch was built with and the variables that change how it behaves
  (``NCCL_DEBUG``, ``NCCL_SOCKET_IFNAME``, ``NCCL_IB_DISABLE``, ``TORCH_NCCL_ASYNC_ERROR_HANDLING``,
  ``TORCH_NCCL_BLOCKING_WAIT``), shown as set or unset;
* the torchrun / Slurm variables found and the rank, local rank and world size they imply
  (:func:`minidist.env.detect`; its :class:`~minidist.env.EnvError` messages are reported as is);
* MASTER_ADDR resolves, and MASTER_PORT is free before a launch; torchrun and Slurm on PATH.

Sources: torchrun ("torch.distributed.run") and srun manuals; Gloo's ``GLOO_SOCKET_IFNAME`` and
NCCL's ``NCCL_SOCKET_IFNAME`` (NCCL environment variables: prefix match, ``^`` excludes, ``=`` exact);
torch's ProcessGroupNCCL environment variables (TORCH_NCCL_*).

This module only reads: it imports :mod:`minidist.env`, never the other way round. Nothing here
initialises CUDA (device counts come from ``torch.cuda.device_count``, which asks NVML first).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import socket
import sys

import torch
import torch.distributed as dist

from minidist.env import detect
from minidist.netif import EnvError, check_socket_ifnames, interfaces

__all__ = ["doctor", "main", "check_socket_ifnames", "interfaces", "LAUNCH_VARS", "NCCL_VARS"]

LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
               "MASTER_PORT", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_PROCID",
               "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NTASKS", "SLURM_NNODES",
               "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_JOB_NODELIST",
               "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS")
NCCL_VARS = ("NCCL_DEBUG", "NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
             "TORCH_NCCL_BLOCKING_WAIT")

Rows = list  # of (check, status, detail)


def _resolve(host: str) -> str | None:
    try:
        return socket.gethostbyname(host)
    except OSError:
        return None


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
            return True
        except OSError:
            return False


def doctor(expected_nodes: int = 1, environ=None) -> list[tuple[str, str, str]]:
    """Check this machine and launch environment; return rows ``(check, status, detail)``.

    Args:
        expected_nodes: how many nodes the job will span; with more than one, a hostname that
            resolves to 127.x and a MASTER_ADDR of localhost become warnings/failures. Under Slurm
            the larger of this and SLURM_NNODES is used.
        environ: mapping to read (``os.environ`` by default), so the checks can be tested.

    Never raises for an environment problem: each problem is a ``fail`` row with the fix.
    """
    environ = os.environ if environ is None else environ
    try:
        expected_nodes = max(expected_nodes, int(environ.get("SLURM_NNODES", "1")))
    except ValueError:
        pass
    host = socket.gethostname()
    rows = _platform_rows() + _nccl_rows(environ) + _host_rows(host, expected_nodes)
    rows += _interface_rows(environ)
    launch_rows, info = _launch_rows(environ)
    rows += launch_rows + _master_rows(environ, host, expected_nodes, info) + _tool_rows()
    return rows


def _platform_rows() -> Rows:
    """Python, torch, cores; the backends torch was built with; the devices it sees."""
    rows = [("python", "info", f"{platform.python_version()} ({_shown(sys.executable)})"),
            ("torch", "info", f"{torch.__version__} (cpu cores: {os.cpu_count()})")]
    gloo, nccl = dist.is_gloo_available(), dist.is_nccl_available()
    rows.append(("backend gloo", "ok" if gloo else "fail", "available (CPU tensors)" if gloo else
                 "torch was built without gloo: install a regular torch wheel"))
    gpus = torch.cuda.device_count() if nccl else 0  # NVML first: does not initialise CUDA
    if nccl:
        rows.append(("backend nccl", "ok" if gpus else "info", f"available, {gpus} GPU(s) visible"
                     if gpus else "built in, but no GPU visible: gloo will be used"))
    else:
        rows.append(("backend nccl", "info",
                     "not in this torch build (CPU-only wheel or not Linux): gloo will be used"))
    if not gpus:
        rows.append(("devices", "info", "cpu only"))
    elif torch.cuda.is_initialized():
        rows.append(("devices", "ok", ", ".join(f"cuda:{i} {torch.cuda.get_device_name(i)}"
                                                for i in range(gpus))))
    else:  # reading names would initialise CUDA here, and a later fork of this process breaks
        rows.append(("devices", "ok", f"{gpus} CUDA device(s) (`nvidia-smi -L` names them)"))
    return rows


def _nccl_rows(environ) -> Rows:
    """NCCL's version (as built into torch) and the variables that change its behaviour."""
    if not dist.is_nccl_available():
        return []
    try:
        version = ".".join(str(v) for v in torch.cuda.nccl.version())
    except Exception as e:  # noqa: BLE001 - a report, never a crash
        version = f"unknown ({type(e).__name__})"
    found = [f"{v}={environ[v]}" for v in NCCL_VARS if v in environ]
    unset = [v for v in NCCL_VARS if v not in environ]
    detail = " ".join(found) or "none set"
    if unset:
        detail += f" (unset: {', '.join(unset)})"
    return [("nccl version", "info", version), ("nccl variables", "info", detail)]


def _host_rows(host: str, expected_nodes: int) -> Rows:
    """The hostname must resolve, and not to loopback when other nodes must reach it."""
    addr = _resolve(host)
    if addr is None:
        return [("hostname", "fail" if expected_nodes > 1 else "warn",
                 f"{host!r} does not resolve: add it to /etc/hosts or DNS (c10d rendezvous needs it)")]
    if addr.startswith("127.") and expected_nodes > 1:
        return [("hostname", "warn",
                 f"{host!r} resolves to {addr} but {expected_nodes} nodes are expected: other nodes "
                 "cannot reach a loopback address. Use an address on the cluster network for "
                 "MASTER_ADDR / --rdzv_endpoint and check /etc/hosts.")]
    return [("hostname", "ok", f"{host!r} resolves to {addr}")]


def _interface_rows(environ) -> Rows:
    """The interfaces, and whether GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME name existing ones."""
    ifaces = interfaces()
    rows = [("interfaces", "info",
             ", ".join(f"{n}={a}" if a else n for n, a in sorted(ifaces.items())) or "(none found)")]
    try:
        check_socket_ifnames(environ, ifaces)
    except EnvError as e:
        return rows + [("socket ifname", "fail", str(e))]
    set_vars = [f"{v}={environ[v]}" for v in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
                if environ.get(v)]
    return rows + [("socket ifname", "ok", ", ".join(set_vars) + " exist" if set_vars else
                    "GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME unset (gloo binds to the address "
                    "the hostname resolves to; NCCL picks ib* interfaces first, then any but "
                    "lo and docker*)")]


def _launch_rows(environ):
    """The launch variables found and what :func:`minidist.env.detect` makes of them."""
    found = [f"{v}={environ[v]}" for v in LAUNCH_VARS if v in environ and "IFNAME" not in v]
    rows = [("launch variables", "info", " ".join(found) if found else "none (a single process)")]
    try:
        info = detect(environ)
    except EnvError as e:
        return rows + [("launch", "fail", str(e))], None
    return rows + [("launch", "ok", f"launcher={info.launcher} rank={info.rank} "
                    f"local_rank={info.local_rank} world_size={info.world_size} "
                    f"local_world_size={info.local_world_size} node_rank={info.node_rank}")], info


def _master_rows(environ, host: str, expected_nodes: int, info) -> Rows:
    """MASTER_ADDR resolves (not to loopback for several nodes); the port is free before a launch."""
    rows = []
    master, port = environ.get("MASTER_ADDR"), environ.get("MASTER_PORT")
    if master:
        resolved = _resolve(master)
        if resolved is None:
            rows.append(("MASTER_ADDR", "fail", f"{master!r} does not resolve on {host!r}"))
        elif resolved.startswith("127.") and expected_nodes > 1:
            rows.append(("MASTER_ADDR", "fail", f"{master} is a loopback address but "
                         f"{expected_nodes} nodes are expected: set it to the first node's hostname"))
        else:
            rows.append(("MASTER_ADDR", "ok", f"{master} -> {resolved}"))
    if info is None or info.launcher == "single":  # inside a job the store holds the port
        check_port = int(port) if port and port.isdigit() else 29500
        free = _port_free(check_port)
        rows.append((f"port {check_port}", "ok" if free else "warn", "free" if free else
                     f"already in use on {host}: `ss -ltnp 'sport = :{check_port}'` shows who "
                     "holds it; pick another --master_port / --rdzv_endpoint port"))
    return rows


def _shown(path: str) -> str:
    """A path below the current folder relative to it (no machine's layout in shared output)."""
    rel = os.path.relpath(path)
    return path if rel.startswith(os.pardir + os.sep + os.pardir) else rel


def _tool_rows() -> Rows:
    tools = {t: shutil.which(t) for t in ("torchrun", "srun", "sbatch")}
    return [("tools", "info", ", ".join(f"{t}: {p or 'not on PATH'}" for t, p in tools.items()))]


def format_table(rows) -> str:
    """The rows as an aligned text table (status column in capitals for warn and fail)."""
    width = max(len(c) for c, _, _ in rows)
    return "\n".join(f"{c:<{width}}  {s.upper() if s in ('warn', 'fail') else s:<4}  {d}"
                     for c, s, d in rows)


def main(argv=None) -> int:
    """``minidist doctor [--nodes N]``: print the table; exit status 1 when a check fails."""
    parser = argparse.ArgumentParser(prog="minidist doctor", description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1,
                        help="how many nodes the job will span (default 1)")
    args = parser.parse_args(argv)
    rows = doctor(expected_nodes=args.nodes)
    print(format_table(rows))
    failed = [c for c, s, _ in rows if s == "fail"]
    if failed:
        print(f"\n{len(failed)} check(s) failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
