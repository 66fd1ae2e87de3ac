"""kvmiss's vLLM plugin: one short span per prefix-cache lookup, in the request's own trace.

vLLM loads it in every one of its processes (entry point group ``vllm.general_plugins``, name
``kvmiss``; choose plugins with vLLM's ``VLLM_PLUGINS``, e.g. ``VLLM_PLUGINS=kvmiss`` or
``VLLM_PLUGINS=`` for none). Loading only wraps ``Scheduler.__init__``; the wrapper runs in the
engine-core process, where the scheduler lives, and wraps two methods of that scheduler's own
``KVCacheManager`` (instance attributes, not the class):

* ``get_computed_blocks(request)`` -- the prefix-cache lookup. The wrapper notes the wall-clock
  time around it and what the lookup found: request id, tokens at lookup, locally cached tokens,
  a reference to the request's block-hash list, the extra-key kinds (``lora``, ``mm``,
  ``cache_salt``, ``prompt_embeds``) and the ``trace_headers`` vLLM kept from the client's
  ``traceparent``. A request looked up again (not admitted in that step) is overwritten; in
  full report mode the earlier lookups that hit are kept on it (times and cached tokens): each
  re-announced its hit in its own step, which kvmiss must tell from a copy.
* ``allocate_slots(request, ...)`` -- admission. When it succeeds for a request with a noted
  lookup, that lookup is the one that decided the request's cached tokens: it goes into a
  bounded queue. Lookups after a preemption are not recorded (the request's reported cached
  tokens come from its first admission).

A daemon thread drains the queue every ``interval_s``, turns each record into a finished
``kvmiss.prefix_lookup`` span (an SDK ``ReadableSpan``; parent: the request's ``traceparent``;
start/end: the lookup's own clock readings) and hands it to the OTel SDK's
``BatchSpanProcessor``, which exports over OTLP to the endpoint vLLM traces to
(``--otlp-traces-endpoint``; protocol from ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``, ``grpc`` by
default, as vLLM does). Converting the chain to OTel ints, parsing ``traceparent``, encoding and
export never run on the scheduler thread (they do take the GIL: benchmarks/RESULTS.md).

The span's attributes are kvmiss's input names (shared/spec/SPANS.md), so ``kvmiss serve``
reads it like any other span. The worker id is a resource attribute set by standard OTel
configuration: ``OTEL_RESOURCE_ATTRIBUTES=kvmiss.worker=<id>``; ``{dp_rank}`` in the value is
replaced by the engine's data-parallel rank (``kvmiss.worker=pod-a-dp{dp_rank}``), because kvmiss
identifies a worker by endpoint + rank.

Never harm the engine: the wrappers do a few attribute reads and a dict store; any exception
inside them (or in the export thread) turns the plugin off with one log line and restores the
original methods; the pending table and the queue are bounded (the oldest entry is dropped and
counted); unsupported vLLM versions (outside 0.30-0.33) are refused at load with a clear message
(``KVMISS_VLLM_PLUGIN_ANY_VERSION=1`` overrides, at your own risk). Without an OTLP endpoint the
plugin stays off.

Imports only the standard library at load time; OpenTelemetry is imported when the engine core
attaches, vLLM only inside ``register()``.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import random
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from kvmiss.enricher.core.geometry import first_miss_index, lookup_limit_tokens  # stdlib-only, like this module

# A child of vLLM's logger: vLLM configures its handler, so lines appear in its log format.
log = logging.getLogger("vllm.plugins.kvmiss")

SPAN_NAME = "kvmiss.prefix_lookup"
SUPPORTED_MINORS = (30, 33)  # vLLM 0.30 through 0.33, inclusive
ANY_VERSION_ENV = "KVMISS_VLLM_PLUGIN_ANY_VERSION"
WORKER_RESOURCE_KEY = "kvmiss.worker"
DP_RANK_PLACEHOLDER = "{dp_rank}"

MAX_PENDING = 4096  # lookups not yet admitted (waiting requests); oldest dropped beyond
MAX_QUEUE = 16384  # admitted lookups not yet turned into spans; oldest dropped beyond
MAX_CHAIN_BLOCKS = 4096  # a longer chain is not attached (kvmiss then says it cannot see H)
MAX_EARLIER_LOOKUPS = 32  # a full-report request's re-announcing lookups before admission kept (the latest)
DEFAULT_INTERVAL_S = 0.25

# kvmiss's input attribute names (defaults of schemas/span_attributes.InputNames; a test keeps
# them equal). Spelled out here so that loading the plugin imports nothing beyond the stdlib.
ATTR_REQUEST_ID = "gen_ai.request.id"
ATTR_PROMPT_TOKENS = "gen_ai.usage.input_tokens"
ATTR_CACHED_TOKENS = "kvmiss.cached_tokens"
ATTR_BLOCK_SIZE = "kvmiss.block_size"
ATTR_REPORT_MODE = "kvmiss.kv_cache_report_mode"
ATTR_SKIP_READING = "kvmiss.skip_reading_prefix_cache"
ATTR_BLOCK_HASHES = "kvmiss.block_hashes"
ATTR_LOOKUP_TIME = "kvmiss.lookup_time_unix_nano"
ATTR_EARLIER_LOOKUP_TIMES = "kvmiss.earlier_lookup_times_unix_nano"
ATTR_EARLIER_LOOKUP_CACHED = "kvmiss.earlier_lookup_cached_tokens"
ATTR_EXTRA_KEY_KINDS = "kvmiss.extra_key_kinds"
ATTR_DP_RANK = "kvmiss.route.dp_rank"

_MASK64 = (1 << 64) - 1
_SIGN64 = 1 << 63


# --- records and their span attributes (pure) -----------------------------------------------


class LookupRecord(NamedTuple):
    """One prefix-cache lookup, as noted on the scheduler thread (cheap to build)."""

    request_id: str
    start_ns: int  # wall clock, just before the lookup
    end_ns: int  # wall clock, just after it
    num_tokens: int  # tokens the lookup saw (the prompt, at first scheduling)
    cached_tokens: int  # locally cached tokens it found
    block_hashes: Sequence[Any]  # the request's own hash list (append-only), read later
    extra_key_kinds: tuple[str, ...]
    trace_headers: Mapping[str, str] | None
    # vLLM's per-request `kv_cache_report_mode` ("full": the engine re-announces the chain the
    # request reused, which kvmiss must tell from a duplicate); None when the request has none.
    report_mode: str | None = None
    # vLLM's `skip_reading_prefix_cache` (a bool; None when the request has none).
    skip_reading: bool | None = None
    # A full-report request's lookups before this one that were not admitted and hit:
    # (start_ns, cached tokens). Each re-announced what it hit, in its own engine step.
    earlier: tuple[tuple[int, int], ...] = ()


def otel_int(block_hash: Any) -> int:
    """A block hash in the engines' external form (uint64 of the digest's last 8 bytes), as an
    OTel int: values >= 2^63 travel as their int64 two's complement."""
    if type(block_hash) is bytes:
        value = int.from_bytes(block_hash[-8:], "big")
    elif isinstance(block_hash, (bytes, bytearray, memoryview)):
        value = int.from_bytes(bytes(block_hash)[-8:], "big")
    else:
        value = int(block_hash) & _MASK64
    return value - (1 << 64) if value & _SIGN64 else value


