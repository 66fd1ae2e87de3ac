"""The write-ahead journal: every accepted OTLP request body, on disk before the sender gets
its OK, until every span in it has left the export queue.

Layout: a directory of segments ``seg-<n>.wal``, appended in order. Records:

    type (1 byte, b"R" body | b"Z" gzip'd body | b"D" done) | u32 payload length |
    u32 crc32(type + payload) | payload
    R payload: u64 record id | u32 spans | the ExportTraceServiceRequest protobuf bytes
    Z payload: the same, the bytes as the sender gzip'd them (what came in over OTLP/HTTP)
    D payload: u64 record id

A body is written (one ``os.write``: a SIGKILL cannot lose it, the page cache keeps it) and
made durable by group commit -- one fsync for everything written while the previous one
ran, at most one per ``sync_interval_s`` -- before `durable` returns and the receiver answers. When its spans have been
exported (or given up by the export queue, counted there), a done record is appended and
the segment is deleted once none of its bodies is still live. Past ``max_bytes`` of live
segments `full` is true and the receiver answers UNAVAILABLE / 503 with a retry delay, as
for a full buffer.

At start-up the previous run's segments are read: bodies without a done record are
`recovered`, to be fed through the pipeline again (delivery is at-least-once: a body whose
export finished just before the crash, before its done record was written, goes out twice;
`recovered_spans` counts what is replayed). A record torn by a crash mid-write, or one
whose checksum fails, ends its segment: what follows it is not trusted, the loss is counted
(`torn_records`), and start-up goes on. Bodies are the spans' own bytes: the journal holds
what kvmiss was given, nothing derived from it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import struct
import zlib
from pathlib import Path

log = logging.getLogger("kvmiss.journal")

_HEAD = struct.Struct("<cII")  # type, payload length, crc32
_BODY = struct.Struct("<QI")  # record id, spans
_DONE = struct.Struct("<Q")
BODY, GZIPPED, DONE = b"R", b"Z", b"D"
MAX_RECORD_BYTES = 1 << 31  # a length beyond this is damage, not a body


class JournalError(OSError):
    """The journal directory cannot be used (the message names the path)."""


class _Segment:
    __slots__ = ("path", "bytes", "live", "live_bytes")

    def __init__(self, path: Path):
        self.path = path
        self.bytes = 0  # the file's size
        self.live = 0  # bodies in it not done yet
        self.live_bytes = 0  # their bytes: what the disk bound counts


def _read_segment(path: Path) -> tuple[list[tuple[int, int, bytes]], set[int], bool]:
    """(bodies as (id, spans, bytes), done ids, torn) of one segment file."""
    data = path.read_bytes()
    bodies, done, at = [], set(), 0
    while at < len(data):
        if at + _HEAD.size > len(data):
            return bodies, done, True
        kind, length, crc = _HEAD.unpack_from(data, at)
        start, end = at + _HEAD.size, at + _HEAD.size + length
        if length > MAX_RECORD_BYTES or end > len(data) or zlib.crc32(kind + data[start:end]) != crc:
            return bodies, done, True
        if kind in (BODY, GZIPPED) and length >= _BODY.size:
            rid, spans = _BODY.unpack_from(data, start)
            body = data[start + _BODY.size:end]
            if kind == GZIPPED:
                try:
                    body = zlib.decompress(body, wbits=31)
                except zlib.error:
                    return bodies, done, True
            bodies.append((rid, spans, body))
        elif kind == DONE and length == _DONE.size:
            done.add(_DONE.unpack_from(data, start)[0])
        else:
            return bodies, done, True
        at = end
    return bodies, done, False


class SpanJournal:
    """See the module docstring. Not thread-safe: the event loop thread owns it."""

    def __init__(self, directory: str, *, max_bytes: int = 1 << 30, segment_bytes: int = 64 << 20,
                 sync_interval_s: float = 0.0):
        self.directory = Path(directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise JournalError(f"[export] journal: cannot use {directory}: {exc.strerror}") from None
        if not self.directory.is_dir():
            raise JournalError(f"[export] journal: {directory} is not a directory")
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes
        self.sync_interval_s = sync_interval_s
        self.torn_records = 0  # records a crash cut short: their spans are lost
        self.recovered: list[bytes] = []  # bodies to feed through the pipeline again
        self.recovered_spans = 0
        self.refused_full = 0  # requests answered UNAVAILABLE because the journal was full
        self._segments: dict[int, _Segment] = {}  # segment number -> segment, oldest first
        self._where: dict[int, tuple[int, int]] = {}  # live record id -> (its segment number, its bytes)
        self._next_id = 1
        self._written = 0  # bytes written (the sync task's watermark)
        self._synced = 0
        self._waiters: list[tuple[int, asyncio.Future]] = []
        self._sync_task: asyncio.Task | None = None
        self._recover()
        self._fd = -1
        self._current = -1
        self._open_segment()

    # --- start-up ------------------------------------------------------------------------------

    def _recover(self) -> None:
        """Read the previous run's segments; the bodies not done are `recovered` and the old
        files removed -- `replay` journals them again as they go back through the pipeline."""
        numbers = sorted(int(p.stem.split("-", 1)[1]) for p in self.directory.glob("seg-*.wal")
                         if p.stem.split("-", 1)[1].isdigit())
        bodies: list[tuple[int, int, bytes]] = []
        done: set[int] = set()
        for number in numbers:
            path = self.directory / f"seg-{number}.wal"
            found, finished, torn = _read_segment(path)
            bodies += found
            done |= finished
            if torn:
                self.torn_records += 1
                log.warning("journal %s: a record torn by a crash ends the segment; what followed it is lost", path.name)
        for rid, spans, body in bodies:
            if rid not in done:
                self.recovered.append(body)
                self.recovered_spans += spans
            self._next_id = max(self._next_id, rid + 1)
        self._stale = [self.directory / f"seg-{n}.wal" for n in numbers]
        self._segments_seen = max(numbers, default=-1)
        if self.recovered:
            log.warning("journal: %d requests (%d spans) accepted by the previous run and not exported are "
                        "replayed (at least once: some may have left just before the crash)",
                        len(self.recovered), self.recovered_spans)

    def forget_recovered(self) -> None:
        """The recovered bodies are journaled again (by `append`): the old segments go."""
        for path in self._stale:
            try:
                path.unlink()
            except FileNotFoundError:
                pass
        self._stale = []
        self.recovered = []

    # --- writing -------------------------------------------------------------------------------

    def _open_segment(self) -> None:
        """Start the next segment file (numbers never reused, the previous run's included)."""
        number = self._segments_seen = self._segments_seen + 1
        if self._fd >= 0:
            try:
                os.fsync(self._fd)  # bodies still waiting in `durable` were written here
            except OSError as exc:
                log.error("journal fsync failed: %s", exc.strerror)
            os.close(self._fd)
            previous = self._segments.get(self._current)
            if previous is not None and previous.live <= 0:  # everything in it is done already
                del self._segments[self._current]
                previous.path.unlink(missing_ok=True)
        path = self.directory / f"seg-{number}.wal"
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._segments[number] = _Segment(path)
        self._current = number

    @property
    def live_bytes(self) -> int:
        """Bytes of the bodies not done yet: what ``max_bytes`` bounds."""
        return sum(s.live_bytes for s in self._segments.values())

    def full(self) -> bool:
        return self.live_bytes >= self.max_bytes

    def append(self, body: bytes, spans: int, *, gzipped: bool = False) -> int:
        """Write one accepted request's body (``gzipped``: as the sender gzip'd it); its
        record id (see `durable`, `done`)."""
        rid = self._next_id
        self._next_id += 1
        size = self._write(GZIPPED if gzipped else BODY, _BODY.pack(rid, spans), body)
        segment = self._segments[self._current]
        segment.live += 1
        segment.live_bytes += size
        self._where[rid] = (self._current, size)
        return rid

    def _write(self, kind: bytes, payload: bytes, body: bytes = b"") -> int:
        """One record, as one ``writev`` of its parts (the body is never copied), in the
        current segment, or a new one when the current has reached ``segment_bytes``."""
        if self._segments[self._current].bytes >= self.segment_bytes:
            self._open_segment()
        crc = zlib.crc32(body, zlib.crc32(payload, zlib.crc32(kind)))
        parts = [_HEAD.pack(kind, len(payload) + len(body), crc), payload, body]
        size = total = sum(map(len, parts))
        while total:
            written = os.writev(self._fd, parts)
            total -= written
            while parts and written >= len(parts[0]):  # a short write: resume where it stopped
                written -= len(parts[0])
                parts.pop(0)
            if parts and written:
                parts[0] = memoryview(parts[0])[written:]
        self._segments[self._current].bytes += size
        self._written += size
        return size

    async def durable(self) -> None:
        """Return once everything appended so far is fsync'd (group commit: one fsync per
        ``sync_interval_s`` serves every request waiting meanwhile)."""
        if self._synced >= self._written:
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append((self._written, waiter))
        if self._sync_task is None or self._sync_task.done():
            self._sync_task = asyncio.get_running_loop().create_task(self._sync_soon(), name="kvmiss-journal-sync")
        await waiter

    async def _sync_soon(self) -> None:
        """Group commit: an fsync starts as soon as a body waits and none is running; bodies
        written meanwhile wait for the next, which follows at once (or, with
        ``sync_interval_s``, no sooner than that after the previous one)."""
        loop = asyncio.get_running_loop()
        last = 0.0
        while self._waiters:
            gap = last + self.sync_interval_s - loop.time()
            if gap > 0:
                await asyncio.sleep(gap)
            last = loop.time()
            mark, fd = self._written, self._fd
            try:
                await asyncio.get_running_loop().run_in_executor(None, os.fsync, fd)
            except OSError as exc:  # the bodies are written; only power loss could lose them now
                log.error("journal fsync failed: %s", exc.strerror)
            self._synced = max(self._synced, mark)
            ready = [w for m, w in self._waiters if m <= mark]
            self._waiters = [(m, w) for m, w in self._waiters if m > mark]
            for waiter in ready:
                if not waiter.done():
                    waiter.set_result(None)

    def done(self, rid: int | None) -> None:
        """Every span of record ``rid`` has left the export queue: it will not be replayed."""
        where = self._where.pop(rid, None) if rid is not None else None
        if where is None:
            return
        number, size = where
        self._write(DONE, _DONE.pack(rid))
        segment = self._segments.get(number)
        if segment is None:
            return
        segment.live -= 1
        segment.live_bytes -= size
        if segment.live <= 0 and number != self._current:
            del self._segments[number]
            try:
                segment.path.unlink()
            except FileNotFoundError:
                pass

    def close(self) -> None:
        if self._fd >= 0:
            try:
                os.fsync(self._fd)
            except OSError:
                pass
            os.close(self._fd)
            self._fd = -1
        for _, waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._waiters = []
