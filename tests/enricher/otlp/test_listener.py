"""HTTP listeners bound what one slow client can hold, over real sockets: a client trickling its
headers or its body, or not reading its answer, gives its connection slot back, and the
clients behind it are served. Timeouts here are short; every wait for an outcome is long and
polled, so a slow box makes the tests slower, never wrong."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import socket
import time

import aiohttp
import pytest
from aiohttp import web
from raw_clients import read_until_closed, trickle, until

from kvmiss.enricher.otlp.listener import (
    BodyRefused,
    ConnectionBounds,
    HttpListener,
    answer_and_close,
    read_body,
)

BIG = 16 * 1024 * 1024  # more than the kernel's socket buffers on both ends can hold
REFUSED = web.AppKey("refused", list)  # the reasons `read_body` gave, in order








def app() -> web.Application:
    async def small(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def big(request: web.Request) -> web.Response:
        return web.Response(body=b"x" * BIG)

    async def upload(request: web.Request) -> web.StreamResponse:
        try:
            body = await read_body(request, limit=1024, timeout_s=0.5)
        except BodyRefused as refused:
            request.app[REFUSED].append(refused.reason)
            status = 413 if refused.reason == "too_large" else 408
            return await answer_and_close(request, web.Response(status=status, text=refused.reason))
        return web.Response(text=f"{len(body)} bytes")

    application = web.Application()
    application[REFUSED] = []
    application.router.add_get("/small", small)
    application.router.add_get("/big", big)
    application.router.add_post("/upload", upload)
    return application


@contextlib.asynccontextmanager
async def listening(bounds: ConnectionBounds):
    stats: collections.Counter = collections.Counter()
    listener = HttpListener(app(), bounds, name="test", stats=stats)
    listener.refused = listener._app[REFUSED]
    await listener.start("127.0.0.1", 0)
    try:
        yield listener, stats
    finally:
        await listener.shutdown()


async def get(port: int, path: str = "/small") -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{port}{path}") as response:
            return response.status, await response.read()


class TestHeaders:
    def test_a_client_trickling_its_headers_is_closed_after_idle_s_although_bytes_keep_coming(self):
        async def scenario():
            async with listening(ConnectionBounds(max_connections=1, idle_s=1.0)) as (listener, stats):
                reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
                endless = b"GET /small HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 4000  # one header, never ended
                sending = asyncio.ensure_future(trickle(writer, endless))
                answer = await read_until_closed(reader)
                sent = await sending
                writer.close()
                freed = await until(lambda: listener.connections == 0)
                return answer, sent, freed, await get(listener.port)

        answer, sent, freed, after = asyncio.run(scenario())
        assert answer == b""  # closed without an answer: no request ever arrived
        assert 0 < sent < 4000  # it was still sending when it was cut off
        assert freed and after == (200, b"ok")


class TestBody:
    def test_a_body_trickled_past_its_time_is_answered_408_and_the_connection_closed(self):
        async def scenario():
            async with listening(ConnectionBounds(max_connections=1, idle_s=60.0)) as (listener, stats):
                reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
                writer.write(b"POST /upload HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n")
                sending = asyncio.ensure_future(trickle(writer, b"b" * 1000))
                answer = await read_until_closed(reader)
                sent = await sending
                writer.close()
                freed = await until(lambda: listener.connections == 0)
                return answer, sent, freed, await get(listener.port)

        answer, sent, freed, after = asyncio.run(scenario())
        assert answer is not None and answer.startswith(b"HTTP/1.1 408")
        assert b"Connection: close" in answer and answer.endswith(b"body_timeout")
        assert sent < 1000 and freed and after == (200, b"ok")

    @pytest.mark.parametrize("chunked, size, refused", [
        (False, 5000, ["too_large"]),  # announced by Content-Length
        (True, 5000, ["too_large"]),  # found while reading
        (False, 1024, []),
        (True, 1024, []),
    ])
    def test_a_body_is_read_within_its_size_limit(self, chunked, size, refused):
        async def scenario():
            async with listening(ConnectionBounds(max_connections=4, idle_s=60.0)) as (listener, _):
                async def chunks():
                    for i in range(0, size, 700):
                        yield b"z" * min(700, size - i)

                status = None
                async with aiohttp.ClientSession() as session:
                    url = f"http://127.0.0.1:{listener.port}/upload"
                    # A refused client may see its 413 or, closed on while still sending, a reset.
                    with contextlib.suppress(aiohttp.ClientOSError, aiohttp.ServerDisconnectedError):
                        async with session.post(url, data=chunks() if chunked else b"z" * size) as response:
                            status = response.status, await response.text()
                return status, listener.refused, await get(listener.port)

        status, got_refused, after = asyncio.run(scenario())
        assert got_refused == refused and after == (200, b"ok")
        if not refused:
            assert status == (200, f"{size} bytes")
        else:
            assert status in (None, (413, "too_large"))


def small_window_socket() -> socket.socket:
    """A client socket whose receive buffer does not grow (no autotuning): what the client
    does not read stays on the server's side."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 256 * 1024)
    return sock


def read_slowly(port: int, path: str, per_read: int, every_s: float) -> bytes:
    """A blocking client in its own thread (independent of the server's loop) that reads its
    answer ``per_read`` bytes every ``every_s`` seconds."""
    with small_window_socket() as sock:
        sock.connect(("127.0.0.1", port))
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        received = bytearray()
        while chunk := sock.recv(per_read, socket.MSG_WAITALL):
            received += chunk
            time.sleep(every_s)
        return bytes(received)