def _report_mode(request: Any) -> str | None:
    """The request's `kv_cache_report_mode` when it is a short plain string (vLLM 0.32+)."""
    mode = getattr(request, "kv_cache_report_mode", None)
    return mode if isinstance(mode, str) and len(mode) <= 16 else None


def _skip_reading(request: Any) -> bool | None:
    """The request's `skip_reading_prefix_cache` when it is a bool (prompt logprobs set it)."""
    skip = getattr(request, "skip_reading_prefix_cache", None)
    return skip if type(skip) is bool else None


def lookup_attributes(record: LookupRecord, *, block_size: int, dp_rank: int | None) -> dict[str, Any]:
    """The span attributes of one lookup: kvmiss's input names. The chain runs up to and
    including the first missed block (``cached // block_size``). It is left out when nothing
    was missed (cached tokens at the lookup limit ``(N - 1) // B * B``: kvmiss needs no chain
    for ``hit`` / ``lookup_limit``) -- except in full report mode, where the chain the request
    hit is what tells the engine's re-announcement of it from a copy -- and when longer than
    ``MAX_CHAIN_BLOCKS``."""
    attrs: dict[str, Any] = {
        ATTR_REQUEST_ID: record.request_id,
        ATTR_PROMPT_TOKENS: record.num_tokens,
        ATTR_CACHED_TOKENS: record.cached_tokens,
        ATTR_BLOCK_SIZE: block_size,
        ATTR_LOOKUP_TIME: record.start_ns,
    }
    if dp_rank is not None:
        attrs[ATTR_DP_RANK] = dp_rank
    if record.report_mode is not None:
        attrs[ATTR_REPORT_MODE] = record.report_mode
    if record.skip_reading is not None:
        attrs[ATTR_SKIP_READING] = record.skip_reading
    if record.extra_key_kinds:
        attrs[ATTR_EXTRA_KEY_KINDS] = list(record.extra_key_kinds)
    if record.earlier:
        attrs[ATTR_EARLIER_LOOKUP_TIMES] = [start for start, _ in record.earlier]
        attrs[ATTR_EARLIER_LOOKUP_CACHED] = [cached for _, cached in record.earlier]
    if block_size > 0 and record.block_hashes is not None:
        wanted = first_miss_index(record.cached_tokens, block_size) + 1
        if record.cached_tokens >= lookup_limit_tokens(record.num_tokens, block_size):
            wanted = first_miss_index(record.cached_tokens, block_size) if record.report_mode == "full" else 0
        # the chains an earlier lookup re-announced are read from this one too
        wanted = max([wanted, *(first_miss_index(cached, block_size) for _, cached in record.earlier)])
        if 0 < wanted <= MAX_CHAIN_BLOCKS:
            chain = record.block_hashes[:wanted]  # atomic slice of an append-only list
            if chain:
                attrs[ATTR_BLOCK_HASHES] = [otel_int(h) for h in chain]
    return attrs


