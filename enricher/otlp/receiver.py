"""OTLP trace receivers: OTLP/gRPC and OTLP/HTTP (protobuf and JSON) on one asyncio loop.

Both decode an ``ExportTraceServiceRequest``, drop spans with malformed ids
(`drop_invalid_spans`, the one validation both share), hand the rest to a `TracesConsumer`
and map its `ConsumeResult` to the wire. This module is the only place that mapping lives:

==========  ===========================================  ======================================
outcome     gRPC                                         HTTP
==========  ===========================================  ======================================
ACCEPTED    OK; ``partial_success`` iff spans rejected    200; same body, request's content type
RETRYABLE   UNAVAILABLE + ``google.rpc.RetryInfo``        503 + ``Retry-After`` (integer s, >= 1)
(a client   UNAVAILABLE + ``google.rpc.RetryInfo``        429 + ``Retry-After`` (integer s, >= 1)
over its
share)
PERMANENT   INVALID_ARGUMENT                             400
==========  ===========================================  ======================================

HTTP takes bodies as they are or compressed (``Content-Encoding`` gzip, deflate, zlib or
zstd), and also answers 415 (content type or encoding not supported), 413 (body larger than
``OtlpConfig.max_body_bytes`` after decompression; not retryable), 400 (malformed body) and
503 with Retry-After when the body did not arrive within ``OtlpConfig.body_timeout_s`` of the
headers (the connection is closed after it). Not 408: OTLP clients do not retry 408, and a
body cut off in transit is a transient failure whose spans a real client should send again.
Error bodies are a ``google.rpc.Status`` in the request's content type, as OTLP/HTTP asks.

Intake limits, before the consumer sees a span: ``max_spans_per_s_per_client`` (a token
bucket per peer IP address, shared by both receivers, in a table of at most
`MAX_TRACKED_CLIENTS` peers) and then ``max_spans_per_s`` (one bucket for everyone). Each
receiver holds at most ``max_connections`` open connections: HTTP closes any further one as
soon as it is accepted (before a TLS handshake; counted), and any beyond
``max_connections_per_client`` from one peer address, gRPC leaves it to grpc core
(``grpc.max_allowed_incoming_connections``, per listening address: the client sees
UNAVAILABLE, which it retries). Every gRPC connection carries at most
`GRPC_STREAMS_PER_CONNECTION` calls at a time (more wait in the client), and connections
idle for `IDLE_CONNECTION_S` are closed on both, so dead clients give their slots back. HTTP
bounds slow clients too (enricher/otlp/listener.py): headers within `IDLE_CONNECTION_S`, the body
within ``body_timeout_s``, an answer left unread for `listener.ANSWER_STALL_S`.

Thread contract: `Receivers` lives on one event loop; construct it anywhere, call `start`,
`shutdown` and read `stats` from that loop only. The consumer is awaited on the same loop
and must not block it.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import json
import logging
import math
import resource
import ssl
import time
import urllib.parse
import zlib
from collections.abc import Callable

try:  # Python 3.14 has it; before, its backport (same API)
    from compression import zstd
except ImportError:
    from backports import zstd

import grpc
from aiohttp import web
from google.protobuf import any_pb2, duration_pb2, json_format
from google.protobuf.internal import api_implementation
from google.protobuf.message import DecodeError, Message
from google.rpc import code_pb2, error_details_pb2, status_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from kvmiss.enricher.otlp.interfaces import ConsumeResult, Outcome, TracesConsumer, count_spans, span_count
from kvmiss.enricher.otlp.listener import (
    LIMIT_WARNING_INTERVAL_S,
    BodyRefused,
    ConnectionBounds,
    HttpListener,
    LimitLog,
    answer_and_close,
    listen_as,
    read_body,
)
from kvmiss.schemas.config import OtlpConfig

log = logging.getLogger(__name__)

PROTOBUF = "application/x-protobuf"
JSON = "application/json"
TRACES_PATH = "/v1/traces"
DEFAULT_RETRY_AFTER_S = 1.0  # when a consumer says RETRYABLE without a delay
_GRPC_SERVICE = "opentelemetry.proto.collector.trace.v1.TraceService"
_STATUS_DETAILS_KEY = "grpc-status-details-bin"
_THREAD_INFLATE_BYTES = 32 * 1024  # below it, a thread hop (~50 us) costs more than it frees
_INTERNAL = ConsumeResult(Outcome.PERMANENT, message="internal error")  # marker, see _deliver
MAX_TRACKED_CLIENTS = 4096  # peers with a per-client rate bucket; the least recent is forgotten
GRPC_STREAMS_PER_CONNECTION = 16  # concurrent calls on one gRPC connection (HTTP/2 streams)
IDLE_CONNECTION_S = 75.0  # a connection with no request for this long is closed
TLS_HANDSHAKE_TIMEOUT_S = 10.0  # an HTTP connection's TLS handshake holds a slot this long at most


def drop_invalid_spans(request: ExportTraceServiceRequest) -> int:
    """Remove, in place, spans whose trace id is not 16 bytes or span id not 8 bytes.

    Returns how many were removed; the rest of the request is untouched (OTLP partial
    success: the sender is told the count and must not retry). Costs ~0.4 us/span.
    """
    rejected = 0
    for resource_spans in request.resource_spans:
        for scope_spans in resource_spans.scope_spans:
            spans = scope_spans.spans
            bad = [i for i, s in enumerate(spans) if len(s.trace_id) != 16 or len(s.span_id) != 8]
            for i in reversed(bad):  # from the end, so earlier indexes stay valid
                del spans[i]
            rejected += len(bad)
    return rejected


def parse_otlp_json(body: bytes) -> ExportTraceServiceRequest:
    """Decode an OTLP/JSON body: like protobuf JSON, but ids are hex and enums may be ints.

    Unknown fields are ignored (newer senders). Raises ValueError on anything malformed,
    including nesting past the interpreter's recursion limit (both parsers recurse).
    About 300-550 us/span: meant for debugging volumes, not production traffic.
    """
    try:
        document = json.loads(body)
    except RecursionError:
        raise ValueError("OTLP/JSON body is nested too deeply") from None
    if not isinstance(document, dict):
        raise ValueError("OTLP/JSON body must be an object")
    for resource_spans in _items(document, "resourceSpans", "resource_spans"):
        for scope_spans in _items(resource_spans, "scopeSpans", "scope_spans"):
            for span in _items(scope_spans, "spans", "spans"):
                _hex_to_base64(span, ("traceId", "trace_id", "spanId", "span_id", "parentSpanId", "parent_span_id"))
                for link in _items(span, "links", "links"):
                    _hex_to_base64(link, ("traceId", "trace_id", "spanId", "span_id"))
    request = ExportTraceServiceRequest()
    try:
        json_format.ParseDict(document, request, ignore_unknown_fields=True)
    except json_format.ParseError as exc:
        raise ValueError(str(exc)) from None
    except RecursionError:
        raise ValueError("OTLP/JSON body is nested too deeply") from None
    except OverflowError as exc:  # json_format converts floats for int fields unguarded
        raise ValueError(f"OTLP/JSON number out of range: {exc}") from None
    return request


def _items(obj: object, camel: str, snake: str) -> list:
    # Non-lists are left alone here: ParseDict then reports them with their path.
    value = obj.get(camel, obj.get(snake)) if isinstance(obj, dict) else None
    return value if isinstance(value, list) else []


def _hex_to_base64(obj: object, keys: tuple[str, ...]) -> None:
    if not isinstance(obj, dict):
        return
    for key in keys:
        value = obj.get(key)
        if isinstance(value, str):
            try:
                obj[key] = base64.b64encode(bytes.fromhex(value)).decode("ascii")
            except ValueError:
                raise ValueError(f"{key} is not hex: {value[:40]!r}") from None


def retry_status_details(message: str, retry_after_s: float) -> bytes:
    """A serialized ``google.rpc.Status`` (UNAVAILABLE) carrying a ``RetryInfo`` delay,
    the value of the ``grpc-status-details-bin`` trailer."""
    seconds = max(0.0, retry_after_s)
    delay = duration_pb2.Duration(seconds=int(seconds), nanos=int((seconds % 1) * 1e9))
    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.RetryInfo(retry_delay=delay))
    return status_pb2.Status(code=code_pb2.UNAVAILABLE, message=message, details=[detail]).SerializeToString()


def check_protobuf_backend() -> str:
    """Return the protobuf backend; warn loudly unless it is upb (pure Python is ~60x slower)."""
    backend = api_implementation.Type()
    if backend != "upb":
        log.warning(
            "!!! protobuf is using the %r backend, not 'upb': OTLP parsing and serialization will "
            "be ~60x slower. Install a protobuf wheel with upb and unset "
            "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION. !!!",
            backend,
        )
    return backend




class TlsFilesError(ValueError):
    """``otlp.tls_cert`` / ``otlp.tls_key`` cannot be used; the message names the key and
    path only (never file contents)."""


def _refuse_encrypted_key() -> bytes:
    # Without a password callback OpenSSL would prompt on the terminal and hang a service.
    raise TlsFilesError("encrypted private keys are not supported")


def load_server_tls(cert_path: str, key_path: str) -> tuple[ssl.SSLContext, grpc.ServerCredentials]:
    """The HTTP server's `ssl.SSLContext` (TLS >= 1.2) and gRPC server credentials from a PEM
    certificate chain and its private key. Raises `TlsFilesError` when a file is missing,
    unreadable, not PEM, encrypted, or the key does not match the certificate."""
    files = {}
    for key, path in (("otlp.tls_cert", cert_path), ("otlp.tls_key", key_path)):
        try:
            with open(path, "rb") as f:
                files[key] = f.read()
        except OSError as exc:
            raise TlsFilesError(f"{key}: cannot read {path}: {exc.strerror or type(exc).__name__}") from None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert_path, key_path, password=_refuse_encrypted_key)
    except TlsFilesError as exc:
        raise TlsFilesError(f"otlp.tls_key: {key_path}: {exc}") from None
    except (ssl.SSLError, OSError):  # OpenSSL's text says little more ("PEM lib"); keep it out
        raise TlsFilesError(
            f"otlp.tls_cert / otlp.tls_key: {cert_path} and {key_path} are not a PEM certificate "
            "chain and its matching unencrypted private key"
        ) from None
    credentials = grpc.ssl_server_credentials([(files["otlp.tls_key"], files["otlp.tls_cert"])])
    return context, credentials


class _Rejected(Exception):
    """An HTTP request that is answered with an error status (never leaves this module)."""

    def __init__(self, status: int, reason: str, message: str, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.reason, self.headers = status, reason, headers


class SpanRate:
    """A token bucket over spans: ``per_s`` sustained, bursts of up to one second's worth
    (and always at least one whole request, so a big batch is not refused forever)."""

    def __init__(self, per_s: float):
        self.per_s = per_s
        self.tokens = per_s
        self.at: float | None = None

    def take(self, spans: int, now: float) -> bool:
        if self.at is not None:
            self.tokens = min(max(self.per_s, spans), self.tokens + (now - self.at) * self.per_s)
        self.at = now
        if self.tokens >= spans or self.tokens >= self.per_s:
            self.tokens -= spans
            return True
        return False

    def wait_s(self, spans: int) -> float:
        return max(1.0, (min(spans, self.per_s) - self.tokens) / self.per_s)

    def give_back(self, spans: int) -> None:
        """Undo the `take` just made (a later limit refused the request)."""
        self.tokens += spans


class _ClientRate(SpanRate):
    limited = False  # refused at least once (its address was logged then)


class ClientRates:
    """A `SpanRate` of ``per_s`` for each client, keyed by peer address, in a table of at most
    ``max_clients`` entries. A full table forgets its least recently seen client: a forgotten
    client that comes back starts with a full bucket (more lenient, never stricter), and a
    client sending right now is never the one forgotten. O(1) per request."""

    def __init__(self, per_s: float, max_clients: int = MAX_TRACKED_CLIENTS):
        if max_clients < 1:
            raise ValueError("max_clients must be >= 1")
        self.per_s = per_s
        self.max_clients = max_clients
        self.forgotten = 0
        self._rates: collections.OrderedDict[str, _ClientRate] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._rates)

    def __contains__(self, peer: str) -> bool:
        return peer in self._rates

    def rate(self, peer: str) -> _ClientRate:
        rate = self._rates.get(peer)
        if rate is not None:
            self._rates.move_to_end(peer)
            return rate
        if len(self._rates) >= self.max_clients:
            self._rates.popitem(last=False)
            self.forgotten += 1
        rate = self._rates[peer] = _ClientRate(self.per_s)
        return rate


UNKNOWN_PEER = "unknown"


def client_key(host: str | None) -> str:
    """The per-client key of a peer IP address: an IPv4-mapped IPv6 address counts as its
    IPv4 address (one host, either socket family); no address is one shared key."""
    if not host:
        return UNKNOWN_PEER
    host = host.lower()
    if host.startswith("::ffff:") and "." in host:
        return host[7:]
    return host


def grpc_peer_host(peer: str | None) -> str:
    """The client key of a grpc peer string: ``ipv4:10.0.0.7:53422`` -> ``10.0.0.7``,
    ``ipv6:%5B::1%5D:53422`` (or unquoted) -> ``::1``; unix sockets and anything else are
    one key per transport kind."""
    if not peer:
        return UNKNOWN_PEER
    kind, _, address = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return kind if kind in ("unix", "unix-abstract", "vsock") else UNKNOWN_PEER
    host = urllib.parse.unquote(address).rpartition(":")[0]
    return client_key(host.strip("[]"))


class _ClientLimited(ConsumeResult, frozen=True):
    """RETRYABLE because this client is over its own share (HTTP answers 429, not 503)."""


class Receivers:
    """The OTLP/gRPC and OTLP/HTTP receivers of one process, sharing one consumer.

    ``config.grpc`` / ``config.http`` are listen addresses (None or "" disables that
    receiver; port 0 picks a free port, see `grpc_port` / `http_port`). With
    ``config.tls_cert`` and ``config.tls_key`` both serve TLS only (HTTP: TLS >= 1.2).
    ``stats`` counts requests and spans by outcome and reason, and the HTTP listener's
    connections (``http_``-prefixed, see enricher/otlp/listener.py; read it at scrape time);
    `gauges` adds the open HTTP connections and the size of the per-client table.
    ``clock`` (monotonic seconds) drives the rate limits; ``max_clients`` bounds the table.
    """

    def __init__(self, config: OtlpConfig, consumer: TracesConsumer, *,
                 clock: Callable[[], float] = time.monotonic, max_clients: int = MAX_TRACKED_CLIENTS) -> None:
        self._config = config
        self._consumer = consumer
        self._max_body = config.max_body_bytes
        self._clock = clock
        self._rate = SpanRate(config.max_spans_per_s) if config.max_spans_per_s > 0 else None
        per_client = config.max_spans_per_s_per_client
        self.clients = ClientRates(per_client, max_clients) if per_client > 0 else None
        self._max_connections = config.max_connections
        self._body_timeout_s = config.body_timeout_s
        self._warnings = LimitLog(log)
        self.stats: collections.Counter[str] = collections.Counter()
        self._grpc_server: grpc.aio.Server | None = None
        self._http: HttpListener | None = None
        self._in_flight = 0  # HTTP requests being handled, for a graceful shutdown
        self._idle = asyncio.Event()
        self._idle.set()
        self.grpc_port: int | None = None
        self.http_port: int | None = None
        self._shutdown: asyncio.Task | None = None
        self._http_tls: ssl.SSLContext | None = None
        self._grpc_tls: grpc.ServerCredentials | None = None

    async def start(self) -> None:
        """Bind and start serving; returns once both listen. Raises OSError/RuntimeError
        when an address cannot be bound, `TlsFilesError` (a ValueError) when the TLS files
        cannot be used (nothing is left running then)."""
        check_protobuf_backend()
        if self._config.tls_cert or self._config.tls_key:
            if not (self._config.tls_cert and self._config.tls_key):  # config.py refuses it too
                raise TlsFilesError("otlp.tls_cert and otlp.tls_key go together")
            self._http_tls, self._grpc_tls = load_server_tls(self._config.tls_cert, self._config.tls_key)
        try:
            for key, address, start in (("otlp.grpc", self._config.grpc, self._start_grpc),
                                        ("otlp.http", self._config.http, self._start_http)):
                if address:
                    await listen_as(key, address, start)
        except BaseException:
            await self.shutdown(0)
            raise
        _check_fd_limit(self._max_connections, bool(self._config.grpc) + bool(self._config.http))
        log.info("OTLP receivers listening: grpc=%s http=%s tls=%s", self.grpc_port, self.http_port,
                 "on" if self._http_tls is not None else "off")

    async def shutdown(self, grace: float = 5.0) -> None:
        """Stop accepting, give in-flight requests ``grace`` seconds, then cancel them.
        Safe before `start` and when called twice (the second call awaits the first)."""
        if self._shutdown is None:
            self._shutdown = asyncio.ensure_future(self._stop(grace))
        await asyncio.shield(self._shutdown)

    @property
    def http_connections(self) -> int:
        """Open OTLP/HTTP connections (at most ``max_connections`` when that is set)."""
        return self._http.connections if self._http is not None else 0

    def gauges(self) -> dict[str, int]:
        """Point-in-time values for the metrics endpoint (``stats`` holds the counters)."""
        return {"http_connections": self.http_connections,
                "clients_tracked": len(self.clients) if self.clients is not None else 0}

    async def _stop(self, grace: float) -> None:
        grace = max(0.0, grace)
        if self._http is not None:  # stop accepting; open connections finish their requests
            await self._http.stop_accepting()
        waits = [self._stop_http(grace)]
        if self._grpc_server is not None:
            waits.append(self._grpc_server.stop(grace))
        await asyncio.gather(*waits)  # both drain within the same grace period

    async def _stop_http(self, grace: float) -> None:
        if self._http is None:
            return
        try:
            await asyncio.wait_for(self._idle.wait(), grace)
        except TimeoutError:
            log.warning("OTLP/HTTP: %d requests still in flight after %.1f s; cancelling", self._in_flight, grace)
        await self._http.shutdown()

    # -- shared by both receivers ------------------------------------------------------

    async def _deliver(self, request: ExportTraceServiceRequest, peer: str = UNKNOWN_PEER,
                       body: bytes | None = None, gzipped: bytes | None = None) -> ConsumeResult:
        """``peer``: the client's key (`client_key` / `grpc_peer_host`), for its own rate limit;
        ``body``: the protobuf bytes ``request`` was parsed from, if it was (the consumer may
        read them instead of the message: `Pipeline.consume`)."""
        self.stats["requests"] += 1
        counted = None if body is None else count_spans(body)  # (spans, bad ids), in C
        if counted is not None and not counted[1]:
            rejected, n_spans = 0, counted[0]  # every id valid: no need to walk the spans
        else:
            rejected = drop_invalid_spans(request)
            n_spans = span_count(request)
            if rejected:
                self.stats["spans_rejected_invalid_id"] += rejected
                body = gzipped = None  # no longer what the request holds
        self.stats["spans_received"] += n_spans + rejected
        if n_spans == 0:  # nothing left to hand on (empty request, or every span bad)
            result = ConsumeResult(Outcome.ACCEPTED)
        elif (refused := self._admit(n_spans, peer)) is not None:
            return refused
        else:
            try:
                result = await self._consumer.consume(request, body, gzipped)
            except Exception:  # a consumer bug: answer 500/INTERNAL, never make senders retry it
                log.exception("OTLP consumer raised; answering INTERNAL")
                self.stats["requests_consumer_error"] += 1
                return _INTERNAL
        self.stats[f"requests_{result.outcome.value}"] += 1
        if result.outcome is Outcome.ACCEPTED:
            self.stats["spans_accepted"] += n_spans - result.rejected_spans
        if rejected and result.outcome is Outcome.ACCEPTED:
            why = f"{rejected} span(s) with a trace id not 16 bytes or a span id not 8 bytes"
            message = "; ".join(m for m in (why, result.message) if m)
            result = ConsumeResult(Outcome.ACCEPTED, rejected_spans=result.rejected_spans + rejected, message=message)
        return result

    def _admit(self, spans: int, peer: str) -> ConsumeResult | None:
        """Take ``spans`` from the client's bucket, then from the global one; None when both
        had room, else the refusal (and nothing taken from either)."""
        now = self._clock()
        client = self.clients.rate(peer) if self.clients is not None else None
        if client is not None and not client.take(spans, now):
            self.stats["requests_client_rate_limited"] += 1
            self.stats["spans_refused_client_rate_limit"] += spans
            if not client.limited:
                client.limited = True
                self._warn("client", "OTLP client %s is over otlp.max_spans_per_s_per_client (%g spans/s): its "
                           "excess is refused with a retry delay (logged once per client, at most every %g s; "
                           "counted in kvmiss_spans_refused_total{reason=\"client_rate_limit\"})",
                           peer, client.per_s, LIMIT_WARNING_INTERVAL_S)
            return _ClientLimited(Outcome.RETRYABLE, message="kvmiss per-client intake rate limit",
                                  retry_after_s=client.wait_s(spans))
        if self._rate is not None and not self._rate.take(spans, now):
            if client is not None:
                client.give_back(spans)
            self.stats["requests_rate_limited"] += 1
            self.stats["spans_refused_rate_limit"] += spans
            return ConsumeResult(Outcome.RETRYABLE, message="kvmiss intake rate limit",
                                 retry_after_s=self._rate.wait_s(spans))
        return None

    def _warn(self, limit: str, message: str, *args: object) -> None:
        """Log ``message`` at WARNING unless this limit was logged in the last few seconds
        (the counters in ``stats`` see every case)."""
        self._warnings.warn(limit, message, *args)

    # -- gRPC ----------------------------------------------------------------------------

    async def _start_grpc(self, host: str, port: int) -> None:
        options = [
            ("grpc.max_receive_message_length", self._max_body),  # default 4 MiB is too small
            ("grpc.so_reuseport", 0),  # else a second kvmiss silently shares the port
            ("grpc.max_concurrent_streams", GRPC_STREAMS_PER_CONNECTION),
            ("grpc.max_connection_idle_ms", int(IDLE_CONNECTION_S * 1000)),
        ]
        if self._max_connections:  # grpc core closes further connections as they arrive
            options.append(("grpc.max_allowed_incoming_connections", self._max_connections))
        # No maximum_concurrent_rpcs: grpcio answers it with RESOURCE_EXHAUSTED and no
        # RetryInfo, which OTLP clients (the Collector's) treat as final; connections x
        # streams bound the calls instead, and handlers are coroutines (no thread per call).
        server = grpc.aio.server(options=options)
        # Registered by hand with a bytes-in handler so that a corrupt body is answered
        # INVALID_ARGUMENT here; grpcio's own deserializer would answer UNKNOWN.
        servicer = _TraceService(self)
        handler = grpc.unary_unary_rpc_method_handler(
            servicer.Export, request_deserializer=None, response_serializer=ExportTraceServiceResponse.SerializeToString
        )
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_GRPC_SERVICE, {"Export": handler}),))
        target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if self._grpc_tls is not None:
            bound = server.add_secure_port(target, self._grpc_tls)
        else:
            bound = server.add_insecure_port(target)
        if bound == 0:  # older grpcio returns 0 instead of raising
            raise OSError(f"OTLP/gRPC: cannot listen on {target}")
        await server.start()
        self._grpc_server, self.grpc_port = server, bound

    # -- HTTP ----------------------------------------------------------------------------

    async def _start_http(self, host: str, port: int) -> None:
        app = web.Application()
        app.router.add_post(TRACES_PATH, self._handle_http)
        bounds = ConnectionBounds(self._max_connections, idle_s=IDLE_CONNECTION_S,
                                  max_connections_per_client=self._config.max_connections_per_client,
                                  tls_handshake_s=TLS_HANDSHAKE_TIMEOUT_S)
        # auto_decompress off: we gunzip ourselves with the size cap (no gzip bombs).
        self._http = HttpListener(app, bounds, name="OTLP/HTTP", stats=self.stats, prefix="http_",
                                  cap_hint="otlp.max_connections; counted in kvmiss_otlp_http_connections_refused_total",
                                  warnings=self._warnings, ssl_context=self._http_tls, auto_decompress=False)
        await self._http.start(host, port)
        self.http_port = self._http.port

    async def _handle_http(self, http_request: web.Request) -> web.Response:
        self._in_flight += 1
        self._idle.clear()
        try:
            return await self._answer_http(http_request)
        finally:
            self._in_flight -= 1
            if not self._in_flight:
                self._idle.set()

    async def _answer_http(self, http_request: web.Request) -> web.Response:
        ctype = http_request.content_type  # lowercased, parameters stripped
        try:
            if ctype not in (PROTOBUF, JSON):
                raise _Rejected(415, "unsupported_media_type", f"Content-Type must be {PROTOBUF} or {JSON}")
            encoding = http_request.headers.get("Content-Encoding", "identity").strip().lower() or "identity"
            if encoding != "identity":
                if encoding not in _INFLATERS:
                    raise _Rejected(415, "unsupported_encoding", f"Content-Encoding must be {_ENCODINGS_ACCEPTED}")
                self.stats[f"http_requests_{encoding}"] += 1
            body, gzipped = await self._read_body(http_request, encoding)
            request = self._decode(body, ctype)
            if ctype == JSON:
                body = gzipped = None  # not protobuf bytes
        except _Rejected as rejected:
            self.stats[f"requests_{rejected.reason}"] += 1
            response = self._http_error(rejected.status, str(rejected), ctype, rejected.headers)
            if rejected.reason == "body_timeout":  # the rest may never come: do not wait for it
                return await answer_and_close(http_request, response)
            return response
        result = await self._deliver(request, client_key(http_request.remote), body, gzipped)
        if result is _INTERNAL:
            return self._http_error(500, result.message, ctype)
        if result.outcome is Outcome.RETRYABLE:
            seconds = result.retry_after_s if result.retry_after_s is not None else DEFAULT_RETRY_AFTER_S
            headers = {"Retry-After": str(max(1, math.ceil(seconds)))}
            status = 429 if isinstance(result, _ClientLimited) else 503
            return self._http_error(status, result.message or "try again later", ctype, headers)
        if result.outcome is Outcome.PERMANENT:
            return self._http_error(400, result.message or "rejected", ctype)
        response = ExportTraceServiceResponse()
        if result.rejected_spans > 0:
            response.partial_success.rejected_spans = result.rejected_spans
            response.partial_success.error_message = result.message
        return web.Response(body=_encode(response, ctype), content_type=ctype)

    async def _read_body(self, http_request: web.Request, encoding: str) -> tuple[bytes, bytes | None]:
        """(the body, decompressed; the gzip'd bytes it came in as, or None when not gzip)."""
        compressed = encoding != "identity"
        # The compressed size may exceed the decompressed one a little (incompressible data).
        limit = self._max_body + self._max_body // 64 + 1024 if compressed else self._max_body
        try:
            raw = await read_body(http_request, limit=limit, timeout_s=self._body_timeout_s)
        except BodyRefused as refused:
            if refused.reason == "too_large":  # aiohttp then drains (lingers) so the client reads the answer
                raise _Rejected(413, "too_large", f"body larger than {self._max_body} bytes") from None
            self._warn("body_timeout", "OTLP/HTTP: a request body did not arrive within otlp.body_timeout_s "
                       "(%g s): answered 503 (retry) and closed (counted in kvmiss_otlp_requests_refused_total"
                       "{reason=\"body_timeout\"})", self._body_timeout_s)
            raise _Rejected(503, "body_timeout", str(refused), {"Retry-After": str(max(1, math.ceil(DEFAULT_RETRY_AFTER_S)))}) from None
        if not compressed:
            return raw, None
        inflate = _INFLATERS[encoding]
        if len(raw) > _THREAD_INFLATE_BYTES:  # zlib and zstd release the GIL: keep the loop serving
            body = await asyncio.to_thread(inflate, raw, self._max_body)
        else:
            body = inflate(raw, self._max_body)
        return body, raw if encoding == "gzip" else None

    def _decode(self, body: bytes, ctype: str) -> ExportTraceServiceRequest:
        try:
            if ctype == JSON:
                return parse_otlp_json(body)
            return ExportTraceServiceRequest.FromString(body)
        except (DecodeError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
            raise _Rejected(400, "malformed", f"cannot decode {ctype} body: {exc}") from None

    @staticmethod
    def _http_error(status: int, message: str, ctype: str, headers: dict | None = None) -> web.Response:
        code = {400: code_pb2.INVALID_ARGUMENT, 413: code_pb2.INVALID_ARGUMENT,
                429: code_pb2.RESOURCE_EXHAUSTED, 503: code_pb2.UNAVAILABLE}
        if ctype not in (PROTOBUF, JSON):  # cannot answer in a type we do not speak
            return web.Response(status=status, text=message, headers=headers)
        body = _encode(status_pb2.Status(code=code.get(status, code_pb2.INTERNAL), message=message), ctype)
        return web.Response(status=status, body=body, content_type=ctype, headers=headers)


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    """The OTLP/gRPC servicer; ``Export`` receives the raw request bytes (see `_start_grpc`)."""

    def __init__(self, receivers: Receivers) -> None:
        self._receivers = receivers

    async def Export(self, body: bytes, context: grpc.aio.ServicerContext) -> ExportTraceServiceResponse:  # noqa: N802
        receivers = self._receivers
        try:
            request = ExportTraceServiceRequest.FromString(body)
        except DecodeError as exc:
            receivers.stats["requests_malformed"] += 1
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"cannot decode ExportTraceServiceRequest: {exc}")
        result = await receivers._deliver(request, grpc_peer_host(context.peer()), body)
        if result is _INTERNAL:
            await context.abort(grpc.StatusCode.INTERNAL, result.message)
        if result.outcome is Outcome.RETRYABLE:
            seconds = result.retry_after_s if result.retry_after_s is not None else DEFAULT_RETRY_AFTER_S
            message = result.message or "try again later"
            trailer = ((_STATUS_DETAILS_KEY, retry_status_details(message, seconds)),)
            await context.abort(grpc.StatusCode.UNAVAILABLE, message, trailing_metadata=trailer)
        if result.outcome is Outcome.PERMANENT:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, result.message or "rejected")
        response = ExportTraceServiceResponse()
        if result.rejected_spans > 0:
            response.partial_success.rejected_spans = result.rejected_spans
            response.partial_success.error_message = result.message
        return response


