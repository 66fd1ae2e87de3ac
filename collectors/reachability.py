"""Why a worker's event stream is not connected: the question libzmq does not answer.

A ZeroMQ SUB retries its connection forever and in silence; its monitor says "not connected"
and never why. `diagnose` asks the network itself, once, the way an operator would: does the
host name resolve, does anything accept a TCP connection on that port, does an ipc:// path
exist. The answer is a `StreamReach` cause for logs, /readyz and verdict reasons.
"""

from __future__ import annotations

import asyncio
import os
import socket

from kvmiss.schemas.config import check_zmq_endpoint
from kvmiss.schemas.fleet import Unreachable

CONNECT_TIMEOUT_S = 2.0


async def diagnose(endpoint: str, *, bind: bool = False,
                   timeout_s: float = CONNECT_TIMEOUT_S) -> tuple[Unreachable, str]:
    """(cause, the system's words) for an endpoint kvmiss cannot reach. Never raises."""
    if bind:
        return Unreachable.NO_PUBLISHER, f"no publisher has connected to {endpoint}"
    scheme, _, rest = endpoint.partition("://")
    if scheme == "ipc":
        if not os.path.exists(rest):
            return Unreachable.NO_SUCH_PATH, f"{rest} does not exist"
        return Unreachable.NO_HANDSHAKE, f"{rest} exists, but no publisher answers on it"
    if scheme != "tcp":
        return Unreachable.NETWORK_ERROR, f"{scheme}:// is not reached over the network"
    try:
        host = check_zmq_endpoint(endpoint, bind=False)
    except ValueError as exc:
        return Unreachable.NOT_OPENED, str(exc)
    port = int(endpoint.rpartition(":")[2])
    loop = asyncio.get_running_loop()
    try:
        addresses = await asyncio.wait_for(
            loop.getaddrinfo(host, port, type=socket.SOCK_STREAM), timeout_s)
    except socket.gaierror as exc:
        return Unreachable.UNRESOLVED, f"{host}: {exc.strerror or exc}"
    except TimeoutError:
        return Unreachable.UNRESOLVED, f"{host}: no DNS answer within {timeout_s:g} s"
    family, _, _, _, address = addresses[0]
    try:
        _, writer = await asyncio.wait_for(
            asyncio.open_connection(address[0], address[1], family=family), timeout_s)
    except ConnectionRefusedError:
        return Unreachable.REFUSED, f"{address[0]}:{port} refused the connection (nothing listens there)"
    except TimeoutError:
        return Unreachable.NO_ANSWER, f"{address[0]}:{port} did not answer within {timeout_s:g} s"
    except OSError as exc:
        return Unreachable.NETWORK_ERROR, f"{address[0]}:{port}: {exc.strerror or exc}"
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:
        pass
    return Unreachable.NO_HANDSHAKE, (f"{address[0]}:{port} accepts TCP connections, but the ZeroMQ "
                                      "connection does not hold (not the engine's event port?)")