def extra_key_kinds(request: Any) -> tuple[str, ...]:
    """Which kinds of extra keys the request's block hashes carry (vLLM's order)."""
    kinds = ()
    if getattr(request, "lora_request", None) is not None:
        kinds += ("lora",)
    if getattr(request, "mm_features", None):
        kinds += ("mm",)
    if getattr(request, "cache_salt", None):
        kinds += ("cache_salt",)
    if getattr(request, "prompt_embeds", None) is not None:
        kinds += ("prompt_embeds",)
    return kinds


def parse_version(text: str) -> tuple[int, int] | None:
    match = re.match(r"^\s*v?(\d+)\.(\d+)", text or "")
    return (int(match[1]), int(match[2])) if match else None


def version_supported(text: str) -> bool:
    parsed = parse_version(text)
    return parsed is not None and parsed[0] == 0 and SUPPORTED_MINORS[0] <= parsed[1] <= SUPPORTED_MINORS[1]


def worker_id(template: str | None, dp_rank: int | None) -> str | None:
    if template is None:
        return None
    return template.replace(DP_RANK_PLACEHOLDER, str(dp_rank or 0))


# --- bounded queue ----------------------------------------------------------------------------


class RecordQueue:
    """A bounded FIFO between the scheduler thread and the export thread: appends never block;
    when full, the oldest record is dropped and counted. ``deque`` appends and pops are atomic
    under the GIL, so no lock is taken on the scheduler thread."""

    def __init__(self, maxlen: int = MAX_QUEUE):
        self._items: collections.deque[LookupRecord] = collections.deque(maxlen=maxlen)
        self.dropped = 0

    def put(self, record: LookupRecord) -> None:
        items = self._items
        if len(items) == items.maxlen:
            self.dropped += 1  # the deque drops the oldest on append
        items.append(record)

    def drain(self, limit: int | None = None) -> list[LookupRecord]:
        out = []
        items = self._items
        while items and (limit is None or len(out) < limit):
            try:
                out.append(items.popleft())
            except IndexError:  # emptied concurrently
                break
        return out

    def __len__(self) -> int:
        return len(self._items)