def _check_fd_limit(max_connections: int, receivers: int) -> None:
    """Warn when the receivers at their connection cap would pass the soft file descriptor
    limit: the process would then run out of descriptors before the cap stops anyone."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = receivers * max_connections + 64  # plus the process's own files and sockets
    if max_connections and soft != resource.RLIM_INFINITY and needed > soft:
        log.warning("otlp.max_connections = %d per receiver needs about %d file descriptors, more than the "
                    "limit of %d: lower it or raise the limit (ulimit -n)", max_connections, needed, soft)


def _encode(message: Message, ctype: str) -> bytes:
    if ctype == JSON:
        return json_format.MessageToJson(message, indent=None).encode()
    return message.SerializeToString()


def _inflate_members(data: bytes, limit: int, name: str, decompressor: Callable[[], object],
                     error: type[Exception]) -> bytes:
    """Decompress a body of one or more concatenated members (gzip members, zstd frames)
    without ever holding more than ``limit`` + 1 decompressed bytes; raises `_Rejected` 413
    beyond it, 400 when corrupt or cut short."""
    out: list[bytes] = []
    total = 0
    try:
        while data:
            inflater = decompressor()
            chunk = inflater.decompress(data, limit - total + 1)  # +1: detects "over"
            total += len(chunk)
            if total > limit:
                raise _Rejected(413, "too_large", f"body larger than {limit} bytes after decompression")
            if not inflater.eof:
                raise _Rejected(400, "malformed", f"truncated {name} body")
            out.append(chunk)
            data = inflater.unused_data
    except error as exc:
        raise _Rejected(400, "malformed", f"corrupt {name} body: {exc}") from None
    return b"".join(out)


def _gunzip(data: bytes, limit: int) -> bytes:
    # wbits 31: the gzip header and trailer are required.
    return _inflate_members(data, limit, "gzip", lambda: zlib.decompressobj(wbits=31), zlib.error)


def _inflate(data: bytes, limit: int) -> bytes:
    """HTTP's ``deflate``: a zlib stream (RFC 9110; what the OpenTelemetry Python SDK and the
    Collector send, the Collector also as ``zlib``); a raw deflate stream, which some clients
    send under the same name, is read too."""
    zlib_header = len(data) >= 2 and data[0] & 0x0F == 8 and (data[0] << 8 | data[1]) % 31 == 0
    wbits = 15 if zlib_header else -15
    return _inflate_members(data, limit, "deflate", lambda: zlib.decompressobj(wbits=wbits), zlib.error)


def _unzstd(data: bytes, limit: int) -> bytes:
    return _inflate_members(data, limit, "zstd", zstd.ZstdDecompressor, zstd.ZstdError)


# Content-Encoding -> decompressor. The OpenTelemetry SDKs send gzip (Python also deflate);
# the Collector's otlphttp exporter gzip by default, zstd, deflate or zlib when configured
# (its snappy and lz4 are refused: 415 names what is taken).
_INFLATERS: dict[str, Callable[[bytes, int], bytes]] = {
    "gzip": _gunzip, "deflate": _inflate, "zlib": _inflate, "zstd": _unzstd}
_ENCODINGS_ACCEPTED = ", ".join(_INFLATERS) + " or identity"  # for the 415's message
