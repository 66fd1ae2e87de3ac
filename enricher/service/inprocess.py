"""The in-process option: enrich a Python router's own spans inside the router, no OTLP hop.

`EnrichingSpanExporter` wraps the router's real exporter (OTLP, console, in-memory ...).
For every batch the SDK hands it, it reads the request facts from each finished span's
attributes with the span pipeline's own `SpanReader` (same names, `[attributes]` mapping and
value rules), assembles them with the pipeline's `Assembly` / `to_request_facts`, judges
them with an `Attributor` over the router's `ResidencyIndex`, and forwards *copies* of the
spans with the kvmiss outputs merged and raw inputs (``kvmiss.token_ids``,
``kvmiss.extra_keys``, by default ``kvmiss.block_hashes``) removed. Spans that need no
change are forwarded as they are.

Wiring, in the router process (index and fleet options as `kvmiss serve` sets them from
its config, enricher/service/serve.py)::

    index = ResidencyIndex([w.id for w in config.workers])
    enricher = EnrichingSpanExporter(OTLPSpanExporter(...), index, digest_key=key)
    subscriber = Subscriber(Fleet(config.workers, enricher.on_stream_action))
    subscriber.start()                                   # the collector's own thread
    provider.add_span_processor(BatchSpanProcessor(enricher))

History wait policy: **none**. The span pipeline (`kvmiss serve`) may hold a request up to
``history.wait_s`` until the chosen worker's events pass its lookup time; an exporter must
not block the SDK, so here every request is judged when its batch is exported, and one
whose worker's applied history is still behind the lookup time gets the honest
``unknown_history`` with ``kvmiss.history = lagging``. With a `BatchSpanProcessor` the
schedule delay (5 s by default) between a span's end and its export acts as that wait in
practice; a `SimpleSpanProcessor` exports at once and will see more ``lagging`` verdicts.
Likewise there is no assembly wait: spans of one request are joined only within one
exported batch, by the pipeline's own rule (`assembly.join_target`: a span without a request
id joins its trace's only request); a request whose counts are on no span of the batch gets
the pipeline's "request facts incomplete" unknown.

Copies: each changed span is rebuilt as a new ``ReadableSpan`` from public constructor
arguments (name, context, parent, resource, attributes, events, links, kind, status, times,
instrumentation scope). The SDK's dropped-attribute/event/link counts have no constructor
argument, so copies report 0 for them; originals are never mutated.

Failure policy: `export` never raises into the SDK. If enrichment fails for a batch, the
error is logged (with traceback once, then counted) and the spans go on unenriched, still
stripped of raw inputs; only if even that fails do the originals go on untouched. An
exception from the wrapped exporter is logged and answered FAILURE.

Thread contract: `export`, `force_flush` and `shutdown` may be called from any thread (the
batch processor's worker, or every thread that ends a span with a simple processor); one
lock serialises attribution. `on_stream_action` runs on the collector thread and only
appends to a deque: the index is mutated only under the lock, by whoever judges next (or
by the collector thread itself once ``MAX_UNDRAINED_BATCHES`` are waiting).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from kvmiss.collectors.continuity import StreamAction
from kvmiss.enricher.core.attribution import Attributor
from kvmiss.enricher.core.hashing import BlockHasher
from kvmiss.enricher.core.index import ResidencyIndex
from kvmiss.enricher.core.privacy import DigestKey
from kvmiss.enricher.otlp.assembly import (
    Assembly,
    Fragment,
    MissingFacts,
    incomplete_verdict,
    join_target,
    to_request_facts,
)
from kvmiss.enricher.otlp.spans import OUTPUT_NAMES, SpanReader, verdict_attributes
from kvmiss.enricher.service.handoff import IndexFeed
from kvmiss.schemas.attribution import RequestFacts, Verdict

log = logging.getLogger("kvmiss.inprocess")

# Applied batches queued for the index before the collector thread applies them itself
# (taking the lock): bounds the queue when no span is exported for a long while.
MAX_UNDRAINED_BATCHES = 10_000


class EnrichingSpanExporter(SpanExporter):
    """A `SpanExporter` that enriches, then hands copies to ``exporter``. See the module
    docstring for the wait, copy, failure and thread contracts.

    ``stats`` (a Counter, read at any time): ``spans_in``, ``spans_out``, ``verdicts``,
    ``facts_incomplete``, ``unenriched_error`` (spans passed on unenriched after an
    error), ``export_error``, ``already_shutdown``, ``bad_attribute:<name>``.
    """

    def __init__(
        self,
        exporter: SpanExporter,
        index: ResidencyIndex,
        *,
        digest_key: DigestKey | None = None,
        reader: SpanReader | None = None,
        hasher: BlockHasher | None = None,
        default_block_size: int = 16,
        keep_block_hashes: bool = False,
        aged_out_as_recent_match: bool = False,
        attributor: Attributor | None = None,
        on_verdict: Callable[[RequestFacts, Verdict, bytes], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.exporter = exporter
        self.index = index
        self.attributor = attributor or Attributor(index, digest_key,
                                                   aged_out_as_recent_match=aged_out_as_recent_match)
        self.reader = reader or SpanReader()
        self.hasher = hasher
        self.default_block_size = default_block_size
        self.drop = self.reader.raw_names(keep_block_hashes=keep_block_hashes)
        self.on_verdict = on_verdict
        self.clock = clock
        self.stats: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self.feed = IndexFeed(index, clock)
        self._logged_error = False
        self._shutdown = False

    # --- the collector side ------------------------------------------------------------------

    def on_stream_action(self, worker: str, action: StreamAction) -> None:
        """A `Fleet` sink (collector thread): queue applied batches and tail confirmations
        for the index, in order, as `kvmiss serve` does; log other stream facts."""
        if not self.feed.put(worker, action):
            log.info("worker %s: %s", worker, type(action).__name__)
            return
        if len(self.feed) > MAX_UNDRAINED_BATCHES:
            with self._lock:
                self.feed.drain()

    # --- SpanExporter ------------------------------------------------------------------------

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._shutdown:
            self.stats["already_shutdown"] += len(spans)
            return SpanExportResult.FAILURE
        self.stats["spans_in"] += len(spans)
        try:
            with self._lock:
                self.feed.drain()
                out = self._enriched(spans)
        except Exception:  # never into the SDK: pass on unenriched
            self._log_error("kvmiss enrichment failed; %d spans passed on unenriched", len(spans))
            self.stats["unenriched_error"] += len(spans)
            try:
                out = [self._copy(s, {}) for s in spans]
            except Exception:
                self._log_error("kvmiss could not strip raw inputs; %d spans passed on as they are", len(spans))
                out = list(spans)
        try:
            result = self.exporter.export(out)
        except Exception:
            log.exception("wrapped exporter %r raised", self.exporter)
            self.stats["export_error"] += len(spans)
            return SpanExportResult.FAILURE
        self.stats["spans_out"] += len(out)
        return result

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        with self._lock:
            self.feed.drain()
        return self.exporter.force_flush(timeout_millis)

    def shutdown(self) -> None:
        """Idempotent; later exports are refused and counted as ``already_shutdown``."""
        if self._shutdown:
            return
        self._shutdown = True
        self.exporter.shutdown()

    # --- enrichment --------------------------------------------------------------------------

    def _enriched(self, spans: Sequence[ReadableSpan]) -> list[ReadableSpan]:
        """Copies of ``spans`` with verdicts merged and raw inputs dropped. Caller holds the lock."""
        outputs: dict[int, dict[str, Any]] = {}
        for assembly in self._assemble(spans):
            errors: list[str] = []
            facts = to_request_facts(assembly, hasher=self.hasher,
                                     default_block_size=self.default_block_size, errors=errors)
            for name in errors:
                self.stats[f"bad_attribute:{name}"] += 1
            target = assembly.outcome_fragment().span  # an index into ``spans``
            if isinstance(facts, MissingFacts):
                outputs[target] = verdict_attributes(incomplete_verdict(facts))
                self.stats["facts_incomplete"] += 1
                continue
            verdict = self.attributor.attribute(facts)  # no wait: lagging history is judged as such
            outputs[target] = verdict_attributes(verdict, facts.lookup_time)
            self.stats["verdicts"] += 1
            if self.on_verdict is not None:
                self.on_verdict(facts, verdict, assembly.trace_id.to_bytes(16, "big"))
        drop = self.drop
        return [self._copy(s, outputs[i]) if i in outputs or not drop.isdisjoint(s.attributes) else s
                for i, s in enumerate(spans)]

    def _assemble(self, spans: Sequence[ReadableSpan]) -> list[Assembly]:
        """Group the batch's fact-carrying spans by (trace, request id), then join them with
        the pipeline's own rule (`assembly.join_target`): a span without a request id joins
        its trace's only request, an engine lookup the request its id extends."""
        now = self.clock()
        traces: dict[int, dict[str | None, Assembly]] = {}
        resources: dict[int, tuple[str | None, str | None]] = {}  # id(resource) -> (instance, worker)
        for i, span in enumerate(spans):
            resource = span.resource
            if id(resource) not in resources:
                attributes = resource.attributes
                resources[id(resource)] = (self.reader.instance_of_attributes(attributes),
                                           self.reader.worker_of_attributes(attributes))
            instance, worker = resources[id(resource)]
            bad: list[str] = []
            facts = self.reader.read_attributes(span.attributes, span.start_time, bad, name=span.name,
                                                resource_worker=worker, end_time_unix_nano=span.end_time)
            for name in bad:
                self.stats[f"bad_attribute:{name}"] += 1
            if facts is None:
                continue
            trace_id = span.context.trace_id
            trace = traces.setdefault(trace_id, {})
            assembly = trace.get(facts.request_id)
            if assembly is None:
                assembly = trace[facts.request_id] = Assembly(trace_id, facts.request_id, now)
            assembly.fragments.append(Fragment(facts, i, None, instance))
        out = []
        for trace in traces.values():
            for assembly in list(trace.values()):  # arrival order, as the pipeline's poll
                target = join_target(assembly, trace)
                if target is not None:
                    target.fragments.extend(assembly.fragments)
                    assembly.done = True
                    del trace[assembly.request_id]
            out.extend(trace.values())
        return out

    def _copy(self, span: ReadableSpan, outputs: Mapping[str, Any]) -> ReadableSpan:
        """A new span: ``span``'s attributes less raw inputs, with ``outputs`` upserted."""
        # A verdict replaces every output name the span had (`OUTPUT_NAMES`), not only its own.
        replaced = OUTPUT_NAMES if outputs else ()
        attributes = {k: v for k, v in span.attributes.items() if k not in self.drop and k not in replaced}
        attributes.update({k: tuple(v) if isinstance(v, list) else v for k, v in outputs.items()})
        return ReadableSpan(
            name=span.name, context=span.context, parent=span.parent, resource=span.resource,
            attributes=attributes, events=span.events, links=span.links, kind=span.kind,
            status=span.status, start_time=span.start_time, end_time=span.end_time,
            instrumentation_scope=span.instrumentation_scope,
        )

    def _log_error(self, message: str, *args: Any) -> None:
        if not self._logged_error:
            self._logged_error = True
            log.exception(message + " (logged once; counted in stats)", *args)