# --- the recorder: runs on the scheduler thread ------------------------------------------------


class Recorder:
    """Notes lookups and admissions; turns itself off (once, with one log line) on any error.

    ``wrap(manager)`` replaces the manager's ``get_computed_blocks`` / ``allocate_slots`` with
    wrappers (instance attributes); ``disable()`` puts the originals back. Without an
    ``allocate_slots`` (a vLLM that renamed it) every lookup is queued as it happens."""

    def __init__(self, queue: RecordQueue, *, max_pending: int = MAX_PENDING,
                 clock_ns: Callable[[], int] = time.time_ns):
        self.queue = queue
        self.max_pending = max_pending
        self.clock_ns = clock_ns
        self.pending: dict[str, LookupRecord] = {}
        self.active = True
        self.pending_dropped = 0
        self.error: str | None = None
        self._restore: list[Callable[[], None]] = []

    # hot path ---------------------------------------------------------------------------------

    def note_lookup(self, request: Any, result: Any, start_ns: int, end_ns: int) -> None:
        if getattr(request, "num_preemptions", 0):
            return  # a re-lookup after preemption: the reported cached tokens are the first
        pending = self.pending
        prior = pending.get(request.request_id)  # looked up before and not admitted
        earlier = ()
        if prior is not None and prior.report_mode == "full":  # (its hit was re-announced)
            earlier = prior.earlier
            if prior.cached_tokens > 0:
                earlier = (*earlier[1 - MAX_EARLIER_LOOKUPS:], (prior.start_ns, prior.cached_tokens))
        record = LookupRecord(
            request.request_id, start_ns, end_ns, request.num_tokens, int(result[1]),
            request.block_hashes, extra_key_kinds(request), request.trace_headers,
            _report_mode(request), _skip_reading(request), earlier)
        pending[record.request_id] = record
        if len(pending) > self.max_pending:
            del pending[next(iter(pending))]
            self.pending_dropped += 1

    def note_admission(self, request: Any, allocated: Any) -> None:
        record = self.pending.pop(request.request_id, None)
        if record is None:
            return
        if allocated is not None:
            self.queue.put(record)
        elif record.report_mode == "full" and (record.cached_tokens > 0 or record.earlier):
            # not admitted, but its hit was re-announced: the next lookup carries it
            self.pending[request.request_id] = record

    # wiring ---------------------------------------------------------------------------------

    def wrap(self, manager: Any) -> None:
        lookup = manager.get_computed_blocks
        allocate = getattr(manager, "allocate_slots", None)
        clock_ns = self.clock_ns
        recorder = self

        @functools.wraps(lookup)
        def get_computed_blocks(request, *args, **kwargs):
            start = clock_ns()
            result = lookup(request, *args, **kwargs)
            if recorder.active:
                try:
                    recorder.note_lookup(request, result, start, clock_ns())
                    if allocate is None:
                        recorder.note_admission(request, True)
                except Exception as exc:  # noqa: BLE001 - never into the scheduler
                    recorder.disable(f"recording a lookup failed: {type(exc).__name__}: {exc}")
            return result

        manager.get_computed_blocks = get_computed_blocks
        self._restore.append(lambda: _unwrap(manager, "get_computed_blocks", get_computed_blocks))
        if allocate is not None:
            @functools.wraps(allocate)
            def allocate_slots(request, *args, **kwargs):
                allocated = allocate(request, *args, **kwargs)
                if recorder.pending and recorder.active:
                    try:
                        recorder.note_admission(request, allocated)
                    except Exception as exc:  # noqa: BLE001
                        recorder.disable(f"recording an admission failed: {type(exc).__name__}: {exc}")
                return allocated

            manager.allocate_slots = allocate_slots
            self._restore.append(lambda: _unwrap(manager, "allocate_slots", allocate_slots))

    def disable(self, reason: str) -> None:
        """Turn recording off for good: one log line, originals restored, state dropped."""
        if not self.active:
            return
        self.active = False
        self.error = reason
        self.pending.clear()
        for restore in self._restore:
            try:
                restore()
            except Exception:  # noqa: BLE001 - the flag alone already stops recording
                pass
        log.warning("kvmiss plugin disabled (the engine is unaffected): %s", reason)


