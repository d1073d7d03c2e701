"""Network interfaces: which ones this machine has, and a check that ``GLOO_SOCKET_IFNAME`` /
``NCCL_SOCKET_IFNAME`` name ones that exist — made by :func:`minidist.init` before it connects and
by ``minidist doctor`` (a wrong name otherwise shows up as a failed or hanging
``init_process_group``). Name rules: gloo's ``GLOO_SOCKET_IFNAME`` (exact names, comma-separated)
and NCCL's ``NCCL_SOCKET_IFNAME`` (prefixes, ``=`` exact, ``^`` exclusions; NCCL environment
variables documentation)."""

from __future__ import annotations

import os
import socket

__all__ = ["EnvError", "interfaces", "check_socket_ifnames"]


class EnvError(RuntimeError):
    """The environment describes an impossible or dangerous launch; the message says what to change.
    Raised by :mod:`minidist.env` (launch variables) and here (interface names)."""


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
        EnvError: naming the variable, the interface and the interfaces that exist, e.g.
            ``GLOO_SOCKET_IFNAME=doesnotexist0: no such network interface on host 'vm'; this
            host has: eth0, lo``.
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