class TestAnswer:
    def test_a_client_that_stops_reading_its_answer_is_cut_off_and_counted(self):
        async def scenario():
            bounds = ConnectionBounds(max_connections=1, idle_s=60.0, answer_stall_s=0.5)
            async with listening(bounds) as (listener, stats):
                sock = small_window_socket()
                sock.setblocking(False)
                await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", listener.port))
                await asyncio.get_running_loop().sock_sendall(sock, b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
                stalled = await until(lambda: stats["answers_stalled"] == 1)  # never reads a byte
                freed = await until(lambda: listener.connections == 0)
                sock.close()
                return stalled, freed, await get(listener.port), stats.copy()

        stalled, freed, after, stats = asyncio.run(scenario())
        assert stalled and freed and after == (200, b"ok")
        assert stats["answers_stalled"] == 1

    def test_a_slow_reader_that_keeps_reading_gets_its_whole_answer(self):
        """The stall bound is about progress, not speed: reading 256 KiB every 50 ms takes a
        few seconds for the 16 MiB answer, far longer than the 1 s bound."""
        async def scenario():
            bounds = ConnectionBounds(max_connections=1, idle_s=60.0, answer_stall_s=1.0)
            async with listening(bounds) as (listener, stats):
                started = time.monotonic()
                answer = await asyncio.to_thread(read_slowly, listener.port, "/big", 256 * 1024, 0.05)
                return answer, time.monotonic() - started, stats.copy()

        answer, took, stats = asyncio.run(scenario())
        assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"x" * 1000)
        assert answer.count(b"x") == BIG
        assert stats["answers_stalled"] == 0
        assert took > 2.0  # it did take longer than the stall bound, several times over


class TestConnectionCap:
    def test_connections_past_the_cap_are_reset_and_counted(self):
        async def scenario():
            async with listening(ConnectionBounds(max_connections=2, idle_s=60.0)) as (listener, stats):
                held = [await asyncio.open_connection("127.0.0.1", listener.port) for _ in range(2)]
                assert await until(lambda: listener.connections == 2)
                extra_reader, extra_writer = await asyncio.open_connection("127.0.0.1", listener.port)
                extra = await read_until_closed(extra_reader)
                extra_writer.close()
                for _, writer in held:
                    writer.close()
                freed = await until(lambda: listener.connections == 0)
                after = await get(listener.port)
                return extra, freed, after, stats.copy()

        extra, freed, after, stats = asyncio.run(scenario())
        assert extra == b"" and freed and after == (200, b"ok")
        assert stats["connections_refused"] == 1 and stats["connections_accepted"] == 3  # 2 held, then `get`


    def test_one_client_cannot_take_every_slot(self):
        """Per peer address: 127.0.0.1 holds its 2, a third from it is reset while 127.0.0.2
        (another client on loopback) still gets in; once one of the first two closes, the
        first client gets a slot again. The address table empties with the connections."""

        async def open_from(source: str, port: int):
            return await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))

        async def scenario():
            bounds = ConnectionBounds(max_connections=10, idle_s=60.0, max_connections_per_client=2)
            async with listening(bounds) as (listener, stats):
                held = [await open_from("127.0.0.1", listener.port) for _ in range(2)]
                assert await until(lambda: listener.connections == 2)
                extra_reader, extra_writer = await open_from("127.0.0.1", listener.port)
                extra = await read_until_closed(extra_reader)
                extra_writer.close()
                other_reader, other_writer = await open_from("127.0.0.2", listener.port)
                other_writer.write(b"GET /small HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                other = await read_until_closed(other_reader)
                other_writer.close()
                held[0][1].close()
                assert await until(lambda: listener.connections == 1)
                again_reader, again_writer = await open_from("127.0.0.1", listener.port)
                again_writer.write(b"GET /small HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                again = await read_until_closed(again_reader)
                again_writer.close()
                held[1][1].close()
                emptied = await until(lambda: listener.connections == 0 and not listener._per_client)
                return extra, other, again, emptied, stats.copy()

        extra, other, again, emptied, stats = asyncio.run(scenario())
        assert extra == b""  # reset on arrival
        assert other is not None and other.startswith(b"HTTP/1.1 200")
        assert again is not None and again.startswith(b"HTTP/1.1 200")
        assert emptied
        assert stats["connections_refused_per_client"] == 1 and stats["connections_refused"] == 0


def test_shutdown_before_start_and_twice_is_safe():
    async def scenario():
        listener = HttpListener(app(), ConnectionBounds(max_connections=1, idle_s=1.0), name="t",
                                stats=collections.Counter())
        await listener.shutdown()
        await listener.start("127.0.0.1", 0)
        await listener.shutdown()
        await listener.shutdown()
        return listener.connections

    assert asyncio.run(scenario()) == 0


def test_a_port_in_use_fails_start_and_leaves_nothing_running():
    async def scenario():
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen(1)
            listener = HttpListener(app(), ConnectionBounds(max_connections=1, idle_s=1.0), name="t",
                                    stats=collections.Counter())
            with pytest.raises(OSError):
                await listener.start("127.0.0.1", taken.getsockname()[1])
            return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    assert asyncio.run(scenario()) == []

