"""Addresses: free loopback ports, replica URLs checked before anything starts, a one-shot health probe;
and the one thing every child process gets at its start: to die with its parent."""

from __future__ import annotations

import ctypes
import signal
import socket
from urllib.parse import urlsplit


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def replica_url(address: str) -> str:
    """`address` (a replica's base URL, e.g. http://10.0.0.2:8000) normalised, or ValueError saying what
    is wrong with it: the router needs a scheme, a host and a port, and no path."""
    parts = urlsplit(address if "://" in address else f"http://{address}")
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"--data-parallel-address {address!r}: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None:
        raise ValueError(f"--data-parallel-address {address!r} is not a replica URL: give http://HOST:PORT "
                         "of a running `conveyor serve`")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"--data-parallel-address {address!r}: give the server's base URL, without a path")
    return f"{parts.scheme}://{parts.netloc}"


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    """Whether GET `url` answers 200 within `timeout_s` (proxy variables ignored)."""
    import httpx

    try:
        return httpx.get(url, timeout=timeout_s, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


PR_SET_PDEATHSIG = 1


def end_with_parent() -> None:
    """In a child, before exec (`preexec_fn`): SIGTERM when the process that started it dies, so replicas
    and the router never outlive a supervisor killed with SIGKILL (Linux; elsewhere nothing)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass
