"""HTTP listeners that bound what one client can hold: kvmiss's own accept loop in front of an
aiohttp application. Used by the OTLP/HTTP receiver and the metrics endpoint.

A connection holds a slot from its accept to its close, and every way a client can keep it
without doing its part has a bound:

=============================  ============================================================
the client ...                 bound
=============================  ============================================================
opens one more connection      ``max_connections`` open at once (0: no cap); one more is
                               reset as soon as it is accepted, before any TLS handshake
                               (counted ``connections_refused``); and, from one peer
                               address, ``max_connections_per_client`` (0: no cap;
                               ``connections_refused_per_client``), so one client cannot
                               take every slot
stalls its TLS handshake       ``tls_handshake_s``, then closed (``handshakes_failed``)
sends no request, or trickles  ``idle_s`` after the connection opened or after its last
its request line and headers   answer: aiohttp's keep-alive timer, which bytes received do
                               not push back (headers are also capped in size by aiohttp)
trickles its request body      the handler reads it with `read_body`: ``limit`` bytes
                               within ``timeout_s`` (`BodyRefused`); `answer_and_close` then
                               answers without waiting for the rest
stops reading its answer       ``answer_stall_s`` without the unsent answer shrinking: the
                               connection is aborted (``answers_stalled``)
=============================  ============================================================

Counters go to a caller's `collections.Counter` under a key prefix (they become metrics);
never with a peer address. Thread contract: one event loop; `start` and `shutdown` run on it.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import errno
import logging
import math
import socket
import ssl
import struct
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from kvmiss.schemas.config import parse_listen_address

log = logging.getLogger(__name__)

ANSWER_STALL_S = 30.0  # an answer whose unsent bytes did not shrink for this long is given up
TLS_HANDSHAKE_TIMEOUT_S = 10.0  # a TLS handshake holds a slot this long at most
ACCEPT_RETRY_S = 1.0  # after the process ran out of file descriptors, like asyncio's servers
LIMIT_WARNING_INTERVAL_S = 10.0  # at most one line per limit in this many seconds
_FD_LIMIT_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


class ListenError(OSError):
    """An address kvmiss was told to listen on cannot be bound: one line naming the key."""

    def __init__(self, key: str, address: str, reason: str):
        super().__init__(f"{key}: cannot listen on {address}: {reason}")
        self.key, self.address, self.reason = key, address, reason


_BIND_HINTS = {
    errno.EADDRINUSE: "address already in use (another process holds the port: a local Collector, an "
                      "OpenTelemetry agent or a Prometheus exporter often does)",
    errno.EADDRNOTAVAIL: "not an address of this host",
    errno.EACCES: "permission denied (ports below 1024 need privileges)",
}


def bind_problem(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be bound now, in words, or None when it can (the socket is
    closed again). Port 0 always can. Binds as the listeners do: SO_REUSEADDR, no REUSEPORT."""
    if port == 0:
        return None
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"{host} does not resolve ({exc.strerror})"
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        return _BIND_HINTS.get(exc.errno, exc.strerror or str(exc))
    finally:
        sock.close()
    return None


async def listen_as(key: str, address: str, start: Callable[[str, int], Awaitable[None]]) -> None:
    """``start(host, port)`` for the listen address ``address`` of config key ``key``; a bind
    that fails is one `ListenError` naming both. The port is tried first, so that a library
    that logs its own failure (grpc core) never gets to."""
    host, port = parse_listen_address(address)
    problem = bind_problem(host, port)
    if problem is not None:
        raise ListenError(key, address, problem)
    try:
        await start(host, port)
    except (OSError, RuntimeError) as exc:  # lost a race for the port: grpc raises RuntimeError
        reason = _BIND_HINTS.get(getattr(exc, "errno", None) or 0) or getattr(exc, "strerror", None) or str(exc)
        raise ListenError(key, address, reason) from None


@dataclasses.dataclass(frozen=True)
class ConnectionBounds:
    """How much of a listener one connection may hold, and for how long (seconds)."""

    max_connections: int  # open at once (0: no cap)
    idle_s: float  # waiting for a request, its headers included
    max_connections_per_client: int = 0  # open at once from one peer address (0: no cap)
    answer_stall_s: float = ANSWER_STALL_S
    tls_handshake_s: float = TLS_HANDSHAKE_TIMEOUT_S


class LimitLog:
    """WARNING lines about limits, at most one per limit every ``interval_s`` (the counters
    see every case)."""

    def __init__(self, logger: logging.Logger, interval_s: float = LIMIT_WARNING_INTERVAL_S) -> None:
        self._log, self._interval_s = logger, interval_s
        self._warned_at: dict[str, float] = {}  # limit -> when it was last logged

    def warn(self, limit: str, message: str, *args: object) -> None:
        now = time.monotonic()
        if now < self._warned_at.get(limit, -math.inf) + self._interval_s:
            return
        self._warned_at[limit] = now
        self._log.warning(message, *args)


