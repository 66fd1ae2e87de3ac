"""Free loopback ports for real sockets in tests."""

from __future__ import annotations

import random
import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_tcp() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def quiet_port() -> int:
    """A free loopback port below the kernel's ephemeral range (32768+ here), so that no
    outgoing connection or bind-to-0 elsewhere takes it between now and our bind -- the
    race a port from `free_port()` loses now and then on a busy machine."""
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(20_000, 32_000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    return free_port()


def quiet_tcp() -> str:
    return f"tcp://127.0.0.1:{quiet_port()}"
