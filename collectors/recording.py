"""Recordings: every received multipart message, append-only, replayable deterministically.

File layout::

    b"KVMISS-REC\\x01\\n"                                  header (11 bytes)
    repeated:  u32 body_len | u32 crc32(body) | body      little-endian, body = msgpack
               body = [recv_ts, worker, socket, [frame, ...], request_id]

Crash safety: a writer killed mid-record leaves a torn tail (short length, short body or
a CRC mismatch). `read_recording` stops at the first such record, reports it in
`ReadStats.torn_tail`, and yields everything before it. A CRC mismatch in the middle is
indistinguishable from a torn tail and is treated the same way: nothing after it is
trusted.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import msgspec

MAGIC = b"KVMISS-REC\x01\n"
_HEADER = struct.Struct("<II")


class RecordedMessage(msgspec.Struct, array_like=True, frozen=True):
    """One message as a socket delivered it. ``socket`` is "sub", "dealer", "monitor" (a
    connection fact) or "tick" (a timer came due here); ``request_id`` names the replay
    request a dealer reply answers."""

    recv_ts: float
    worker: str
    socket: str
    frames: list[bytes]
    request_id: int | None = None


class RecordingError(ValueError):
    """The file is not a kvmiss recording."""


class ReadStats(msgspec.Struct):
    records: int = 0
    torn_tail: bool = False
    torn_offset: int | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(RecordedMessage)


class RecordingWriter:
    """Appends messages to a recording. Not thread-safe: one owner (the collector loop).

    Each record is written whole with one ``write`` call; `flush` pushes buffered records to
    the OS and, with ``fsync=True``, to disk.
    """

    def __init__(self, path: str | os.PathLike, *, buffer_bytes: int = 1 << 16):
        self.path = Path(path)
        fresh = not self.path.exists() or self.path.stat().st_size == 0
        self._file: BinaryIO = open(self.path, "ab", buffering=buffer_bytes)
        if fresh:
            self._file.write(MAGIC)
        else:
            with open(self.path, "rb") as existing:
                if existing.read(len(MAGIC)) != MAGIC:
                    self._file.close()
                    raise RecordingError(f"{self.path} exists and is not a kvmiss recording")
        self.records = 0

    def write(self, message: RecordedMessage) -> None:
        body = _encoder.encode(message)
        self._file.write(_HEADER.pack(len(body), zlib.crc32(body)) + body)
        self.records += 1

    def flush(self, *, fsync: bool = False) -> None:
        self._file.flush()
        if fsync:
            os.fsync(self._file.fileno())

    def close(self) -> None:
        if not self._file.closed:
            self._file.flush()
            self._file.close()

    def __enter__(self) -> RecordingWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_recording(path: str | os.PathLike, stats: ReadStats | None = None) -> Iterator[RecordedMessage]:
    """Yield every intact record in file order; stop quietly at a torn tail (see stats)."""
    stats = stats if stats is not None else ReadStats()
    with open(path, "rb") as f:
        if f.read(len(MAGIC)) != MAGIC:
            raise RecordingError(f"{path} is not a kvmiss recording (bad header)")
        offset = len(MAGIC)
        while True:
            header = f.read(_HEADER.size)
            if not header:
                return
            if len(header) < _HEADER.size:
                break
            length, crc = _HEADER.unpack(header)
            body = f.read(length)
            if len(body) < length or zlib.crc32(body) != crc:
                break
            try:
                message = _decoder.decode(body)
            except (msgspec.DecodeError, RecursionError):  # nesting past the limit: not ours
                break
            stats.records += 1
            yield message
            offset += _HEADER.size + length
    stats.torn_tail = True
    stats.torn_offset = offset
