"""Request records out of the span pipeline: one JSON line per judged request, the facts
`kvmiss attribute` and `kvmiss whatif` read (``[export] request_records``).

Each line is a `RequestRecord` (schemas/attribution.py): the request's `RequestFacts` without
the opt-in prompt material (token ids, extra keys with their salts and adapter paths), which
has no field there to be written into, plus the trace id. Block hashes are written: the engines
publish them on their KV-event streams, and `kvmiss whatif` replays them.

The file is written off the event loop, the encoding is batched on it: `put` (the loop
thread, from the pipeline's verdict callback) makes the record -- never tracked by the cyclic
GC -- and keeps it; `flush` (the service's tick, every 20 ms, or `put` once `FLUSH_RECORDS`
wait) encodes what was kept in one call and hands the bytes to a writer thread, which alone
touches the file. Encoding on a second thread would not take the CPU off the loop (one GIL)
and, measured, cost twice as much: the records' facts lived on, and the two threads fought
over the GIL (benchmarks/bench_serve.py --pipeline-only --request-records). Bounds, each with
its counter (`dropped`, by reason):

* ``queue_full``: `MAX_PENDING` records already waiting to be written (the disk is slower than
  the traffic): the newest are dropped;
* ``write_error``: a write, open or rotation failed (disk full, permissions): that batch is
  dropped, the error is logged once per process and counted, and the next batch opens the
  file again;
* ``shut_down``: a record after `shutdown`.

The file is size-capped: before a line would take it past ``max_bytes`` it is renamed to
``<path>.old`` (replacing an older one) and a new one is started, so at most twice
``max_bytes`` are on disk. (``.old``, not ``.1``: ``serve --processes`` names process 1's
file ``<path>.1``.) Lines are complete or absent: a crash loses at most the records not yet
written (no fsync: these are estimates' inputs, not the spans, which the journal keeps).

Thread contract: `put`, `flush`, `force_flush` and `shutdown` may be called from any thread
(the loop's, a test's, an SDK exporter's); a lock keeps a record from being encoded twice or
lost between them. `shutdown` is idempotent and writes what is kept first. The counters are
read from any thread.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from array import array
from typing import Any

import msgspec

from kvmiss.schemas.attribution import RequestFacts, RequestRecord

log = logging.getLogger("kvmiss.request_records")

MAX_PENDING = 65_536  # records kept or queued, not yet written; beyond: dropped (queue_full)
FLUSH_RECORDS = 512  # `put` encodes and hands over once this many are kept (between ticks)
WRITE_INTERVAL_S = 0.5  # the writer thread's longest sleep (a flush wakes it at once)
MIN_MAX_BYTES = 1 << 20


def record_of(facts: RequestFacts, trace_id: bytes | None = None) -> RequestRecord:
    """The record of one judged request: its facts less the prompt material."""
    return RequestRecord(
        request_id=facts.request_id, trace_id=trace_id.hex() if trace_id else None,
        prompt_tokens=facts.prompt_tokens, cached_tokens=facts.cached_tokens, block_size=facts.block_size,
        worker=facts.worker, dp_rank=facts.dp_rank, lookup_time=facts.lookup_time,
        lookup_time_latest=facts.lookup_time_latest, block_hashes=facts.block_hashes, extra_key_kinds=facts.extra_key_kinds, transfers=facts.transfers,
        instance_hint=facts.instance_hint, route_policy=facts.route_policy, route_candidates=facts.route_candidates,
        chain_unavailable=facts.chain_unavailable,
        kv_cache_report_mode=facts.kv_cache_report_mode, skip_reading_prefix_cache=facts.skip_reading_prefix_cache,
        earlier_lookups=facts.earlier_lookups,
        predicted_cached_tokens=facts.predicted_cached_tokens, finish_time=facts.finish_time,
        output_tokens=facts.output_tokens)


def _enc_hook(value: Any) -> Any:
    if type(value) is array:  # a chain the wire scanner read: array('Q')
        return value.tolist()
    raise NotImplementedError(f"cannot encode {type(value).__name__}")


_encoder = msgspec.json.Encoder(enc_hook=_enc_hook)


def encode_record(record: RequestRecord) -> bytes:
    """One line of a request-records file, without its newline."""
    return _encoder.encode(record)


def encode_records(records: list[RequestRecord]) -> bytes:
    """Lines of a request-records file, each with its newline: one encoder call (half the
    cost of encoding them one by one)."""
    return _encoder.encode_lines(records)


class RequestRecords:
    """Writes request records to ``path`` (see the module docstring)."""

    def __init__(self, path: str, *, max_bytes: int = 256 << 20, max_pending: int = MAX_PENDING):
        if max_bytes < MIN_MAX_BYTES:
            raise ValueError(f"max_bytes must be at least {MIN_MAX_BYTES}")
        self.path = path
        self.rotated_path = path + ".old"
        self.max_bytes = max_bytes
        self.max_pending = max_pending
        # Counters. `written`, `rotations`, `errors` and dropped["write_error"] are the
        # writer's; the others the owner thread's (each written by one thread only).
        self.written = 0  # records written
        self.rotations = 0
        self.errors = 0  # failed opens, writes and rotations
        self.dropped: collections.Counter[str] = collections.Counter()  # records, by reason
        self._kept: list[RequestRecord] = []  # made by `put`, not yet encoded
        self._kept_lock = threading.Lock()  # `_kept`, `_accepted` and the hand-over of kept records
        self._accepted = 0  # records `put` took (owner thread)
        self._chunks: collections.deque[tuple[bytes, int]] = collections.deque()  # (lines, records) for the writer
        self._file: Any = None
        self._size = 0
        self._logged_error = False
        self._wake = threading.Event()
        self._stopping = False
        self._rounds_lock = threading.Condition()
        self._rounds = 0  # writer rounds completed
        self._round_started = 0  # the last round begun (== _rounds while the writer waits)
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def queued(self) -> int:
        """Records accepted and not yet written or dropped by the writer."""
        return self._accepted - self.written - self.dropped["write_error"]

    def start(self) -> None:
        """Open the file (an error here is the configuration's: raised, naming the key, not
        counted) and start the writer thread."""
        if self._thread is not None:
            return
        try:
            self._open()
        except OSError as exc:
            raise OSError(exc.errno, f"export.request_records: cannot open {self.path}: {exc.strerror}") from None
        self._thread = threading.Thread(target=self._run, name="kvmiss-request-records", daemon=True)
        self._thread.start()

    def put(self, facts: RequestFacts, trace_id: bytes | None = None) -> bool:
        """Keep the record of one judged request; False (counted) when it is dropped."""
        if self._closed:
            self.dropped["shut_down"] += 1
            return False
        record = record_of(facts, trace_id)
        with self._kept_lock:
            if self.queued >= self.max_pending:
                self.dropped["queue_full"] += 1
                return False
            self._kept.append(record)
            self._accepted += 1
            full = len(self._kept) >= FLUSH_RECORDS
        if full:
            self.flush()
        return True

    def on_verdict(self, facts: RequestFacts, verdict: Any, trace_id: bytes) -> None:
        """`put` as the pipeline's verdict callback (the verdict is not written)."""
        self.put(facts, trace_id)

    def flush(self) -> None:
        """Encode the kept records (one call) and hand them to the writer, which writes them
        at once; without a running writer (not started, or shut down), write them here."""
        with self._kept_lock:
            kept, self._kept = self._kept, []
            if kept:  # handed over under the lock: chunks stay in the order records came
                self._chunks.append((encode_records(kept), len(kept)))
        thread = self._thread
        if thread is None or not thread.is_alive():
            self._write_chunks()
        elif self._chunks:
            self._wake.set()

    def force_flush(self, timeout: float = 5.0) -> bool:
        """`flush`, and wait until the writer has written it; False if it did not in time."""
        self.flush()
        thread = self._thread
        if thread is None or not thread.is_alive():
            return not self._chunks
        with self._rounds_lock:
            target = self._round_started + 1  # the next round to begin takes every chunk so far
            self._wake.set()
            return self._rounds_lock.wait_for(lambda: self._rounds >= target, timeout)

    def shutdown(self, timeout: float = 5.0) -> bool:
        """Refuse new records, write the kept ones, close the file. Idempotent; False if the
        writer thread did not finish within ``timeout``."""
        if self._closed:
            return True
        self.flush()
        self._closed = True
        self._stopping = True
        self._wake.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                return False
        self._write_chunks()  # whatever the writer did not get to (or had no thread to)
        self._close()
        return True

    # --- the writer thread ----------------------------------------------------------------

    def _run(self) -> None:
        while True:
            self._wake.wait(WRITE_INTERVAL_S)
            with self._rounds_lock:
                self._wake.clear()
                self._round_started = self._rounds + 1
            stopping = self._stopping  # then this round writes what was handed over before
            self._write_chunks()
            with self._rounds_lock:
                self._rounds += 1
                self._rounds_lock.notify_all()
            if stopping:
                return

    def _write_chunks(self) -> None:
        chunks = self._chunks
        while chunks:
            data, records = chunks.popleft()
            before = self.written
            try:
                self._write(data, records)
            except OSError as exc:
                self.errors += 1
                self.dropped["write_error"] += records - (self.written - before)
                self._close()
                if not self._logged_error:
                    self._logged_error = True
                    log.warning("request records: cannot write %s (%s): records are dropped and counted in "
                                "kvmiss_request_records_dropped_total{reason=\"write_error\"} (logged once)",
                                self.path, exc.strerror or type(exc).__name__)

    def _write(self, data: bytes, records: int) -> None:
        """Append ``records`` lines (``data``), starting a new file first wherever the next
        line would take the current one past ``max_bytes``; the lines before a failure stay
        written (counted)."""
        if self._file is None:
            self._open()
        if self._size + len(data) <= self.max_bytes:  # the common case: one write
            self._put(data, records)
            return
        lines = data.splitlines(keepends=True)
        start, size = 0, self._size
        for i, line in enumerate(lines):
            if size and size + len(line) > self.max_bytes:
                self._put(b"".join(lines[start:i]), i - start)
                self._rotate()
                start, size = i, 0
            size += len(line)
        self._put(b"".join(lines[start:]), len(lines) - start)

    def _put(self, data: bytes, records: int) -> None:
        if not records:
            return
        self._file.write(data)
        self._file.flush()
        self._size += len(data)
        self.written += records

    def _open(self) -> None:
        self._file = open(self.path, "ab")
        self._size = self._file.tell()

    def _rotate(self) -> None:
        self._close()
        os.replace(self.path, self.rotated_path)
        self.rotations += 1
        self._open()

    def _close(self) -> None:
        file, self._file = self._file, None
        if file is not None:
            try:
                file.close()
            except OSError:
                pass