def _unwrap(obj: Any, name: str, wrapper: Any) -> None:
    if obj.__dict__.get(name) is wrapper:
        del obj.__dict__[name]  # the class's method shows through again


# --- the export side: runs on its own thread ---------------------------------------------------


_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$")


def parse_traceparent(headers: Mapping[str, str] | None) -> tuple[int, int, int, str | None] | None:
    """(trace id, parent span id, trace flags, tracestate) from W3C trace-context headers, or
    None when absent or invalid (version ff, all-zero ids, wrong lengths)."""
    if not headers:
        return None
    value = headers.get("traceparent") or headers.get("Traceparent")
    match = _TRACEPARENT.match(value.strip().lower()) if isinstance(value, str) else None
    if match is None or match[1] == "ff" or (match[1] == "00" and match[5]):
        return None
    trace_id, span_id = int(match[2], 16), int(match[3], 16)
    if not trace_id or not span_id:
        return None
    state = headers.get("tracestate") or headers.get("Tracestate")
    return trace_id, span_id, int(match[4], 16), state if isinstance(state, str) and state else None


class SpanEmitter:
    """Drains a `RecordQueue` into finished OTel SDK spans on a daemon thread.

    Each record becomes a ``ReadableSpan`` (name `SPAN_NAME`, parent from ``traceparent``,
    start/end = the lookup's own clock readings) handed to ``processor.on_end`` -- in the engine
    a ``BatchSpanProcessor``, whose worker thread encodes and exports. Spans are built directly
    rather than through a tracer: the attribute values are known-good, and skipping the
    tracer's per-value validation and context machinery keeps the GIL time per lookup small. A
    request whose parent is not sampled (flags 00) gets no span, like vLLM's own. Lifecycle:
    ``start()``, ``force_flush(timeout)``, idempotent ``shutdown(timeout)``. An exception turns
    the recorder off (one log line)."""

    def __init__(self, queue: RecordQueue, recorder: Recorder, processor: Any, *, resource: Any,
                 block_size: int, dp_rank: int | None, interval_s: float = DEFAULT_INTERVAL_S):
        from opentelemetry.sdk.trace import ReadableSpan
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope
        from opentelemetry.trace import SpanContext, SpanKind, TraceFlags
        from opentelemetry.trace.span import TraceState

        self._readable, self._context, self._flags, self._state = ReadableSpan, SpanContext, TraceFlags, TraceState
        self._kind = SpanKind.INTERNAL
        self._scope = InstrumentationScope("kvmiss.vllm_plugin")
        self.queue = queue
        self.recorder = recorder
        self.processor = processor
        self.resource = resource
        self.block_size = block_size
        self.dp_rank = dp_rank
        self.interval_s = interval_s
        self.emitted = 0
        self.unsampled = 0
        self._random = random.Random()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # one drainer at a time (thread vs force_flush)

    def start(self) -> SpanEmitter:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvmiss-plugin-export", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            if not self.emit_pending():
                return

    def emit_pending(self) -> bool:
        """Turn every queued record into a span; False once the plugin is off."""
        with self._lock:
            if not self.recorder.active:
                self.queue.drain()
                return False
            try:
                for record in self.queue.drain():
                    self._emit(record)
                return True
            except Exception as exc:  # noqa: BLE001
                self.recorder.disable(f"building a span failed: {type(exc).__name__}: {exc}")
                return False

    def _emit(self, record: LookupRecord) -> None:
        parent = parse_traceparent(record.trace_headers)
        getrandbits = self._random.getrandbits
        if parent is None:
            trace_id, flags, parent_context = getrandbits(128) or 1, 1, None
        else:
            trace_id, parent_id, flags, state = parent
            if not flags & 1:
                self.unsampled += 1
                return
            parent_context = self._context(trace_id, parent_id, is_remote=True, trace_flags=self._flags(flags),
                                           trace_state=self._state.from_header([state]) if state else None)
        context = self._context(trace_id, getrandbits(64) or 1, is_remote=False, trace_flags=self._flags(flags),
                                trace_state=parent_context.trace_state if parent_context else None)
        span = self._readable(
            SPAN_NAME, context=context, parent=parent_context, resource=self.resource, kind=self._kind,
            attributes=lookup_attributes(record, block_size=self.block_size, dp_rank=self.dp_rank),
            start_time=record.start_ns, end_time=max(record.end_ns, record.start_ns),
            instrumentation_scope=self._scope)
        self.processor.on_end(span)
        self.emitted += 1

    def force_flush(self, timeout: float = 5.0) -> bool:
        self.emit_pending()
        return bool(self.processor.force_flush(int(timeout * 1000)))

    def shutdown(self, timeout: float = 5.0) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self.emit_pending()
        try:
            self.processor.shutdown()
        except Exception:  # noqa: BLE001 - exit path
            pass


