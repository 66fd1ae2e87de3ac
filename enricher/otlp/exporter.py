"""Forwarding enriched requests downstream: OTLP exporters and the `ExportQueue` before them.

The exporters send the ``ExportTraceServiceRequest`` itself (never SDK spans: that would be
lossy and ~50x slower) -- as the message, or as the bytes the pipeline rewrote
(`EncodedRequest`, sent without serializing) -- and classify the answer once into an
`ExportResult`:

- `HttpExporter`: POST the serialized request, gzip, to ``<endpoint>/v1/traces``;
  429/502/503/504 and network errors are RETRYABLE (honouring ``Retry-After``), other
  non-2xx PERMANENT.
- `GrpcExporter`: ``grpc://host:port`` (``grpcs://`` for TLS), stub ``Export``, gzip; the OTLP
  retryable codes are RETRYABLE (honouring ``google.rpc.RetryInfo``), RESOURCE_EXHAUSTED only
  with RetryInfo, the rest PERMANENT.
- `JsonLinesFileExporter`: one request per line in OTLP/JSON (hex ids), for local runs.

`ExportQueue` is the one place that retries: a FIFO bounded by spans, drained in order by
one worker task with exponential backoff; every span ends up counted as sent, failed or
dropped, by reason.

Thread contract: everything here lives on one event loop; call every method from it. An
exporter's ``export`` is awaited by one queue worker at a time and never raises.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import email.utils
import json
import logging
import random
import ssl
import time
import zlib
from collections.abc import Callable, Iterable

try:  # ISA-L's deflate: the same gzip bytes' worth at ~7x zlib's speed (benchmarks/RESULTS.md)
    from isal.isal_zlib import compress as _gzip_compress
except ImportError:  # a platform without its wheel: the standard library's
    _gzip_compress = zlib.compress

import aiohttp
import grpc
from google.protobuf import json_format
from google.rpc import error_details_pb2, status_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from kvmiss.enricher.otlp.interfaces import (
    EncodedRequest,
    ExportResult,
    OtlpRequest,
    Outcome,
    TracesExporter,
    request_bytes,
    request_message,
    span_count,
)
from kvmiss.schemas.config import ExportConfig

log = logging.getLogger(__name__)

SENT = ExportResult(Outcome.ACCEPTED)
RETRYABLE_HTTP_STATUS = frozenset({429, 502, 503, 504})
# The OTLP spec's retryable codes; RESOURCE_EXHAUSTED is retryable only with RetryInfo.
_C = grpc.StatusCode
RETRYABLE_GRPC_CODES = frozenset({_C.CANCELLED, _C.DEADLINE_EXCEEDED, _C.ABORTED, _C.OUT_OF_RANGE, _C.UNAVAILABLE, _C.DATA_LOSS})
EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
GZIP_LEVEL = 1  # ~3x faster than the default 6 for OTLP protobuf, ~10% larger: CPU is scarcer
THREAD_COMPRESS_BYTES = 64 * 1024  # below it, a thread hop (~50 us) costs more than it frees
# While a downstream keeps failing, one WARNING per this many seconds says so (the Collector's
# exporters log each failed attempt; a retry a second would bury every other line).
FAILURE_LOG_INTERVAL_S = 30.0


def classify_http(status: int, retry_after: str | None, message: str = "") -> ExportResult:
    """An OTLP/HTTP response status (and its ``Retry-After`` header) as an outcome."""
    if 200 <= status < 300:
        return SENT
    text = f"HTTP {status}" + (f": {message[:200]}" if message else "")
    if status in RETRYABLE_HTTP_STATUS:
        return ExportResult(Outcome.RETRYABLE, text, parse_retry_after(retry_after))
    return ExportResult(Outcome.PERMANENT, text)


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """``Retry-After`` as seconds from now: delta-seconds or an HTTP-date; None if absent/bad."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError):
        return None
    return max(0.0, when - (time.time() if now is None else now))


