"""Raw-socket client moves shared by the listener, intake-limit and service tests: send a
request a byte at a time, read until the server closes, wait for a condition. Every wait is
bounded by a generous timeout and polled, so a slow box makes a test slower, never wrong."""

from __future__ import annotations

import asyncio
import contextlib
import time


async def until(condition, timeout: float = 15.0) -> bool:
    """Poll ``condition()`` until it holds (True) or ``timeout`` passes (False)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


async def read_until_closed(reader: asyncio.StreamReader, timeout: float = 15.0) -> bytes | None:
    """Everything the server sent until it closed the connection (EOF or reset), or None when
    it was still open after ``timeout``."""
    received = b""
    try:
        async with asyncio.timeout(timeout):
            while chunk := await reader.read(65536):
                received += chunk
    except TimeoutError:
        return None
    except (ConnectionResetError, BrokenPipeError):
        pass
    return received


async def trickle(writer: asyncio.StreamWriter, data: bytes, every_s: float = 0.05) -> int:
    """Send ``data`` a byte at a time until it is all out or the server hangs up; returns how
    many bytes went out."""
    sent = 0
    with contextlib.suppress(ConnectionError, OSError):
        for i in range(len(data)):
            writer.write(data[i:i + 1])
            await writer.drain()
            sent += 1
            await asyncio.sleep(every_s)
    return sent
