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
  (:func:`check_socket_ifnames`, also called by ``minidist.init``);
* the torchrun / Slurm variables found and the rank, local rank and world size they imply
  (:func:`minidist.env.detect`; its :class:`~minidist.env.EnvError` messages are reported as is);
* MASTER_ADDR resolves, and MASTER_PORT is free before a launch; torchrun and Slurm on PATH.

Sources: torchrun ("torch.distributed.run") and srun manuals; Gloo's ``GLOO_SOCKET_IFNAME`` and
NCCL's ``NCCL_SOCKET_IFNAME`` (NCCL environment variables: prefix match, ``^`` excludes, ``=`` exact).
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

from .env import EnvError, detect

__all__ = ["doctor", "main", "check_socket_ifnames", "interfaces", "LAUNCH_VARS"]

LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
               "MASTER_PORT", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_PROCID",
               "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NTASKS", "SLURM_NNODES",
               "SLURM_NTASKS_PER_NODE", "SLURM_JOB_NODELIST", "GLOO_SOCKET_IFNAME",
               "NCCL_SOCKET_IFNAME", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS")


def interfaces() -> dict[str, str | None]:
    """``{interface name: IPv4 address or None}`` for every network interface of this machine."""
    names = [name for _, name in socket.if_nameindex()] if hasattr(socket, "if_nameindex") else []
    return {name: _ipv4_of(name) for name in names}


def _ipv4_of(name: str) -> str | None:
    try:  # Linux: SIOCGIFADDR on a throwaway datagram socket
        import fcntl
        import struct
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
        return socket.inet_ntoa(packed[20:24])
    except (OSError, ImportError):
        return None


def check_socket_ifnames(environ=None, existing=None) -> None:
    """Fail early when ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` name missing interfaces.

    Gloo takes a comma-separated list of exact names; NCCL takes prefixes (``eth`` matches eth0),
    ``=name`` for an exact name and ``^...`` for exclusions (never an error). Without this check a
    wrong name shows up as a failed or hanging ``init_process_group``.

    Args:
        environ: mapping to read (``os.environ`` by default).
        existing: interface names to check against (this machine's by default).

    Raises:
        minidist.env.EnvError: naming the variable, the interface and the interfaces that exist,
            e.g. ``GLOO_SOCKET_IFNAME=doesnotexist0: no such network interface on host 'vm';
            this host has: eth0, lo``.
    """
    environ = os.environ if environ is None else environ
    existing = sorted(interfaces() if existing is None else existing)
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        value = environ.get(var, "").strip()
        if not value or (var == "NCCL_SOCKET_IFNAME" and value.startswith("^")):
            continue
        exact = var == "GLOO_SOCKET_IFNAME" or value.startswith("=")
        for want in (w.strip() for w in value.lstrip("=").split(",")):
            if not want:
                continue
            found = want in existing if exact else any(e.startswith(want) for e in existing)
            if not found:
                kind = "no such network interface" if exact else "no network interface starts with it"
                raise EnvError(
                    f"{var}={value}: {kind} ({want!r}) on host {socket.gethostname()!r}; this host "
                    f"has: {', '.join(existing) or '(none found)'}. Set {var} to the interface "
                    "that carries traffic between the nodes (same name on every node), or unset it.")


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
    rows: list[tuple[str, str, str]] = []
    add = lambda check, status, detail: rows.append((check, status, detail))  # noqa: E731
    try:
        expected_nodes = max(expected_nodes, int(environ.get("SLURM_NNODES", "1")))
    except ValueError:
        pass

    add("python", "info", f"{platform.python_version()} ({sys.executable})")
    add("torch", "info", f"{torch.__version__} (cpu cores: {os.cpu_count()})")
    gloo, nccl = dist.is_gloo_available(), dist.is_nccl_available()
    add("backend gloo", "ok" if gloo else "fail",
        "available (CPU tensors)" if gloo else "torch was built without gloo: install a regular torch wheel")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if nccl:
        add("backend nccl", "ok" if gpus else "info",
            f"available, {gpus} GPU(s) visible" if gpus else "built in, but no GPU visible: gloo will be used")
    else:
        add("backend nccl", "info", "not in this torch build (CPU-only wheel or not Linux): gloo will be used")
    if gpus:
        names = ", ".join(f"cuda:{i} {torch.cuda.get_device_name(i)}" for i in range(gpus))
        add("devices", "ok", names)
    else:
        add("devices", "info", "cpu only")

    host = socket.gethostname()
    addr = _resolve(host)
    if addr is None:
        add("hostname", "fail" if expected_nodes > 1 else "warn",
            f"{host!r} does not resolve: add it to /etc/hosts or DNS (c10d rendezvous needs it)")
    elif addr.startswith("127.") and expected_nodes > 1:
        add("hostname", "warn",
            f"{host!r} resolves to {addr} but {expected_nodes} nodes are expected: other nodes "
            "cannot reach a loopback address. Use an address on the cluster network for "
            "MASTER_ADDR / --rdzv_endpoint and check /etc/hosts.")
    else:
        add("hostname", "ok", f"{host!r} resolves to {addr}")

    ifaces = interfaces()
    add("interfaces", "info",
        ", ".join(f"{n}={a}" if a else n for n, a in sorted(ifaces.items())) or "(none found)")
    try:
        check_socket_ifnames(environ, ifaces)
        set_vars = [f"{v}={environ[v]}" for v in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
                    if environ.get(v)]
        add("socket ifname", "ok", ", ".join(set_vars) + " exist" if set_vars else
            "GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME unset (the backend picks the interface "
            "the hostname resolves to)")
    except EnvError as e:
        add("socket ifname", "fail", str(e))

    found = [f"{v}={environ[v]}" for v in LAUNCH_VARS if v in environ and "IFNAME" not in v]
    add("launch variables", "info", " ".join(found) if found else "none (a single process)")
    try:
        info = detect(environ)
        add("launch", "ok", f"launcher={info.launcher} rank={info.rank} local_rank={info.local_rank} "
            f"world_size={info.world_size} local_world_size={info.local_world_size} "
            f"node_rank={info.node_rank}")
    except EnvError as e:
        info = None
        add("launch", "fail", str(e))

    master, port = environ.get("MASTER_ADDR"), environ.get("MASTER_PORT")
    if master:
        resolved = _resolve(master)
        if resolved is None:
            add("MASTER_ADDR", "fail", f"{master!r} does not resolve on {host!r}")
        elif resolved.startswith("127.") and expected_nodes > 1:
            add("MASTER_ADDR", "fail", f"{master} is a loopback address but {expected_nodes} "
                "nodes are expected: set it to the first node's hostname")
        else:
            add("MASTER_ADDR", "ok", f"{master} -> {resolved}")
    launched = info is not None and info.launcher != "single"
    check_port = int(port) if port and port.isdigit() else 29500
    if not launched:  # inside a launched job the store legitimately holds the port
        free = _port_free(check_port)
        add(f"port {check_port}", "ok" if free else "warn",
            "free" if free else f"already in use on {host}: `ss -ltnp 'sport = :{check_port}'` "
            "shows who holds it; pick another --master_port / --rdzv_endpoint port")
    tools = {t: shutil.which(t) for t in ("torchrun", "srun", "sbatch")}
    add("tools", "info", ", ".join(f"{t}: {p or 'not on PATH'}" for t, p in tools.items()))
    return rows


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