class BodyRefused(Exception):
    """A request body that was not read whole. ``reason``: ``too_large`` or ``body_timeout``."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


async def read_body(request: web.BaseRequest, *, limit: int, timeout_s: float) -> bytes:
    """The request's body: at most ``limit`` bytes, all in within ``timeout_s`` seconds of this
    call (a handler runs once the headers are in). Raises `BodyRefused`: ``too_large`` as soon
    as Content-Length or the bytes read pass ``limit``, ``body_timeout`` when time runs out."""
    if request.content_length is not None and request.content_length > limit:
        raise BodyRefused("too_large", f"body larger than {limit} bytes")
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.content.iter_any():
                size += len(chunk)
                if size > limit:
                    raise BodyRefused("too_large", f"body larger than {limit} bytes")
                chunks.append(chunk)
    except TimeoutError:
        raise BodyRefused("body_timeout", f"request body not received within {timeout_s:g} s") from None
    return b"".join(chunks)


async def answer_and_close(request: web.BaseRequest, response: web.StreamResponse) -> web.StreamResponse:
    """Send ``response`` (``Connection: close``), then close the connection at once: no
    waiting for the rest of an unread body (aiohttp would read and drop it for up to 10 s,
    which helps a client still sending at speed, not one that ran out of time)."""
    response.force_close()
    await response.prepare(request)
    await response.write_eof()
    request.protocol.force_close()  # the transport sends what it holds, then closes
    return response


class _GuardedConnection(asyncio.Protocol):
    """An accepted connection: aiohttp's protocol behind it, a connection slot given back
    exactly once (when the connection closes, or when it never opened), and the bound on an
    answer the client stopped reading."""

    __slots__ = ("_inner", "_release", "_stall_s", "_on_stall", "_transport", "_stall", "_unsent", "opened")

    def __init__(self, inner: asyncio.Protocol, release: Callable[[], None], stall_s: float,
                 on_stall: Callable[[], None]) -> None:
        self._inner = inner
        self._release: Callable[[], None] | None = release
        self._stall_s, self._on_stall = stall_s, on_stall
        self._transport: asyncio.WriteTransport | None = None
        self._stall: asyncio.TimerHandle | None = None
        self._unsent = 0  # bytes waiting in the transport when the stall timer was armed
        self.opened = False

    def release(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.opened = True
        self._transport = transport  # type: ignore[assignment]
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:  # the transport holds more than its high-water mark
        self._inner.pause_writing()
        self._arm_stall()

    def resume_writing(self) -> None:
        self._disarm_stall()
        self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_stall()
        try:
            self._inner.connection_lost(exc)
        finally:
            self.release()

    def _arm_stall(self) -> None:
        self._disarm_stall()
        if self._transport is None or self._transport.is_closing():
            return
        self._unsent = self._transport.get_write_buffer_size()
        self._stall = asyncio.get_running_loop().call_later(self._stall_s, self._check_stall)

    def _disarm_stall(self) -> None:
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None

    def _check_stall(self) -> None:
        self._stall = None
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        if transport.get_write_buffer_size() < self._unsent:  # slow, but reading: wait on
            self._arm_stall()
            return
        self._on_stall()
        transport.abort()  # connection_lost follows: the slot is given back there


class HttpListener:
    """One listening address serving ``app`` within ``bounds`` (see the module docstring).

    ``name`` appears in log lines; ``cap_hint`` tells the reader of the over-the-cap warning
    which setting it is and where it is counted. Counters go to ``stats`` under ``prefix``.
    ``ssl_context``: TLS only. ``runner_options`` go to `aiohttp.web.AppRunner`.
    """

    def __init__(self, app: web.Application, bounds: ConnectionBounds, *, name: str, stats: collections.Counter,
                 prefix: str = "", cap_hint: str = "", warnings: LimitLog | None = None,
                 ssl_context: ssl.SSLContext | None = None, **runner_options: object) -> None:
        self.bounds = bounds
        self.name = name
        self.port: int | None = None
        self._app = app
        self._stats, self._prefix = stats, prefix
        self._cap_hint = cap_hint
        self._warnings = warnings or LimitLog(log)
        self._ssl = ssl_context
        self._runner_options = runner_options
        self._runner: web.AppRunner | None = None
        self._sock: socket.socket | None = None
        self._accepting: asyncio.Task | None = None
        self._handshakes: set[asyncio.Task] = set()  # connections being set up (TLS)
        self._connections = 0  # accepted and not yet closed
        # peer address -> its open connections; only addresses with some (so at most
        # max_connections entries), and only kept when the per-client cap is set
        self._per_client: collections.Counter[str] = collections.Counter()

    @property
    def connections(self) -> int:
        """Open connections (at most ``bounds.max_connections`` when that is set)."""
        return self._connections

    def _count(self, what: str) -> None:
        self._stats[self._prefix + what] += 1

    async def start(self, host: str, port: int) -> None:
        """Bind and start accepting (port 0 picks a free one: see `port`). Raises OSError when
        the address cannot be bound (nothing is left running then)."""
        # shutdown_timeout short: the owner waits out its own grace period before `shutdown`.
        runner = web.AppRunner(self._app, access_log=None, shutdown_timeout=0.1,
                               keepalive_timeout=self.bounds.idle_s, **self._runner_options)
        await runner.setup()
        self._runner = runner
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            # SO_REUSEADDR (restart over TIME_WAIT), never SO_REUSEPORT (silent port sharing).
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(512)
            sock.setblocking(False)
        except OSError:
            sock.close()
            await self.shutdown()
            raise
        self._sock = sock
        self.port = sock.getsockname()[1]
        # Our own accept loop, not aiohttp's site: a connection over the cap is closed before
        # any TLS handshake, and a slot is given back even when a handshake fails.
        self._accepting = asyncio.get_running_loop().create_task(self._accept(sock), name=f"kvmiss-accept-{self.name}")

    async def stop_accepting(self) -> None:
        """Close the listening socket and drop connections still in their TLS handshake; open
        connections keep being served until `shutdown`."""
        if self._accepting is not None:
            self._accepting.cancel()
            await asyncio.gather(self._accepting, return_exceptions=True)
        if self._sock is not None:
            self._sock.close()
        for task in list(self._handshakes):  # not yet connections: nothing to drain
            task.cancel()
        await asyncio.gather(*self._handshakes, return_exceptions=True)

    async def shutdown(self) -> None:
        """Stop accepting and close every connection (requests still running are cancelled).
        Safe before `start` and when called twice."""
        await self.stop_accepting()
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def _accept(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        cap, per_client = self.bounds.max_connections, self.bounds.max_connections_per_client
        while True:
            try:
                conn, peer = await loop.sock_accept(sock)
            except OSError as exc:
                if exc.errno in _FD_LIMIT_ERRNOS:  # the backlog keeps the connection meanwhile
                    self._count("accept_errors")
                    self._warnings.warn(f"{self.name}:accept", "%s: cannot accept a connection (%s); lower the "
                                        "connection caps or raise the file descriptor limit (ulimit -n)",
                                        self.name, exc.strerror)
                    await asyncio.sleep(ACCEPT_RETRY_S)
                elif sock.fileno() == -1 or exc.errno in (errno.EBADF, errno.EINVAL):
                    return  # the listening socket is closed: shutting down
                continue  # ECONNABORTED and the like: that client is gone already
            if cap and self._connections >= cap:
                self._count("connections_refused")
                self._warnings.warn(f"{self.name}:connections", "%s: %d connections open (%s): closing new ones "
                                    "until some close", self.name, self._connections, self._cap_hint or "the cap")
                abort(conn)
                continue
            client = peer[0] if per_client else None
            if client is not None and self._per_client[client] >= per_client:
                self._count("connections_refused_per_client")
                self._warnings.warn(f"{self.name}:client_connections", "%s: a client holds %d connections "
                                    "(the per-client cap): closing its new ones until some close",
                                    self.name, per_client)
                abort(conn)
                continue
            self._connections += 1
            if client is not None:
                self._per_client[client] += 1
            self._count("connections_accepted")
            task = loop.create_task(self._open(conn, client))
            self._handshakes.add(task)
            task.add_done_callback(self._handshakes.discard)

    async def _open(self, conn: socket.socket, client: str | None) -> None:
        assert self._runner is not None and self._runner.server is not None
        connection = _GuardedConnection(self._runner.server(), lambda: self._release(client), self.bounds.answer_stall_s,
                                        lambda: self._count("answers_stalled"))
        try:
            await asyncio.get_running_loop().connect_accepted_socket(
                lambda: connection, conn, ssl=self._ssl,
                ssl_handshake_timeout=self.bounds.tls_handshake_s if self._ssl is not None else None)
        except (Exception, asyncio.CancelledError) as exc:  # a failed or cancelled TLS handshake
            if not connection.opened:  # else its connection_lost gives the slot back
                connection.release()
            conn.close()
            if isinstance(exc, asyncio.CancelledError):
                raise
            self._count("handshakes_failed")

    def _release(self, client: str | None) -> None:
        self._connections -= 1
        if client is not None:
            self._per_client[client] -= 1
            if self._per_client[client] <= 0:
                del self._per_client[client]


def abort(conn: socket.socket) -> None:
    """Close an accepted socket at once with a reset: no TIME_WAIT left behind, and the
    client sees a connection error, which HTTP clients (OTLP's among them) retry."""
    try:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    conn.close()
