"""The enrichment pipeline: OTLP requests in, verdicts joined onto spans, OTLP requests out.

    receiver -> Pipeline.consume(request) -> [assemble by trace/request, bounded wait]
             -> [wait, bounded, until the fleet's history passes the lookup time]
             -> Attributor -> verdict attributes upserted on the outcome span
             -> the whole export request, raw inputs stripped -> exporter

A request that arrives with the protobuf bytes it was parsed from (OTLP/HTTP and gRPC
protobuf) is read by the compiled wire scanner and written as edits to those bytes
(`WireScanner`, `rewrite_request`, enricher/otlp/_otlpwire.c); anything the bytes path does not
take is read and written through the parsed message by the reference rules, with the same
result (tests/enricher/otlp/test_span_scan.py).

Every received span is exported exactly once, enriched or not: an export request is held
until every request whose outcome span it carries has been judged (or given up on, with
the honest unknown), then forwarded whole. Requests are judged in `poll(now)`, which the
service calls periodically on the event loop thread (the index's only thread), and with
``judge_on_arrival`` also in `consume`, as soon as the spans that complete them arrive (the
traces a request touched are assessed as `poll` would; a request still waiting for spans or
history is left to `poll`), so a request does not sit out a poll interval.

Backpressure: when held + queued spans would exceed ``max_pending_spans``, `consume`
answers RETRYABLE with a retry delay instead of buffering without bound.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import logging
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from kvmiss.enricher.core.attribution import Attributor
from kvmiss.enricher.core.hashing import BlockHasher
from kvmiss.enricher.core.history_reach import HistoryReach
from kvmiss.enricher.core.verdict import needs_index
from kvmiss.enricher.estimates.whatif import BEYOND, LADDER, eviction_estimate, ladder_label
from kvmiss.enricher.otlp.assembly import (
    WRITTEN,
    Assembly,
    Fragment,
    Judged,
    JudgedRequests,
    MissingFacts,
    incomplete_verdict,
    join_target,
    to_request_facts,
)
from kvmiss.enricher.otlp.interfaces import ACCEPTED, ConsumeResult, EncodedRequest, OtlpRequest, Outcome, span_count
from kvmiss.enricher.otlp.spans import (
    OUTPUT_NAMES,
    Marks,
    NotEncodable,
    SpanFacts,
    SpanReader,
    WireHit,
    WireScanner,
    delete_attributes,
    encode_attributes,
    rewrite_request,
    strip_marked,
    upsert_attributes,
    upsert_marked,
    verdict_attributes,
)
from kvmiss.schemas import span_attributes as names
from kvmiss.schemas.attribution import Label, RequestFacts, Verdict
from kvmiss.schemas.labels import UNKNOWN_LABELS

log = logging.getLogger("kvmiss.pipeline")

MAX_ROUTE_POLICIES = 16  # distinct routing-policy values kept as metric labels
MAX_UNSUBSCRIBED = 64  # span-named workers absent from [[workers]] remembered at once
FOLD_EVERY_S = 10.0  # how often counters of workers the index released are folded away


class ExportSink(Protocol):
    def has_capacity(self, spans: int) -> bool: ...
    def put(self, request: OtlpRequest, tag: object = None) -> bool: ...


class PendingBatch:
    """One received export request, held until its outcome spans are judged.

    Two ways to write it: into the parsed message (``body`` None), or -- when the request
    came with its bytes and the wire scanner read them -- as ``edits`` to those bytes, applied
    in C on release (`rewrite_request`): no upb write, no serializing. A write the bytes
    cannot take turns the batch into a message batch (`Pipeline._to_message`)."""

    __slots__ = ("request", "spans", "waiting", "carriers", "body", "edits", "tag")

    def __init__(self, request: ExportTraceServiceRequest, spans: int, body: bytes | None = None,
                 tag: object = None):
        self.request = request
        self.spans = spans
        self.tag = tag  # handed to the sink with the request (the span journal's record id)
        self.waiting = 0
        self.carriers: list[Fragment] = []  # spans with raw inputs, as fragments (with their marks)
        self.body = body
        # (resource, scope, span index, attribute positions to delete, Span.attributes bytes to append)
        self.edits: list[tuple[int, int, int, tuple[int, ...], bytes]] = []


WAIT_BUCKETS = (0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)  # seconds


class WaitHistogram:
    """Cumulative histogram of history waits: a fixed size whether or not anyone scrapes."""

    def __init__(self) -> None:
        self._per_bucket = [0] * len(WAIT_BUCKETS)  # the smallest bucket each value fits
        self.total = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.total += 1
        self.sum += value
        i = bisect.bisect_left(WAIT_BUCKETS, value)  # the first bound >= value
        if i < len(WAIT_BUCKETS) and value == value:  # (NaN fits no bucket)
            self._per_bucket[i] += 1

    @property
    def counts(self) -> list[int]:
        """Per bucket, how many values were <= its bound (Prometheus' cumulative buckets)."""
        return list(itertools.accumulate(self._per_bucket))


class PipelineStats:
    """Counters read at scrape time (names follow SPANS.md's metric list)."""

    def __init__(self) -> None:
        self.spans_in = 0
        self.spans_out = 0
        self.spans_refused = 0  # answered RETRYABLE (the sender keeps them)
        self.journal = None  # the service's SpanJournal, when it has one (read by the metrics)
        self.resent_spans = 0  # copies of an enriched span that came again: the same verdict written
        # Unknown verdicts held for a request that may confirm a store they rest on, and of
        # those, the ones judged again into a label.
        self.held_for_confirmation = 0
        self.settled_by_confirmation = 0
        # Output-named attributes a span came with, replaced by kvmiss's verdict: a sign that two
        # enrichers, or a client, write into kvmiss's namespace (or that enriched spans loop back).
        self.foreign_outputs = 0
        self.unsubscribed: dict[str, float] = {}  # span-named workers absent from [[workers]] (Pipeline)
        self.unenriched: collections.Counter[str] = collections.Counter()  # by reason
        self.bad_attributes: collections.Counter[str] = collections.Counter()  # by attribute name
        self.verdicts: collections.Counter[tuple[Label, str, str]] = collections.Counter()
        self.missed_tokens: collections.Counter[tuple[Label, str, str]] = collections.Counter()
        self.history_wait = WaitHistogram()  # seconds requests waited for their history
        # What-if estimates (never labels), by worker: missed tokens of `evicted` misses with
        # an estimate, and of those, the ones each ladder pool size would have kept cached.
        self.whatif_evicted_tokens: collections.Counter[str] = collections.Counter()
        self.whatif_kept_tokens: collections.Counter[tuple[str, str]] = collections.Counter()
        self.judged = None  # the pipeline's JudgedRequests (read by the metrics)


class Pipeline:
    """See the module docstring. Not thread-safe: the event loop thread owns it."""

    def __init__(
        self,
        attributor: Attributor,
        sink: ExportSink,
        *,
        reader: SpanReader | None = None,
        hasher: BlockHasher | None = None,
        default_block_size: int = 16,
        assemble_wait_s: float = 10.0,
        history_wait_s: float = 5.0,
        max_pending_spans: int = 200_000,
        keep_block_hashes: bool = False,
        on_verdict: Callable[[RequestFacts, Verdict, bytes], None] | None = None,
        clock: Callable[[], float],
        judge_on_arrival: bool = False,
        unsubscribed_keep_s: float = 600.0,
        pool_blocks: dict[str, int] | None = None,
        unhashable: Callable[[str | None], str | None] | None = None,
    ):
        self.attributor = attributor
        self.sink = sink
        self.reader = reader or SpanReader()
        self.hasher = hasher
        self.unhashable = unhashable  # worker -> why its engine's chain is not hashed from tokens
        self.default_block_size = default_block_size
        self.assemble_wait_s = assemble_wait_s
        self.history_wait_s = history_wait_s
        self.max_pending_spans = max_pending_spans
        self.keep_block_hashes = keep_block_hashes
        self.drop = self.reader.raw_names(keep_block_hashes=keep_block_hashes)
        self._wire = self.reader.wire_scanner(self.drop)  # None without the C extension
        self.on_verdict = on_verdict
        self.clock = clock
        self.judge_on_arrival = judge_on_arrival
        self.stats = PipelineStats()
        self._policies: set[str] = set()
        self.pending_spans = 0
        self._traces: dict[bytes, dict[str | None, Assembly]] = {}
        self._open: collections.deque[Assembly] = collections.deque()  # in arrival order
        self._ready: list[tuple[Assembly, RequestFacts, float]] = []  # waiting for history
        # Requests to judge now, with how long they waited: a round's re-announcements are all
        # noted before any of its requests is judged (`_judge_due`).
        self._due: list[tuple[Assembly, RequestFacts, float]] = []
        # Unknown verdicts a request not yet noted may settle (`Attributor.confirmation_may_settle`):
        # (assembly, facts, held since, waited for history, `Attributor.confirmed` when last
        # judged), judged again after a confirmation, settled as they are after assemble_wait_s.
        self._held: list[tuple[Assembly, RequestFacts, float, float, int]] = []
        self._reach: HistoryReach | None = None  # per poll: see `_history_reached`
        # So that a span arriving after its request was judged is not judged again: kept
        # while a partner may still come (the other side's spans up to assemble_wait_s late).
        self._judged = self.stats.judged = JudgedRequests(keep_s=2 * assemble_wait_s + history_wait_s)
        self._folded_at = 0.0  # see `_fold_released`
        # Workers spans name that the index does not follow -> when last named. The fleet is
        # larger than this replica's subscriptions: none of them can be ruled out as a holder
        # (`Attributor.unsubscribed`), until no span has named them for unsubscribed_keep_s.
        self.unsubscribed: dict[str, float] = self.stats.unsubscribed
        self.unsubscribed_keep_s = unsubscribed_keep_s
        # worker -> its engine's KV pool in blocks ([[workers]] pool_blocks): what-if estimates
        # on `evicted` misses where it is known.
        self.pool_blocks = {w: n for w, n in (pool_blocks or {}).items() if n > 1}
        attributor.unsubscribed = self.unsubscribed

    # --- intake ------------------------------------------------------------------------------

    async def consume(self, request: ExportTraceServiceRequest, body: bytes | None = None,
                      tag: object = None) -> ConsumeResult:
        """``body``: the bytes ``request`` was parsed from, unchanged since; with them the
        spans are read by the compiled wire scanner (one C pass, `WireScanner`). ``tag``
        goes to the sink with the request when it leaves (`ExportSink.put`)."""
        spans = span_count(request)
        # Every span held here goes to the sink later: reserve room for all of them, or a
        # held batch released into a full export queue would be dropped after its 200.
        if (self.pending_spans + spans > self.max_pending_spans
                or not self.sink.has_capacity(self.pending_spans + spans)):
            self.stats.spans_refused += spans
            return ConsumeResult(Outcome.RETRYABLE, message="kvmiss pending buffer is full",
                                 retry_after_s=1.0)
        self.stats.spans_in += spans
        hits = None if body is None or self._wire is None else self._wire.scan(body)
        batch = PendingBatch(request, spans, None if hits is None else body, tag)  # with it: written as edits to it
        now = self.clock()
        touched: dict[bytes, None] = {}  # trace ids this request fed, in arrival order
        if hits is None:
            self._take_spans(request, batch, now, touched)
        else:
            self._take_hits(request, hits, batch, now, touched)
        self.pending_spans += spans
        if batch.waiting == 0:
            self._release(batch)
        elif self.judge_on_arrival:
            self._assess_traces(touched, now)
        return ACCEPTED

    def _take_spans(self, request: ExportTraceServiceRequest, batch: PendingBatch, now: float,
                    touched: dict[bytes, None]) -> None:
        """Read every span of the parsed request (the reference scanner), holding those with facts."""
        reader = self.reader
        scan = reader.scanner(self.drop)  # one pass per span: facts + where raw inputs are
        bad: list[str] = []
        for resource_spans in request.resource_spans:
            instance = reader.instance_of(resource_spans.resource.attributes)
            worker = reader.worker_of(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans[:]:  # a slice: see `SpanReader.scanner`
                    found = scan(span, bad, worker)
                    if bad:
                        self._count_bad(bad)
                    if found is not None:
                        trace_id = self._take(span, found, batch, instance, now, span.trace_id)
                        if trace_id is not None:
                            touched[trace_id] = None

    def _take_hits(self, request: ExportTraceServiceRequest, hits: list[WireHit], batch: PendingBatch,
                   now: float, touched: dict[bytes, None]) -> None:
        """`_take_spans` from the wire scanner's hits, the fragments placed by position (the
        parsed span is looked up only for a hit without values: the reference scanner reads
        it)."""
        reader = self.reader
        found_of = WireScanner.found
        scan = None
        bad: list[str] = []
        at_resource = -1
        resources: Any = request.resource_spans
        for hit in hits:
            r = hit[0]
            if r != at_resource:
                resource = resources[r].resource
                instance = reader.instance_of(resource.attributes)
                worker = reader.worker_of(resource.attributes)
                at_resource = r
            span = None
            if hit[4] is None:  # a value the reference rules read
                if scan is None:
                    scan = reader.scanner(self.drop)
                span = _span_at(request, hit)
                found = scan(span, bad, worker)
                if bad:
                    self._count_bad(bad)
                if found is None:
                    continue
            else:
                found = found_of(hit, worker)
            trace_id = self._take(span, found, batch, instance, now, hit[3], hit[:3])
            if trace_id is not None:
                touched[trace_id] = None

    def _count_bad(self, bad: list[str]) -> None:
        for name in bad:
            self.stats.bad_attributes[name] += 1
        bad.clear()

    def _assess_traces(self, trace_ids: Iterable[bytes], now: float) -> None:
        """What `poll` would do now for these traces alone: only they changed. Their open
        assemblies are taken in arrival order, so earlier fragments join first, as in `poll`."""
        self._reach = None
        for trace_id in trace_ids:
            for assembly in list(self._traces.get(trace_id, {}).values()):
                if not assembly.done:
                    self._assess(assembly, now, final=False)
        self._judge_due(now, final=False)

    def _take(self, span: Any, found: tuple[SpanFacts | None, dict[str, Any] | None, Marks | None],
              batch: PendingBatch, instance: str | None, now: float, trace_id: bytes,
              at: tuple[int, int, int] | None = None) -> bytes | None:
        """Hold ``span`` (or the span at position ``at`` of the batch) as a fragment of its
        request (``found``: what the scanner found on it); its trace id, or None when it
        carries no facts. A span with raw inputs is kept with their marks, to be stripped on
        release."""
        facts, fields, marks = found
        if facts is None:
            if marks is not None and marks.raw:
                batch.carriers.append(Fragment(None, span, batch, instance, marks, at=at))  # type: ignore[arg-type]
            return None
        fragment = Fragment(facts, span, batch, instance, marks, fields, at)
        if marks is not None and marks.raw:
            batch.carriers.append(fragment)
        trace = self._traces.get(trace_id)
        if trace is None:
            trace = self._traces[trace_id] = {}
        request_id = facts.request_id
        assembly = trace.get(request_id)
        if assembly is None or (assembly.done and not assembly.awaiting_history):
            assembly = trace[request_id] = Assembly(trace_id, request_id, now)
            self._open.append(assembly)
        assembly.fragments.append(fragment)
        batch.waiting += 1
        return trace_id

    # --- judging -----------------------------------------------------------------------------

    def poll(self, now: float | None = None, *, final: bool = False) -> int:
        """Judge what can be judged; returns how many requests were. ``final``: stop waiting
        (shutdown) and judge everything with the evidence there is."""
        now = self.clock() if now is None else now
        judged = 0
        self._reach = None  # the index may have moved on since the last poll
        still_open: collections.deque[Assembly] = collections.deque()
        while self._open:
            assembly = self._open.popleft()
            if assembly.done:
                continue
            outcome = self._assess(assembly, now, final)
            if outcome is None:
                still_open.append(assembly)
            else:
                judged += outcome
        self._open = still_open
        waiting = []
        for assembly, facts, since in self._ready:
            if final or self._history_reached(facts) or now - since >= self.history_wait_s:
                self._due.append((assembly, facts, now - since))
            else:
                waiting.append((assembly, facts, since))
        self._ready = waiting
        judged += self._judge_due(now, final)
        self._judged.expire(now)
        if self.unsubscribed:
            tracked = self.attributor.index.tracked
            for worker, seen in list(self.unsubscribed.items()):
                if now - seen > self.unsubscribed_keep_s or worker in tracked:  # (or it joined)
                    del self.unsubscribed[worker]
        if now - self._folded_at >= FOLD_EVERY_S:
            self._folded_at = now
            self._fold_released()
        return judged

    def _fold_released(self) -> None:
        """Counters of workers the index no longer tracks (a departed worker released after
        retention) move to "untracked", where /metrics already shows them: with a fleet that
        changes, the ids ever seen would otherwise grow the counters for as long as kvmiss
        runs. Keys stay within labels x policies x (tracked workers + 2)."""
        tracked, stats = self.attributor.index.tracked, self.stats
        for key in [k for k in stats.verdicts if k[2] not in tracked and k[2] not in ("", "untracked")]:
            into = (key[0], key[1], "untracked")
            stats.verdicts[into] += stats.verdicts.pop(key)
            stats.missed_tokens[into] += stats.missed_tokens.pop(key, 0)

    def _assess(self, assembly: Assembly, now: float, final: bool) -> int | None:
        """Move an assembly on: None while it waits for more spans, else requests judged."""
        trace = self._traces.get(assembly.trace_id, {})
        target = join_target(assembly, trace)
        if target is not None:  # the trace's only request, or an engine lookup's request
            target.fragments.extend(assembly.fragments)
            assembly.done = True
            if trace.get(assembly.request_id) is assembly:
                del trace[assembly.request_id]
            return 0
        judged = self._judged.judged_request(assembly)
        if judged is not None:  # its request was judged before this span came
            self._late_spans(assembly, judged)
            return 0
        errors: list[str] = []
        expired = final or now - assembly.first_seen >= self.assemble_wait_s
        facts = to_request_facts(assembly, hasher=self.hasher, default_block_size=self.default_block_size,
                                 errors=errors, lookup_wanted=not expired, unhashable=self.unhashable)
        for name in errors:
            self.stats.bad_attributes[name] += 1
        if isinstance(facts, MissingFacts):
            if not expired:
                return None
            self._give_up(assembly, facts)
            return 0
        worker = facts.worker
        index = self.attributor.index
        awaited = tracked = worker is not None and worker in index.tracked
        if worker is not None and not tracked:
            membership = index.membership
            if not membership.dynamic:
                self._note_unsubscribed(worker, now)  # and judged at once: no history will come
            elif not membership.known_departed(worker):
                # A fleet that changes: a worker no source announced yet may be joining. It is
                # an unresolved holder meanwhile, and its own request waits for its history.
                self._note_unsubscribed(worker, now)
                awaited = True
        if not expired and assembly.awaits_request_span():
            return None  # an engine lookup waits (bounded) for its request's span
        if awaited and facts.lookup_time is not None and not self._history_reached(facts):
            # (`_history_reached` is True at once for a label that needs no index.)
            if not final:
                self._ready.append((assembly, facts, now))
                assembly.done = assembly.awaiting_history = True  # no longer open for other requests
                return 0
        self._due.append((assembly, facts, 0.0))  # judged by the caller, with the round's others
        assembly.done = assembly.awaiting_history = True
        return 0

    def _note_unsubscribed(self, worker: str, now: float) -> None:
        """A span named a worker this replica does not subscribe to: from now on it is an
        unresolved holder for every request (logged once per name, names bounded)."""
        known = self.unsubscribed
        if worker not in known:
            if len(known) >= MAX_UNSUBSCRIBED:
                worker = min(known, key=known.__getitem__)  # refresh the oldest: still one unresolved
            elif self.attributor.index.membership.dynamic:
                log.warning("spans name worker %r, which no membership source has announced: it cannot be "
                            "ruled out as a holder until it joins (its own requests wait for it), or until "
                            "no span names it for %.0f s", worker[:64], self.unsubscribed_keep_s)
            else:
                log.warning("spans name worker %r, which no [[workers]] entry subscribes to: it cannot be "
                            "ruled out as a holder, so misses below routing_miss are unknown_history until "
                            "no span names it for %.0f s (subscribe every replica to the whole fleet)",
                            worker[:64], self.unsubscribed_keep_s)
        known[worker] = now

    def _history_reached(self, facts: RequestFacts) -> bool:
        """Whether waiting longer could not change the evidence (`HistoryReach.reached`); a
        request that missed nothing reusable needs no fleet view. The index is read once per
        round (``_reach``, dropped whenever it may have moved on)."""
        if not needs_index(facts.prompt_tokens, facts.cached_tokens, facts.block_size, facts.transfers):
            return True  # hit, lookup_limit, or proven by its own spans: no index needed
        t = facts.lookup_time
        if t is not None and facts.lookup_time_latest is not None and facts.lookup_time_latest > t:
            t = facts.lookup_time_latest  # the verdict must hold at every step up to it
        if self._reach is None:
            self._reach = HistoryReach(self.attributor.index, now=self.clock(), wait_s=self.history_wait_s)
        return self._reach.reached(facts.worker, t)

    def _judge_due(self, now: float, final: bool) -> int:
        """Judge the round's due requests; returns how many verdicts were settled. Every one's
        re-announcements are noted first: a verdict may rest on a store with no parent that
        another request of the round re-announced (concurrent requests' spans come together).
        An unknown verdict such a request may still settle is held: judged again after a
        later request confirmed a store, settled as it is after assemble_wait_s (that
        request's spans come within it, or never)."""
        due, self._due = self._due, []
        attributor = self.attributor
        for _, facts, _ in due:
            attributor.note_re_announcements(facts)
        settled = 0
        for assembly, facts, waited in due:
            verdict = attributor.judge(facts)
            if not final and attributor.confirmation_may_settle(verdict):
                self._held.append((assembly, facts, now, waited, attributor.confirmed))
                self.stats.held_for_confirmation += 1
            else:
                self._judge(assembly, facts, waited=waited, verdict=verdict)
                settled += 1
        if self._held:
            settled += self._judge_held(now, final)
        return settled

    def _judge_held(self, now: float, final: bool) -> int:
        """The held verdicts (`_judge_due`) judged again after a confirmation; returns how
        many were settled."""
        generation = self.attributor.confirmed
        still: list[tuple[Assembly, RequestFacts, float, float, int]] = []
        settled = 0
        for assembly, facts, since, waited, seen in self._held:
            expired = final or now - since >= self.assemble_wait_s
            if seen == generation and not expired:
                still.append((assembly, facts, since, waited, seen))
                continue
            verdict = self.attributor.judge(facts) if seen != generation else None
            if verdict is not None and not expired and self.attributor.confirmation_may_settle(verdict):
                still.append((assembly, facts, since, waited, generation))
                continue
            if verdict is not None and verdict.label not in UNKNOWN_LABELS:
                self.stats.settled_by_confirmation += 1
            self._judge(assembly, facts, waited=waited, verdict=verdict)
            settled += 1
        self._held = still
        return settled

    def _judge(self, assembly: Assembly, facts: RequestFacts, *, waited: float,
               verdict: Verdict | None = None) -> None:
        index = self.attributor.index
        if facts.worker is not None and facts.lookup_time is not None and index.membership.spans:
            band = index.membership.band_s
            lag = index.router_chose(facts.worker, facts.lookup_time)
            if lag is not None:
                log.warning("the router chose worker %r %.2f s after its departure, beyond the membership band of "
                            "%.2f s: the band is now %.2f s ([fleet] membership_uncertainty_s should cover the "
                            "router's lag behind the membership source)", facts.worker, lag, band, index.membership.band_s)
        if verdict is None:  # (its re-announcements were noted: `_judge_due`)
            verdict = self.attributor.judge(facts)
        values = verdict_attributes(verdict, facts.lookup_time)
        if verdict.label is Label.EVICTED and self.pool_blocks:
            self._estimate(facts, verdict, values)
        self._settle(assembly, values)
        key = self.metric_key(facts, verdict)
        self.stats.verdicts[key] += 1
        self.stats.missed_tokens[key] += verdict.missed_tokens
        self.stats.history_wait.observe(waited)
        if self.on_verdict is not None:
            self.on_verdict(facts, verdict, assembly.trace_id)
        self._finish(assembly)

    def _estimate(self, facts: RequestFacts, verdict: Verdict, values: dict[str, Any]) -> None:
        """What-if for an `evicted` miss (enricher/estimates/whatif.py): on the span beside the
        verdict, and into the per-worker counters. Never changes the verdict."""
        worker = facts.worker
        pool = self.pool_blocks.get(worker or "")
        if pool is None:
            return
        index = self.attributor.index
        view = index.view_of(worker, verdict.epoch)
        estimate = None if view is None else eviction_estimate(
            view, verdict.removed_seq, facts.lookup_time, index.tail_margin_s, pool)
        if estimate is None:
            return
        values[names.WHATIF_SCALE] = estimate.scale
        values[names.WHATIF_REUSE_DISTANCE] = estimate.reuse_distance_blocks
        stats = self.stats
        stats.whatif_evicted_tokens[worker] += verdict.missed_tokens
        if estimate.scale != BEYOND:
            needed = float(estimate.scale)
            for scale in LADDER:
                if scale >= needed:
                    stats.whatif_kept_tokens[(worker, ladder_label(scale))] += verdict.missed_tokens

    def metric_key(self, facts: RequestFacts, verdict: Verdict) -> tuple[Label, str, str]:
        """(label, routing policy, worker) for counters. Both names come from spans, so both
        are bounded here: workers to the tracked fleet ("untracked" otherwise), policies to
        the first `MAX_ROUTE_POLICIES` seen ("other" after) -- memory and metric series."""
        worker = facts.worker or ""
        if worker and worker not in self.attributor.index.tracked:
            worker = "untracked"
        policy = facts.route_policy or ""
        if policy and policy not in self._policies:
            if len(self._policies) >= MAX_ROUTE_POLICIES:
                policy = "other"
            else:
                self._policies.add(policy)
        return verdict.label, policy, worker

    def _give_up(self, assembly: Assembly, missing: MissingFacts) -> None:
        """Facts never completed: the outcome span still goes out, labelled with the honest
        unknown and what was missing."""
        self._settle(assembly, verdict_attributes(incomplete_verdict(missing)))
        self.stats.unenriched["facts_incomplete"] += 1
        self._finish(assembly)

    def _settle(self, assembly: Assembly, values: dict[str, Any]) -> None:
        """Write the request's verdict on its outcome span, and remember it: whatever span of
        the request comes later is bound by it (`_late_spans`)."""
        fragment = assembly.outcome_fragment()
        self._write(fragment, values)
        self._judged.add(assembly, self._span(fragment).span_id, values, self.clock())

    def _late_spans(self, assembly: Assembly, judged: Judged) -> None:
        """Spans of a request judged before they came: a copy of the verdict's own span (a
        re-send) gets the same verdict again; any other passes through without one. What they
        say of the engine's earlier lookups still counts: the vLLM plugin's span of a request in
        full report mode, after the request was judged from its other spans, names the lookups
        before its admission, each of which re-announced its hit in its own step
        (`Attributor.note_re_announcements`; the admitted lookup's was weighed when judged)."""
        if any(f.facts.earlier_lookup_times_unix_nano for f in assembly.fragments):  # (rare: read only then)
            late = to_request_facts(assembly, hasher=None, default_block_size=self.default_block_size, errors=[])
            if isinstance(late, RequestFacts) and late.kv_cache_report_mode == "full":
                self.attributor.note_re_announcements(late, admitted=False)
        for fragment in assembly.fragments:
            if self._span(fragment).span_id == judged.span_id:
                self._write(fragment, dict(judged.verdict))
                self.stats.resent_spans += 1
            else:
                self.stats.unenriched["request_already_judged"] += 1
        self._judged.touch(assembly.trace_id, self.clock())
        self._finish(assembly)

    def _finish(self, assembly: Assembly) -> None:
        assembly.done = True
        trace = self._traces.get(assembly.trace_id)
        if trace is not None and trace.get(assembly.request_id) is assembly:
            del trace[assembly.request_id]
            if not trace:
                del self._traces[assembly.trace_id]
        for fragment in assembly.fragments:
            fragment.batch.waiting -= 1
            if fragment.batch.waiting == 0:
                self._release(fragment.batch)

    def _write(self, fragment: Fragment, values: dict[str, Any]) -> None:
        """Upsert ``values`` on the fragment's span and strip its raw inputs now (its facts
        are read), from its marks; a span written before is rescanned. In a batch written as
        edits to its bytes, the same as one edit (the marks name what to delete)."""
        batch = fragment.batch
        marks = fragment.marks
        if marks is not None and marks is not WRITTEN:
            self.stats.foreign_outputs += marks.foreign_outputs()  # replaced below, on either path
        if batch.body is not None:
            if marks is not WRITTEN and OUTPUT_NAMES.issuperset(values):
                try:
                    data = encode_attributes(values)
                except (NotEncodable, UnicodeError):
                    pass  # as the message would refuse it: there
                else:
                    deletes = () if marks is None else marks.positions(self.drop, verdict=True)
                    batch.edits.append((*fragment.at, deletes, data))
                    fragment.marks = WRITTEN
                    return
            self._to_message(batch)
        span = self._span(fragment)
        if fragment.marks is WRITTEN:
            upsert_attributes(span, values, drop=self.drop)
        else:
            upsert_marked(span, values, fragment.marks, self.drop)
            fragment.marks = WRITTEN

    def _release(self, batch: PendingBatch) -> None:
        drop = self.drop
        if batch.body is not None:
            strips = [(*fragment.at, fragment.marks.positions(drop), b"")
                      for fragment in batch.carriers  # every span with a raw input, marked by `_take`
                      if fragment.marks is not WRITTEN]  # (a written span was stripped then)
            # In wire order, one edit per span: a written span is never stripped again.
            try:
                body = rewrite_request(batch.body, sorted(batch.edits + strips))
            except ValueError:  # not expected (the bytes were scanned): the message path is the rule
                log.exception("rewriting a request's bytes failed; writing the parsed message instead")
                self._to_message(batch)
            else:
                batch.carriers.clear()
                self._hand_on(batch, EncodedRequest(body, batch.spans))
                return
        for fragment in batch.carriers:  # every span with a raw input, marked by `_take`
            if fragment.marks is not WRITTEN:  # (a written span was stripped then)
                strip_marked(self._span(fragment), fragment.marks, drop)
        batch.carriers.clear()  # fragments point back at the batch: no cycle left for the GC
        self._hand_on(batch, batch.request)

    def _hand_on(self, batch: PendingBatch, request: OtlpRequest) -> None:
        self.pending_spans -= batch.spans
        if self.sink.put(request, batch.tag):
            self.stats.spans_out += batch.spans
        else:
            self.stats.unenriched["export_refused"] += batch.spans
            log.warning("export queue refused %d spans", batch.spans)

    @staticmethod
    def _span(fragment: Fragment) -> Any:
        """The fragment's parsed span (looked up by position the first time it is needed)."""
        if fragment.span is None:
            fragment.span = _span_at(fragment.batch.request, fragment.at)
        return fragment.span

    def _to_message(self, batch: PendingBatch) -> None:
        """Apply the batch's edits to its parsed message and write it there from now on."""
        request = batch.request
        for r, s, i, deletes, data in batch.edits:
            span = _span_at(request, (r, s, i))
            delete_attributes(span.attributes, deletes)
            span.MergeFromString(data)
        batch.body = None
        batch.edits = []


def _span_at(request: ExportTraceServiceRequest, at: Any) -> Any:
    """The parsed span at (resource, scope, span index) of ``request``."""
    return request.resource_spans[at[0]].scope_spans[at[1]].spans[at[2]]
