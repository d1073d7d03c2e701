"""Network interfaces: which ones this machine has, and a check that ``GLOO_SOCKET_IFNAME`` /
``NCCL_SOCKET_IFNAME`` name ones that exist (:func:`minidist.init`, ``minidist doctor``)."""

from __future__ import annotations

import os
import socket

__all__ = ["EnvError", "interfaces", "check_socket_ifnames"]


class EnvError(RuntimeError):
    """The environment describes an impossible or dangerous launch; the message says what to change."""


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

    Gloo: comma-separated exact names; NCCL: prefixes, ``=name`` exact, ``^...`` exclusions (never an
    error). ``environ`` (default ``os.environ``), ``existing`` (default: this machine's). EnvError
    naming the variable, the interface and those that exist."""
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