def classify_grpc(code: grpc.StatusCode, trailing_metadata: Iterable | None, details: str = "") -> ExportResult:
    """A gRPC status (and its ``grpc-status-details-bin`` trailer) as an outcome."""
    if code is grpc.StatusCode.OK:
        return SENT
    delay = retry_info_delay(trailing_metadata)
    text = f"gRPC {code.name}" + (f": {details[:200]}" if details else "")
    if code in RETRYABLE_GRPC_CODES or (code is grpc.StatusCode.RESOURCE_EXHAUSTED and delay is not None):
        return ExportResult(Outcome.RETRYABLE, text, delay)
    return ExportResult(Outcome.PERMANENT, text)


def retry_info_delay(trailing_metadata: Iterable | None) -> float | None:
    """Seconds from a ``google.rpc.RetryInfo`` in the status details trailer, if any."""
    for key, value in trailing_metadata or ():
        if key != "grpc-status-details-bin":
            continue
        try:
            status = status_pb2.Status.FromString(value)
        except Exception:  # a garbled trailer is no reason to fail the export path
            return None
        for detail in status.details:
            info = error_details_pb2.RetryInfo()
            if detail.Unpack(info):
                return info.retry_delay.seconds + info.retry_delay.nanos / 1e9
    return None


def _log_partial_success(response: ExportTraceServiceResponse, where: str) -> None:
    partial = response.partial_success
    if partial.rejected_spans:
        log.warning("%s rejected %d span(s): %s", where, partial.rejected_spans, partial.error_message)


def _read_ca(tls_ca: str) -> bytes:
    """The PEM CA bundle of ``export.tls_ca``; a ValueError naming key and path if unusable."""
    try:
        with open(tls_ca, "rb") as f:
            pem = f.read()
    except OSError as exc:
        raise ValueError(f"export.tls_ca: cannot read {tls_ca}: {exc.strerror or type(exc).__name__}") from None
    if b"-----BEGIN CERTIFICATE-----" not in pem:
        raise ValueError(f"export.tls_ca: {tls_ca} holds no PEM certificate")
    return pem


def client_ssl_context(tls_ca: str | None) -> ssl.SSLContext:
    """Verifying client context (TLS >= 1.2): trusts ``tls_ca`` only, or the system store."""
    if tls_ca is None:
        context = ssl.create_default_context()
    else:
        pem = _read_ca(tls_ca)
        try:
            context = ssl.create_default_context(cadata=pem.decode("ascii", "replace"))
        except ssl.SSLError:
            raise ValueError(f"export.tls_ca: {tls_ca} is not a valid PEM CA bundle") from None
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


