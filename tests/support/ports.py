"""Free TCP ports on the loopback for the servers a test starts (mail and HTTP receivers, Airflow, a private Ray)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port nothing listens on now (the server that takes it may race another: free_ports for several)."""
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """n distinct free ports: each socket stays bound until all are chosen (free_port() called n times can hand
    out one port twice, and a server given it twice fails to start: seen once in CI)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()
