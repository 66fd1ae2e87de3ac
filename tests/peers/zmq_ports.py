"""Free loopback ports for real sockets in tests."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_tcp() -> str:
    return f"tcp://127.0.0.1:{free_port()}"