# --- attaching to a real engine ------------------------------------------------------------------


class Attachment(NamedTuple):
    recorder: Recorder
    emitter: SpanEmitter
    worker: str | None


_attachments: list[Attachment] = []
_registered = False


def make_processor(endpoint: str, *, dp_rank: int | None) -> tuple[Any, Any, str | None]:
    """A ``BatchSpanProcessor`` exporting over OTLP to ``endpoint`` (vLLM's global tracer
    provider is left alone), and the resource of the spans: standard OTel configuration
    (``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_SERVICE_NAME``; service name ``vllm`` when unset),
    ``{dp_rank}`` in ``kvmiss.worker`` replaced. Returns (processor, resource, worker id)."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    base = Resource.create({})
    extra: dict[str, Any] = {}
    if str(base.attributes.get("service.name", "")).startswith("unknown_service"):
        extra["service.name"] = "vllm"
    worker = worker_id(base.attributes.get(WORKER_RESOURCE_KEY), dp_rank)  # type: ignore[arg-type]
    if worker is not None:
        extra[WORKER_RESOURCE_KEY] = worker
    resource = base.merge(Resource(extra)) if extra else base
    return BatchSpanProcessor(_span_exporter(endpoint)), resource, worker


def _span_exporter(endpoint: str) -> Any:
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

        return Http(endpoint=endpoint)
    if protocol != "grpc":
        raise ValueError(f"unsupported OTEL_EXPORTER_OTLP_TRACES_PROTOCOL {protocol!r}")
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc

    return Grpc(endpoint=endpoint, insecure=not endpoint.startswith("https://"))


def attach(scheduler: Any, *, processor_factory: Callable[..., tuple[Any, Any, str | None]] = make_processor,
           interval_s: float = DEFAULT_INTERVAL_S) -> Attachment | None:
    """Start recording the lookups of one vLLM scheduler. Returns None (with one log line)
    when there is nothing to do: no OTLP endpoint, or prefix caching off."""
    config = scheduler.vllm_config
    endpoint = getattr(getattr(config, "observability_config", None), "otlp_traces_endpoint", None) \
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    if not endpoint:
        log.info("kvmiss plugin off: vLLM has no OTLP traces endpoint (--otlp-traces-endpoint)")
        return None
    if not getattr(getattr(config, "cache_config", None), "enable_prefix_caching", False):
        log.info("kvmiss plugin off: prefix caching is disabled")
        return None
    parallel = getattr(config, "parallel_config", None)
    dp_rank = getattr(parallel, "data_parallel_index", None)
    if dp_rank is None:
        dp_rank = getattr(parallel, "data_parallel_rank", None)
    block_size = int(getattr(scheduler, "hash_block_size", None) or scheduler.block_size)
    manager = scheduler.kv_cache_manager
    processor, resource, worker = processor_factory(endpoint, dp_rank=dp_rank)
    queue = RecordQueue()
    recorder = Recorder(queue)
    emitter = SpanEmitter(queue, recorder, processor, resource=resource, block_size=block_size,
                          dp_rank=dp_rank, interval_s=interval_s)
    recorder.wrap(manager)
    emitter.start()
    attachment = Attachment(recorder, emitter, worker)
    _attachments.append(attachment)
    if worker is None:
        log.warning("kvmiss plugin: no %s resource attribute; set OTEL_RESOURCE_ATTRIBUTES="
                    "%s=<worker id as in kvmiss.toml> so kvmiss knows which worker looked up",
                    WORKER_RESOURCE_KEY, WORKER_RESOURCE_KEY)
    log.info("kvmiss plugin: recording prefix-cache lookups (worker %s, dp rank %s, block size %d) "
             "as %s spans to %s", worker, dp_rank, block_size, SPAN_NAME, endpoint)
    return attachment


def _shutdown_all() -> None:
    for attachment in _attachments:
        attachment.emitter.shutdown(2.0)


def _patch_scheduler(cls: type) -> None:
    original = cls.__init__
    if getattr(original, "_kvmiss_wrapped", False):
        return

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if getattr(self, "_kvmiss_attached", False):
            return  # a subclass's __init__ already ran this wrapper
        self._kvmiss_attached = True
        try:
            attach(self)
        except Exception as exc:  # noqa: BLE001 - never stop the engine from starting
            log.warning("kvmiss plugin disabled (the engine is unaffected): attaching failed: %s: %s",
                        type(exc).__name__, exc)

    __init__._kvmiss_wrapped = True  # type: ignore[attr-defined]
    cls.__init__ = __init__


def register() -> None:
    """vLLM general-plugin entry point; runs in every vLLM process, more than once is fine."""
    global _registered
    if _registered:
        return
    _registered = True
    try:
        import vllm

        version = getattr(vllm, "__version__", "unknown")
        if not version_supported(version) and os.environ.get(ANY_VERSION_ENV) != "1":
            log.warning("kvmiss plugin off: vLLM %s is not supported (supported: 0.%d-0.%d; set %s=1 "
                        "to try anyway)", version, *SUPPORTED_MINORS, ANY_VERSION_ENV)
            return
        from vllm.v1.core.sched.scheduler import Scheduler

        _patch_scheduler(Scheduler)
        import atexit

        atexit.register(_shutdown_all)
    except Exception as exc:  # noqa: BLE001
        log.warning("kvmiss plugin off: loading failed: %s: %s", type(exc).__name__, exc)


__all__ = [
    "LookupRecord", "RecordQueue", "Recorder", "SpanEmitter", "attach", "extra_key_kinds",
    "lookup_attributes", "otel_int", "register", "version_supported",
]