class HttpExporter:
    """OTLP/HTTP protobuf exporter. ``endpoint``: ``http(s)://host:port`` (``/v1/traces`` is
    appended unless already there); ``timeout_s`` bounds one attempt. ``https://`` verifies
    the server against ``tls_ca`` (a PEM CA bundle) when given, else the system store."""

    def __init__(self, endpoint: str, *, timeout_s: float = 10.0, compression: str = "gzip", headers: dict | None = None,
                 tls_ca: str | None = None) -> None:  # fmt: skip
        endpoint = endpoint.rstrip("/")
        self.url = self.target = endpoint if endpoint.endswith("/v1/traces") else endpoint + "/v1/traces"
        # Built here, not per request: a bad CA file fails at start-up.
        self._ssl: ssl.SSLContext | bool = client_ssl_context(tls_ca) if self.url.startswith("https://") else True
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._gzip = compression == "gzip"
        self._headers = {"Content-Type": "application/x-protobuf", **(headers or {})}
        if self._gzip:
            self._headers["Content-Encoding"] = "gzip"
        self._session: aiohttp.ClientSession | None = None
        self._warned_tls = False

    async def export(self, request: OtlpRequest) -> ExportResult:
        if self._session is None:  # created here: a ClientSession belongs to the running loop
            self._session = aiohttp.ClientSession(
                timeout=self._timeout, connector=aiohttp.TCPConnector(limit=8, ssl=self._ssl)
            )
        body = request_bytes(request)
        if self._gzip:
            # Deflate releases the GIL: on a big body, a thread lets the loop keep receiving.
            if len(body) > THREAD_COMPRESS_BYTES:
                body = await asyncio.to_thread(_gzip_compress, body, GZIP_LEVEL, 31)  # 31: gzip framing
            else:
                body = _gzip_compress(body, GZIP_LEVEL, 31)
        try:
            async with self._session.post(self.url, data=body, headers=self._headers) as response:
                payload = await response.read()
                status, retry_after = response.status, response.headers.get("Retry-After")
                ctype = response.content_type
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            # Connection refused/reset, timeouts: the downstream is (for now) unavailable.
            # An untrusted certificate too (it may be rotated), but say so once, loudly.
            if isinstance(exc, aiohttp.ClientConnectorCertificateError) and not self._warned_tls:
                self._warned_tls = True
                log.warning("%s: server certificate not trusted (%s); is export.tls_ca right?", self.url, exc)
            return ExportResult(Outcome.RETRYABLE, f"{type(exc).__name__}: {exc}")
        if 200 <= status < 300 and payload and ctype == "application/x-protobuf":
            with contextlib.suppress(Exception):  # accepted either way; an odd body changes nothing
                _log_partial_success(ExportTraceServiceResponse.FromString(payload), self.url)
        return classify_http(status, retry_after, _status_message(payload, ctype) if status >= 300 else "")

    async def shutdown(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _status_message(payload: bytes, ctype: str) -> str:
    if ctype != "application/x-protobuf":
        return payload.decode("utf-8", "replace")
    with contextlib.suppress(Exception):
        return status_pb2.Status.FromString(payload).message
    return ""


class GrpcExporter:
    """OTLP/gRPC exporter. ``endpoint``: ``grpc://host:port`` (plaintext) or ``grpcs://``
    (TLS, verified against ``tls_ca`` when given, else gRPC's default roots)."""

    def __init__(self, endpoint: str, *, timeout_s: float = 10.0, compression: str = "gzip", metadata: tuple = (),
                 tls_ca: str | None = None) -> None:  # fmt: skip
        scheme, _, self.address = endpoint.partition("://")
        self.target = endpoint
        if scheme not in ("grpc", "grpcs") or not self.address:
            raise ValueError(f"gRPC endpoint must be grpc://host:port or grpcs://host:port, got {endpoint!r}")
        self._secure = scheme == "grpcs"
        # Read here, not at the first export: a bad CA file fails at start-up.
        self._credentials = (
            grpc.ssl_channel_credentials(root_certificates=_read_ca(tls_ca) if tls_ca else None) if self._secure else None
        )
        self._timeout = timeout_s
        self._compression = grpc.Compression.Gzip if compression == "gzip" else grpc.Compression.NoCompression
        self._metadata = metadata
        self._channel: grpc.aio.Channel | None = None
        self._stub: trace_service_pb2_grpc.TraceServiceStub | None = None
        self._export_bytes = None  # Export taking already encoded requests

    async def export(self, request: OtlpRequest) -> ExportResult:
        if self._stub is None:  # created here: an aio channel belongs to the running loop
            # grpc's own reconnect backoff grows to 120 s by default; the queue retries on its
            # own schedule, so keep the channel's short or a recovered sink stays unseen.
            options = [("grpc.max_reconnect_backoff_ms", 5_000), ("grpc.initial_reconnect_backoff_ms", 500)]
            if self._secure:
                self._channel = grpc.aio.secure_channel(self.address, self._credentials, options=options)
            else:
                self._channel = grpc.aio.insecure_channel(self.address, options=options)
            self._stub = trace_service_pb2_grpc.TraceServiceStub(self._channel)
            self._export_bytes = self._channel.unary_unary(  # no serializer: the bytes go as they are
                EXPORT_METHOD, response_deserializer=ExportTraceServiceResponse.FromString)
        call = self._export_bytes if type(request) is EncodedRequest else self._stub.Export
        body = request.body if type(request) is EncodedRequest else request
        try:
            response = await call(body, timeout=self._timeout, compression=self._compression, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            return classify_grpc(exc.code(), exc.trailing_metadata(), exc.details() or "")
        _log_partial_success(response, self.address)
        return SENT

    async def shutdown(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = self._export_bytes = None


def to_otlp_json(request: ExportTraceServiceRequest) -> str:
    """One request as compact OTLP/JSON: hex trace/span ids, integer enums, camelCase keys.
    Slow (pure-Python json_format, ~0.3 ms/span): for files and debugging only."""
    document = json_format.MessageToDict(request, use_integers_for_enums=True)
    for resource_spans in document.get("resourceSpans", ()):
        for scope_spans in resource_spans.get("scopeSpans", ()):
            for span in scope_spans.get("spans", ()):
                _base64_to_hex(span, ("traceId", "spanId", "parentSpanId"))
                for link in span.get("links", ()):
                    _base64_to_hex(link, ("traceId", "spanId"))
    return json.dumps(document, separators=(",", ":"))


def _base64_to_hex(obj: dict, keys: tuple[str, ...]) -> None:
    for key in keys:
        if key in obj:
            obj[key] = base64.b64decode(obj[key]).hex()


class JsonLinesFileExporter:
    """Appends each request as one OTLP/JSON line to ``path`` (flushed per request).

    Conversion and the write run in a worker thread so the loop keeps serving; a failed
    write is PERMANENT (retrying will not fix a full disk soon enough)."""

    def __init__(self, path: str) -> None:
        self.path = self.target = path
        self._file = None

    def open(self) -> None:
        """Open (create) the file now: a path that cannot be written stops start-up, rather
        than failing at the first span (OSError)."""
        if self._file is None:
            self._file = open(self.path, "a", encoding="utf-8")

    async def export(self, request: OtlpRequest) -> ExportResult:
        try:
            await asyncio.to_thread(self._write, request_message(request))
        except (OSError, ValueError) as exc:
            return ExportResult(Outcome.PERMANENT, f"{self.path}: {exc}")
        return SENT

    def _write(self, request: ExportTraceServiceRequest) -> None:
        if self._file is None:
            self._file = open(self.path, "a", encoding="utf-8")
        self._file.write(to_otlp_json(request) + "\n")
        self._file.flush()

    async def shutdown(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def build_exporters(config: ExportConfig) -> list[TracesExporter]:
    """The exporters ``[export]`` asks for (network endpoint, file, both or none).

    Give each its own `ExportQueue`: a retrying network sink must not rewrite file lines."""
    exporters: list[TracesExporter] = []
    if config.endpoint:
        scheme = config.endpoint.partition("://")[0]
        if config.tls_ca and scheme in ("http", "grpc"):
            log.warning("export.tls_ca is set but export.endpoint %s is plain text: the CA is not used", config.endpoint)
        if scheme in ("http", "https"):
            exporters.append(HttpExporter(config.endpoint, timeout_s=config.timeout_s, tls_ca=config.tls_ca))
        elif scheme in ("grpc", "grpcs"):
            exporters.append(GrpcExporter(config.endpoint, timeout_s=config.timeout_s, tls_ca=config.tls_ca))
        else:
            raise ValueError(f"export.endpoint must start with http://, https://, grpc:// or grpcs://, got {config.endpoint!r}")
    if config.file:
        exporters.append(JsonLinesFileExporter(config.file))
    return exporters


class ExportQueue:
    """A FIFO of requests in front of one exporter, bounded by ``max_spans``, drained in
    order by one worker task that retries RETRYABLE results with exponential backoff.

    Backoff starts at ``initial_backoff_s``, doubles up to ``max_backoff_s`` with +-20 %
    jitter; a delay the server asked for (Retry-After / RetryInfo) is used as given. A request
    still failing after ``max_elapsed_s`` is given up. Counters (spans): ``enqueued_spans``
    (taken by `put`); ``sent_spans`` (delivered: the downstream accepted them);
    ``retried_spans`` (in an attempt that is retried); ``failed_spans`` by reason
    (``permanent``, ``retries_exhausted``, ``exporter_error``); ``dropped_spans`` by reason
    (``queue_full``, ``already_shutdown``, ``shutdown``); ``retries`` counts attempts after
    the first. A failing downstream is logged at WARNING when it starts failing, at most every
    `FAILURE_LOG_INTERVAL_S` while it goes on, and when it recovers.
    """

    def __init__(self, exporter: TracesExporter, *, max_spans: int = 200_000, initial_backoff_s: float = 1.0,
                 max_backoff_s: float = 30.0, max_elapsed_s: float = 300.0) -> None:  # fmt: skip
        # (spans, tag) when a request leaves for good -- sent, or given up and counted --; not
        # for one dropped at shutdown, which the span journal replays on the next start.
        self.on_finished: Callable[[int, object], None] | None = None
        self.exporter = exporter
        self.max_spans = max_spans
        self._initial_backoff = initial_backoff_s
        self._max_backoff = max_backoff_s
        self._max_elapsed = max_elapsed_s
        # (request, spans, tag); the head stays in the deque while it is being exported, so
        # the bound also covers the request in flight.
        self._items: collections.deque[tuple[OtlpRequest, int, object]] = collections.deque()
        self.queued_spans = 0
        self._put_seq = 0  # requests ever queued
        self._done_seq = 0  # requests finished (sent, failed or dropped)
        self._flush_waiters: list[tuple[int, asyncio.Future]] = []
        self._wakeup = asyncio.Event()
        self._worker: asyncio.Task | None = None
        self._closing = False
        self._shutdown: asyncio.Task | None = None
        self.enqueued_spans = 0
        self.sent_spans = 0
        self.retried_spans = 0
        self.failing_since: float | None = None  # loop time of the first failure of a run of them
        self._failure_logged = float("-inf")
        self._failures_unlogged = 0
        self.failed_spans: collections.Counter[str] = collections.Counter()
        self.dropped_spans: collections.Counter[str] = collections.Counter()
        self.retries = 0

    async def start(self) -> None:
        """Start the worker on the running loop (requests put before are kept)."""
        if self._worker is None and not self._closing:
            self._worker = asyncio.get_running_loop().create_task(self._run(), name="kvmiss-export-queue")

    def has_capacity(self, n_spans: int) -> bool:
        """Whether `put` of ``n_spans`` would be taken now; the pipeline answers RETRYABLE
        upstream when not. An empty queue takes any size, so one huge request cannot wedge."""
        return not self._closing and (self.queued_spans == 0 or self.queued_spans + n_spans <= self.max_spans)

    def put(self, request: OtlpRequest, n_spans: int | None = None, tag: object = None) -> bool:
        """Queue ``request`` (the queue owns it from now on); ``tag`` comes back with
        `on_finished`. Never blocks; returns False, counting the spans as dropped, when full
        or shut down."""
        n = span_count(request) if n_spans is None else n_spans
        if self._closing:
            self.dropped_spans["already_shutdown"] += n
            return False
        if not self.has_capacity(n):
            if not self.dropped_spans["queue_full"]:
                log.warning("export queue full (%d spans): refusing requests; counted as queue_full", self.max_spans)
            self.dropped_spans["queue_full"] += n
            return False
        self._items.append((request, n, tag))
        self.enqueued_spans += n
        self.queued_spans += n
        self._put_seq += 1
        self._wakeup.set()
        return True

    async def force_flush(self, timeout: float) -> bool:
        """Wait until every request queued before this call is finished (sent or failed);
        False if ``timeout`` seconds passed first (or the worker is not running)."""
        if self._done_seq >= self._put_seq:
            return True
        if self._worker is None or self._worker.done():
            return False
        waiter = asyncio.get_running_loop().create_future()
        self._flush_waiters.append((self._put_seq, waiter))
        try:
            await asyncio.wait_for(asyncio.shield(waiter), timeout)
            return True
        except TimeoutError:
            return False

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Refuse new requests, flush for up to ``timeout`` s, drop (and count) what is left,
        shut the exporter down. Safe to call twice or without `start`."""
        if self._shutdown is None:
            self._shutdown = asyncio.ensure_future(self._close(timeout))
        await asyncio.shield(self._shutdown)

    async def _close(self, timeout: float) -> None:
        self._closing = True
        flushed = await self.force_flush(timeout)
        if self._worker is not None:
            self._worker.cancel()  # idle or stuck retrying: either way it is done now
            await asyncio.gather(self._worker, return_exceptions=True)
        if not flushed and self._items:
            log.warning("export queue: %d spans not sent within %.1f s of shutdown; dropped", self.queued_spans, timeout)
        while self._items:
            _, n, _ = self._items.popleft()
            self.dropped_spans["shutdown"] += n
            self._finished(n, None)  # not gone for good: journaled, it is replayed at the next start
        await self.exporter.shutdown()

    async def _run(self) -> None:
        while True:
            if not self._items:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            request, n, tag = self._items[0]
            await self._export(request, n)
            self._items.popleft()
            self._finished(n, tag)

    def _finished(self, n: int, tag: object) -> None:
        self.queued_spans -= n
        if self.on_finished is not None and tag is not None:
            self.on_finished(n, tag)
        self._done_seq += 1
        while self._flush_waiters and self._flush_waiters[0][0] <= self._done_seq:
            _, waiter = self._flush_waiters.pop(0)
            if not waiter.done():
                waiter.set_result(None)

    async def _export(self, request: OtlpRequest, n: int) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        backoff = self._initial_backoff
        while True:
            try:
                result = await self.exporter.export(request)
            except Exception:  # exporters must not raise; if one does, do not loop on a bug
                log.exception("exporter %r raised; %d spans failed", self.exporter, n)
                self.failed_spans["exporter_error"] += n
                return
            if result.outcome is Outcome.ACCEPTED:
                self.sent_spans += n
                if self.failing_since is not None:
                    self._recovered(loop.time())
                return
            if result.outcome is Outcome.PERMANENT:
                self.failed_spans["permanent"] += n
                self._failing(loop.time(), f"{n} spans dropped (not retryable): {result.message}")
                return
            if result.retry_after_s is not None:
                delay = result.retry_after_s  # the server knows its load better than we do
            else:
                delay = backoff * random.uniform(0.8, 1.2)
                backoff = min(backoff * 2, self._max_backoff)
            if loop.time() + delay - started > self._max_elapsed:
                self.failed_spans["retries_exhausted"] += n
                self._failing(loop.time(), f"{n} spans dropped after {self._max_elapsed:.0f} s of retries: "
                                           f"{result.message}", force=True)
                return
            self.retries += 1
            self.retried_spans += n
            self._failing(loop.time(), f"{result.message}; retrying in {delay:.1f} s")
            await asyncio.sleep(delay)

    def _failing(self, now: float, what: str, *, force: bool = False) -> None:
        """A failed attempt: WARNING at the first of a run, then at most every interval (spans
        given up on are always said)."""
        if self.failing_since is None:
            self.failing_since = now
        if not force and now - self._failure_logged < FAILURE_LOG_INTERVAL_S:
            self._failures_unlogged += 1
            return
        since = now - self.failing_since
        also = f"; {self._failures_unlogged} more failures since the last message" if self._failures_unlogged else ""
        log.warning("export to %s failing%s: %s; %d spans queued, %d delivered, %d dropped so far%s",
                    self.exporter.target, f" for {since:.0f} s" if since >= 1 else "", what, self.queued_spans,
                    self.sent_spans, self.dropped_total, also)
        self._failure_logged, self._failures_unlogged = now, 0

    def _recovered(self, now: float) -> None:
        log.warning("export to %s recovered after %.1f s: %d spans delivered, %d dropped so far",
                    self.exporter.target, now - self.failing_since, self.sent_spans, self.dropped_total)
        self.failing_since, self._failure_logged, self._failures_unlogged = None, float("-inf"), 0

    @property
    def dropped_total(self) -> int:
        """Spans this queue will never deliver, for whatever reason."""
        return sum(self.failed_spans.values()) + sum(self.dropped_spans.values())
