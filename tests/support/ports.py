"""Free TCP ports on the loopback for the servers a test starts (mail and HTTP receivers, Airflow, a private Ray).

The ports come from below the kernel's ephemeral range (32768-60999 here): a port handed out from that range
is free when chosen, but any outgoing connection on the machine may take it as its source port a moment
later, and a server that restarts on its port (a private Ray head that comes back) then cannot bind it.
Each pytest-xdist worker draws from a block of its own, so two workers never hand out the same port."""

from __future__ import annotations

import os
import random
import socket

FIRST, LAST = 27000, 32767  # above the private Ray nodes' worker ports (24000-24999), below the ephemeral range
_BLOCKS = 8


def _block() -> range:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    size = (LAST - FIRST + 1) // _BLOCKS
    start = FIRST + size * (int(worker) % _BLOCKS if worker.isdigit() else 0)
    return range(start, start + size)


def free_port() -> int:
    """A port nothing listens on now (free_ports for several at once)."""
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """n distinct free ports: each socket stays bound until all are chosen (free_port() called n times can hand
    out one port twice, and a server given it twice fails to start)."""
    block = _block()
    candidates = list(block)
    random.shuffle(candidates)
    sockets: list[socket.socket] = []
    try:
        for port in candidates:
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            sockets.append(s)
            if len(sockets) == n:
                return [s.getsockname()[1] for s in sockets]
        raise RuntimeError(f"fewer than {n} free ports in {block.start}-{block.stop - 1}")
    finally:
        for s in sockets:
            s.close()


def bindable(port: int) -> bool:
    """Whether a server could bind `port` now (SO_REUSEADDR, as servers set it: a socket in TIME_WAIT does not count)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False
    finally:
        s.close()
