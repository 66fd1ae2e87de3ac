"""`kvmiss serve`: collectors, residency index, OTLP receivers, pipeline, exporters and
metrics in one process.

Threads: the ZeroMQ collector runs on its own thread (collectors/subscriber.py) and hands
applied batches and tail confirmations over, in order, through a lock-free deque;
everything else -- the index, the pipeline, the receivers, the export queues, the metrics
endpoint -- lives on one asyncio event loop, so the index has exactly one owner and needs
no lock.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from prometheus_client import CollectorRegistry

from kvmiss.collectors.continuity import Apply, Cursor, StreamAction, StreamConfig
from kvmiss.collectors.fleet import Fleet
from kvmiss.collectors.frames import READER_COMPILED
from kvmiss.collectors.membership import FleetMembers, build_sources
from kvmiss.collectors.membership_topics import Announcements, TopicScheme
from kvmiss.collectors.subscriber import Subscriber
from kvmiss.collectors.topic_feed import TopicFeed
from kvmiss.enricher.core.attribution import Attributor
from kvmiss.enricher.core.hashing import BlockHasher, HashingError
from kvmiss.enricher.core.index import ResidencyIndex
from kvmiss.enricher.core.privacy import DigestKey, load_digest_key
from kvmiss.enricher.otlp.exporter import ExportQueue, build_exporters
from kvmiss.enricher.otlp.interfaces import ConsumeResult, EncodedRequest, OtlpRequest, Outcome, span_count
from kvmiss.enricher.otlp.journal import SpanJournal
from kvmiss.enricher.otlp.receiver import Receivers
from kvmiss.enricher.otlp.spans import WIRE_SCAN, SpanReader
from kvmiss.enricher.service.fleet_watch import FleetStats, FleetWatch
from kvmiss.enricher.service.handoff import IndexFeed
from kvmiss.enricher.service.health_endpoint import HealthEndpoint
from kvmiss.enricher.service.metrics import KvmissCollector
from kvmiss.enricher.service.pipeline import Pipeline
from kvmiss.enricher.service.request_records import RequestRecords
from kvmiss.enricher.service.worker_watch import WorkerWatch
from kvmiss.schemas.attribution import ClockOffset, Label, RequestFacts, Verdict
from kvmiss.schemas.config import Config
from kvmiss.schemas.fleet import FleetChange, MemberState

log = logging.getLogger("kvmiss.serve")

TICK_S = 0.02  # how often applied batches are drained and pending requests judged
# The most one drain applies before the loop serves anything else (~7k batches of a burst).
DRAIN_BUDGET_S = 0.02
# Batches the collector may hand over ahead of the index; past it the collector thread waits,
# ZeroMQ's buffers fill and what a publisher then drops is a gap replay recovers.
MAX_UNDRAINED_BATCHES = 100_000
READY_GRACE_S = 30.0  # a stream recovering (replay) or verifying longer than this is not ready
# A member that has not connected this long after it joined (or start-up) shows as unreachable
# in kvmiss_fleet_workers, not joining.
JOIN_GRACE_S = 5.0


class FanOut:
    """The pipeline's export sink over one queue per exporter (network, file). With the span
    journal, a request is done (`SpanJournal.done`) when the first queue is finished with it;
    a request no queue takes is done at once (refused and counted by the queue)."""

    def __init__(self, queues: list[ExportQueue], journal: SpanJournal | None = None):
        self.queues = queues
        self.journal = journal
        self.discarded_spans = 0  # `[export] discard = true`: judged, counted, dropped
        if journal is not None and queues:
            queues[0].on_finished = lambda spans, tag: journal.done(tag)

    def has_capacity(self, spans: int) -> bool:
        return all(q.has_capacity(spans) for q in self.queues)

    def put(self, request: OtlpRequest, tag: object = None) -> bool:
        if not self.queues:
            self.discarded_spans += span_count(request)
            if self.journal is not None:
                self.journal.done(tag)
            return True  # nowhere to send, on purpose
        ok = True
        for queue in self.queues[1:]:
            if type(request) is EncodedRequest:  # immutable bytes: shared
                ok &= queue.put(request)
                continue
            copy = ExportTraceServiceRequest()
            copy.CopyFrom(request)
            ok &= queue.put(copy)
        primary = self.queues[0].put(request, tag=tag)
        if not primary and self.journal is not None:  # refused and counted by the queue
            self.journal.done(tag)
        return primary and ok


class Service:
    """One kvmiss process. `start()` binds everything; `shutdown()` flushes and stops."""

    def __init__(self, config: Config, *, clock: Callable[[], float] = time.time):
        self.config = config
        self.clock = clock
        self.announcements = (Announcements(config.fleet.topics.max_workers) if config.fleet.topics is not None
                              and config.fleet.topics.members == "announced" else None)
        # Membership that may change at run time ([fleet])
        sources = build_sources(config.fleet, self.announcements)
        self._build_proofs(config, bool(sources))
        self._build_streams(config, sources)
        self._build_pipeline(config)
        self.receivers = Receivers(config.otlp, self)  # self.consume: see there
        self._build_metrics(config)
        self._ticker: asyncio.Task | None = None
        self._stopping = False

    def _build_proofs(self, config: Config, watched: bool) -> None:
        """The residency index, the digest key, the clocks' bounds and the attributor."""
        history = config.history
        self.index = ResidencyIndex([w.id for w in config.workers],
                                    retention_s=history.retention_s,
                                    aged_out_horizon_s=history.aged_out_horizon_s,
                                    re_announcements=history.kv_cache_report_mode == "any",
                                    tail_margin_s=history.clock_skew_s + history.publish_delay_s,
                                    membership_uncertainty_s=config.fleet.membership_uncertainty_s,
                                    dynamic_membership=watched)
        if watched:
            self.index.membership.watched()  # changes known only as far as the sources were asked
        self.digest_key = self._digest_key()
        # The bound each worker's receive lag must keep for its timing to be trusted (see
        # `ClockOffset`): -skew .. skew + publish delay.
        self.clock_bounds = (-history.clock_skew_s, history.clock_skew_s + history.publish_delay_s)
        self._skewed: set[str] = set()  # workers last seen out of bound, for the log
        self._clocks: dict[str, ClockOffset] = {}  # worker -> its clock at the last lag seen
        # Each worker's clock for the judging round under way (`drain`): the fleet view asks
        # for every worker of every request, and the lags move far slower than a round.
        self._round_clocks: dict[str, ClockOffset] = {}
        self.attributor = Attributor(self.index, self.digest_key,
                                     aged_out_as_recent_match=config.history.aged_out_as_recent_match,
                                     clocks=self._round_clocks.get)
        # Filled on the collector thread, drained in order on the loop (the index's thread).
        self.feed = IndexFeed(self.index, self.clock)

    def _build_streams(self, config: Config, sources: list) -> None:
        """The collector (one stream per worker, the ZeroMQ subscriber) and the membership
        sources' watch."""
        history, clock = config.history, self.clock
        self.fleet = Fleet(config.workers, self._on_stream_action,
                           config=StreamConfig(tail_probe_interval_s=history.tail_probe_interval_s or None,
                                               clock_window_s=history.clock_skew_window_s),
                           max_tail_probes=history.tail_probes_in_flight)
        # [fleet.topics]: publishers that connect out to one bound SUB; with members =
        # "announced" the collector thread reports who spoke and a membership source hands it on.
        topics = config.fleet.topics
        self.topic_feed = (None if topics is None
                           else TopicFeed(TopicScheme(topics), self.fleet, self.announcements))
        self.subscriber = Subscriber(self.fleet, clock=clock,
                                     heartbeat_interval_s=config.collector.heartbeat_interval_s,
                                     heartbeat_timeout_s=config.collector.heartbeat_timeout_s,
                                     topics=self.topic_feed,
                                     linger_s=self.linger_s(config) if sources else 0.0)
        # Membership that changes at run time ([fleet]): sources polled on the loop, their
        # changes applied by `apply_fleet_change`.
        self.fleet_stats = FleetStats(self.index.membership)
        self.fleet_watch = FleetWatch(sources, FleetMembers(config.workers),
                                      self.apply_fleet_change, interval_s=config.fleet.poll_interval_s,
                                      clock=clock, stats=self.fleet_stats,
                                      seen_through=self.index.membership.seen_through)
        started = clock()
        self._member_since: dict[str, float] = {w.id: started for w in config.workers}  # loop thread
        self._departed: dict[str, float] = {}  # departed worker -> when, until retention passes
        # Joined worker -> when its change was seen, until its first batch is applied (popped
        # on the collector thread: `_on_stream_action`).
        self._awaiting_first: dict[str, float] = {}

    def _build_pipeline(self, config: Config) -> None:
        """Where the spans go: the export queues and journal, the request records, each
        member's stream health, and the pipeline that joins spans to verdicts."""
        clock = self.clock
        self.queues = [ExportQueue(e, max_spans=config.otlp.max_pending_spans)
                       for e in build_exporters(config.export)]
        self.journal = SpanJournal(config.export.journal, max_bytes=config.export.journal_max_bytes,
                                   sync_interval_s=config.export.journal_sync_interval_s) if config.export.journal else None
        export = config.export
        # One JSON line per judged request, written off the loop (`[export] request_records`).
        self.request_records = RequestRecords(export.request_records, max_bytes=export.request_records_max_bytes) \
            if export.request_records else None
        self.exemplars: dict[tuple[Label, str, str], str] = {}
        self._unsettled: dict[str, float] = {}  # worker -> since when recovering / verifying (`ready`)
        # Each member's stream connected or not, and why not (loop thread).
        self.worker_watch = WorkerWatch(
            specs=lambda: self.fleet.specs, connection=self.subscriber.connection, heard=self._heard,
            unopened=self.subscriber.unopened, member_since=self._member_since, departed=self._departed,
            clock=clock, grace_s=JOIN_GRACE_S)
        self.attributor.reach = self.worker_watch.status
        self.sink = FanOut(self.queues, self.journal)
        self.pipeline = Pipeline(
            self.attributor, self.sink, reader=SpanReader(config.attributes),
            hasher=self._hasher(), default_block_size=config.engine.block_size,
            assemble_wait_s=config.history.assemble_wait_s, history_wait_s=config.history.wait_s,
            max_pending_spans=config.otlp.max_pending_spans,
            keep_block_hashes=config.export.keep_block_hashes,
            on_verdict=self._on_verdict, clock=clock, judge_on_arrival=True,
            pool_blocks={w.id: w.pool_blocks for w in config.workers}, unhashable=self._unhashable)
        if not WIRE_SCAN:
            log.warning("!!! OTLP requests are read and written through parsed messages only: "
                        "enricher/otlp/_otlpwire.c was not built (no C compiler at install time, or "
                        "KVMISS_PURE_PYTHON_OTLP=1): several us more CPU per span (benchmarks/RESULTS.md). Reinstall kvmiss "
                        "with a C compiler present. !!!")
        if not READER_COMPILED:
            log.warning("!!! KV-event batches are decoded by the reference decoder only: collectors/_kvwire.c "
                        "was not built (no C compiler at install time, or KVMISS_PURE_PYTHON_INGEST=1): about "
                        "twice the CPU per event (benchmarks/RESULTS.md). Reinstall kvmiss with a C compiler present. !!!")

    def _build_metrics(self, config: Config) -> None:
        """/metrics, /healthz and /readyz, and the collector that reads every counter."""
        dns = next((s for s in self.fleet_watch.sources if s.name == "dns"), None)
        engines = next((s for s in self.fleet_watch.sources if s.name == "engines"), None)
        self.registry = CollectorRegistry()
        self.health = HealthEndpoint(self.registry, self.ready, self.worker_status)  # /metrics, /healthz, /readyz
        self.registry.register(KvmissCollector(
            self.pipeline.stats, lambda: self.fleet.streams,
            unknown_budget=config.metrics.unknown_budget, exemplars=self.exemplars,
            exports=lambda: self.queues, clock_bounds=self.clock_bounds, records=self.request_records,
            intake=lambda: {**self.receivers.stats, **self.receivers.gauges()},
            endpoint=self.health.counts, index_feed=lambda: (self.feed.applied, len(self.feed), self.index.stale_batches),
            index_anomalies=lambda: self.index.anomalies,
            fleet=(self.fleet_stats, self.member_states), recently_departed=lambda: self._departed,
            aged_out=lambda: (*self.index.aged_out_remembered(), self.index.aged_out_forgotten),
            dns_outcomes=None if dns is None else lambda: {o.value: n for o, n in dns.outcomes.items()},
            engine_answers=None if engines is None else engines.answers,
            topic_drops=None if self.topic_feed is None else lambda: dict(self.topic_feed.counts),
            unreachable=self.worker_watch.unreachable_by_cause,
            discarded=(lambda: self.sink.discarded_spans) if config.export.discard else None))

    # --- set-up ---------------------------------------------------------------------------

    def _digest_key(self) -> DigestKey:
        privacy = self.config.privacy
        if privacy.digest_key or privacy.digest_key_env:
            return load_digest_key(privacy.digest_key, privacy.digest_key_env)
        log.warning("no [privacy] digest key configured: using a random key for this process; "
                    "first-miss digests will not match across restarts or replicas")
        return DigestKey(secrets.token_bytes(32))

    def _hasher(self) -> BlockHasher | None:
        engine = self.config.engine
        try:
            return BlockHasher(engine.hash_algo, seed=engine.hash_seed, block_size=engine.block_size,
                               extra_keys_format=engine.extra_keys_format)
        except HashingError as exc:
            log.warning("kvmiss.token_ids cannot be hashed (%s); spans must carry kvmiss.block_hashes", exc)
            return None

    def _unhashable(self, worker: str | None) -> str | None:
        """Why ``worker``'s engine's chain cannot be hashed from token ids (its adapter's word)."""
        stream = self.fleet.streams.get(worker) if worker is not None else None
        return stream.adapter.token_hashing if stream is not None else None

    def _on_stream_action(self, worker: str, action: StreamAction) -> None:
        """Collector thread: batches and tail confirmations go to the loop (their ``at`` is
        this service's clock, the subscriber's); other stream facts are logged once each."""
        if self._awaiting_first and action.__class__ is Apply and worker in self._awaiting_first:
            since = self._awaiting_first.pop(worker, None)
            if since is not None:
                self.fleet_stats.first_batch.observe(max(0.0, self.clock() - since))
        if not self.feed.put(worker, action):
            log.info("worker %s: %s", worker, _describe(action))
        while len(self.feed) > MAX_UNDRAINED_BATCHES and not self._stopping:
            time.sleep(0.001)  # the index is behind: hold the sockets, not the memory

    def drain(self, budget_s: float | None = DRAIN_BUDGET_S) -> bool:
        """Before a judging round (a request received, a tick; shutdown: ``budget_s`` None):
        the index takes the batches the collector handed over, for at most ``budget_s`` (a
        burst's backlog is taken over several rounds), and each worker's clock is read once.
        True: the budget ran out with work left (`IndexFeed.drain`)."""
        behind = self.feed.drain(budget_s)
        clocks, changed = self._round_clocks, False
        for worker in self.fleet.streams:
            clock = self.worker_clock(worker)
            if clocks.get(worker) is not clock:
                changed = True
                if clock is None:
                    del clocks[worker]
                else:
                    clocks[worker] = clock
        if changed:
            self.attributor.clocks_changed()
        return behind

    def worker_clock(self, worker: str) -> ClockOffset | None:
        """A worker's engine clock against ours for a judging round (loop thread, `drain`):
        the sliding minimum of its live batches' receive lags, which the collector thread
        keeps in its stream health (one float, written whole), against `clock_bounds`. None
        until a live batch was received. A worker crossing the bound either way is logged once."""
        stream = self.fleet.streams.get(worker)
        lag = stream.health.receive_lag_min_s if stream is not None else None
        if lag is None:
            return None
        # Asked for every worker at every round, while the window's minimum changes rarely:
        # the same lag gives back the same ClockOffset, with nothing to log.
        known = self._clocks.get(worker)
        if known is not None and known.lag_s == lag:
            return known
        clock = self._clocks[worker] = ClockOffset(lag, *self.clock_bounds)
        if clock.within_bound == (worker in self._skewed):
            if clock.within_bound:
                self._skewed.discard(worker)
                log.warning("worker %s: engine clock back within the skew bound (receive lag %.3f s): "
                            "judged again", worker, lag)
            else:
                self._skewed.add(worker)
                log.warning("worker %s: engine clock beyond the skew bound (receive lag %.3f s, "
                            "bound %.3f..%.3f s): verdicts relying on its timing are unknown_history",
                            worker, lag, *self.clock_bounds)
        return clock

    def _on_verdict(self, facts: RequestFacts, verdict: Verdict, trace_id: bytes) -> None:
        exemplars = self.exemplars
        exemplars[self.pipeline.metric_key(facts, verdict)] = trace_id.hex()
        if len(exemplars) > len(self.pipeline.stats.verdicts):  # keys the pipeline folded away
            for key in [k for k in exemplars if k not in self.pipeline.stats.verdicts]:
                del exemplars[key]
        if self.request_records is not None:
            self.request_records.put(facts, trace_id)

    # --- a fleet that changes ---------------------------------------------------------------

    @staticmethod
    def linger_s(config: Config) -> float:
        """How long a departed worker's stream is still followed: through the membership band
        after its departure, plus the reach of a tail probe's proof behind its send time and
        one probe interval, so a draining engine's history covers every lookup of the band."""
        history = config.history
        return (config.fleet.membership_uncertainty_s + history.clock_skew_s + history.publish_delay_s
                + history.tail_probe_interval_s)

    def apply_fleet_change(self, change: FleetChange) -> None:
        """Loop thread: a membership change, to the index (who may have held a block when)
        and then to the collector (whose sockets to open and close). Logged once, ids only.

        The collector numbers a returning id's new stream past every epoch its old stream
        reached (`Fleet.remove`), so the index's views of it never continue across the gap."""
        if change.empty:
            return
        log.info("fleet %s: %d joined %s, %d departed %s", change.source, len(change.joined),
                 [spec.id for spec in change.joined], len(change.departed), list(change.departed))
        self.index.apply_fleet_change(change)
        now = self.clock()
        for worker in change.departed:
            self._departed[worker] = change.at
            self._member_since.pop(worker, None)
            self._awaiting_first.pop(worker, None)
            self._unsettled.pop(worker, None)
        for spec in change.joined:
            self._departed.pop(spec.id, None)
            self._member_since[spec.id] = now
            self._awaiting_first[spec.id] = change.at
            if spec.pool_blocks > 1:
                self.pipeline.pool_blocks[spec.id] = spec.pool_blocks
        self.fleet_stats.joins += len(change.joined)
        self.fleet_stats.departures += len(change.departed)
        self.subscriber.change_fleet(change)
        self._forget_departed(now)

    def _forget_departed(self, now: float) -> None:
        """Departed workers are shown (and their last clock kept for lookups before they
        left) for the index's retention; then forgotten, so churn does not grow memory."""
        horizon = now - self.config.history.retention_s
        for worker in [w for w, at in self._departed.items() if at < horizon]:
            del self._departed[worker]
            if worker not in self.fleet.streams:
                self._clocks.pop(worker, None)
                self._skewed.discard(worker)
                if self._round_clocks.pop(worker, None) is not None:
                    self.attributor.clocks_changed()

    def member_states(self) -> dict[MemberState, int]:
        """`kvmiss_fleet_workers{state}` at scrape time: each member following (connected:
        applied, or idle with nothing to apply), joining (connecting, or replaying its history
        before its first batch), unreachable (not connected within `JOIN_GRACE_S` of joining,
        disconnected, or its socket could not be opened); and departed within retention."""
        now = self.clock()
        self._forget_departed(now)
        counts = dict.fromkeys(MemberState, 0)
        for worker, stream in self.fleet.streams.items():
            if worker in self._departed:
                continue  # followed a little longer (`linger_s`), but departed
            connection = self.subscriber.connection(worker)
            if connection == "connected":
                first = stream.health.batches_applied == 0 and stream.cursor in (Cursor.RECOVERING, Cursor.VERIFYING)
                state = MemberState.JOINING if first else MemberState.FOLLOWING
            elif connection == "never" and now - self._member_since.get(worker, now) < JOIN_GRACE_S:
                state = MemberState.JOINING
            else:
                state = MemberState.UNREACHABLE
            counts[state] += 1
        counts[MemberState.DEPARTED] = len(self._departed)
        return counts

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        if self.request_records is not None:  # a path that cannot be opened stops start-up
            self.request_records.start()
        for queue in self.queues:
            open_file = getattr(queue.exporter, "open", None)
            if open_file is not None:  # export.file: a path that cannot be written stops start-up
                try:
                    open_file()
                except OSError as exc:
                    raise OSError(f"export.file: cannot write {queue.exporter.target}: {exc.strerror or exc}") from None
            await queue.start()
        await self.fleet_watch.poll_once()  # the sources' fleet from the first socket on
        self.subscriber.start()
        self.fleet_watch.start()
        self.worker_watch.start()
        self._ticker = asyncio.get_running_loop().create_task(self._tick_forever(), name="kvmiss-tick")
        if self.journal is not None:
            self.pipeline.stats.journal = self.journal
            if self.journal.recovered:
                await self._replay_journal()
            else:
                self.journal.forget_recovered()  # the previous run's segments held nothing live
        await self.receivers.start()
        if self.config.metrics.listen:
            await self.health.start(self.config.metrics.listen)
        log.info("kvmiss serving: %d workers, OTLP grpc=%s http=%s, metrics=%s",
                 len(self.fleet.specs), self.receivers.grpc_port, self.receivers.http_port,
                 self.metrics_port)

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop intake, judge everything still held with the evidence there is, flush the
        exporters, stop the collector. Idempotent."""
        if self._stopping:
            return
        self._stopping = True
        await self.receivers.shutdown(grace=min(5.0, timeout))
        await self.fleet_watch.shutdown()
        await self.worker_watch.shutdown()
        if self._ticker is not None:
            self._ticker.cancel()
        self.drain(None)
        self.pipeline.poll(final=True)
        if self.request_records is not None:
            await asyncio.to_thread(self.request_records.shutdown, timeout)  # writes what it holds
        for queue in self.queues:
            await queue.shutdown(timeout)
        self.subscriber.shutdown(timeout)
        if self.journal is not None:
            self.journal.close()
        await self.health.shutdown()

    @property
    def metrics_port(self) -> int | None:
        return self.health.port

    async def _tick_forever(self) -> None:
        records = self.request_records
        while True:
            behind = self.drain()
            self.pipeline.poll(self.clock())
            if records is not None:
                records.flush()  # this tick's records, encoded at once, to the writer thread
            # A backlog the drain's budget left: back at once, after whatever else is ready.
            await asyncio.sleep(0 if behind else TICK_S)

    async def consume(self, request: ExportTraceServiceRequest, body: bytes | None = None,
                      gzipped: bytes | None = None) -> ConsumeResult:
        """The receivers' consumer: the pipeline, which judges on arrival, after the index has
        taken every batch the collector handed over, so a request whose history is here does
        not wait for the next tick. With the span journal, the body is written first and the
        answer waits until it is durable: what kvmiss acknowledges survives a crash."""
        self.drain()
        journal = self.journal
        if journal is None:
            return await self.pipeline.consume(request, body)
        spans = span_count(request)
        if journal.full():
            journal.refused_full += 1
            self.pipeline.stats.spans_refused += spans
            return ConsumeResult(Outcome.RETRYABLE, message="kvmiss journal is full", retry_after_s=1.0)
        if gzipped is not None:  # a third of the bytes to write and sync
            rid = journal.append(gzipped, spans, gzipped=True)
        else:
            rid = journal.append(body if body is not None else request.SerializeToString(), spans)
        result = await self.pipeline.consume(request, body, tag=rid)
        if result.outcome is not Outcome.ACCEPTED:
            journal.done(rid)  # refused: the sender keeps it
            return result
        await journal.durable()
        return result

    async def _replay_journal(self) -> None:
        """Feed the previous run's accepted, unexported requests through the pipeline again,
        before the receivers open (journaled anew as they go; the old segments are removed
        after). The index is rebuilt from the engines' replay meanwhile: each request waits
        for its history as any other would, and is unknown where that history is gone."""
        journal = self.journal
        assert journal is not None
        bodies = journal.recovered
        for body in bodies:
            try:
                request = ExportTraceServiceRequest.FromString(body)
            except Exception:  # noqa: BLE001 - written by this code; a damaged body is skipped, counted
                journal.torn_records += 1
                continue
            rid = journal.append(body, span_count(request))
            while True:
                self.drain()
                result = await self.pipeline.consume(request, body, tag=rid)
                if result.outcome is Outcome.ACCEPTED:
                    break
                await asyncio.sleep(0.05)  # the pipeline is full: let the tick release some
        await journal.durable()
        journal.forget_recovered()
        log.info("journal: replayed %d requests (%d spans) from the previous run", len(bodies), journal.recovered_spans)

    # --- health and metrics ---------------------------------------------------------------

    def _heard(self, worker: str) -> bool:
        """Whether anything came from the worker's stream: a batch, or a tail probe's answer."""
        stream = self.fleet.streams.get(worker)
        return stream is not None and bool(stream.health.batches_applied or stream.health.tail_confirmations
                                           or stream.cursor is not Cursor.INITIAL)

    def worker_status(self) -> dict[str, dict]:
        """Each member's stream for /readyz and `kvmiss status`: endpoint, connection, since when,
        why not, and the stream's cursor (no secret: addresses and the system's error text)."""
        out = {}
        for worker, spec in self.fleet.specs.items():
            if worker in self._departed:
                continue
            stream, reach = self.fleet.streams.get(worker), self.worker_watch.status(worker)
            entry = {"endpoint": spec.sub_endpoint(), "replay_endpoint": spec.replay_address(),
                     "cursor": None if stream is None else ("quarantined" if stream.quarantined else stream.cursor.value),
                     "batches_applied": 0 if stream is None else stream.health.batches_applied}
            if reach is not None:
                entry.update(stream=reach.state.value, since=reach.since,
                             cause=None if reach.cause is None else reach.cause.value, detail=reach.detail or None)
            out[worker] = entry
        return out

    def ready(self) -> tuple[bool, dict[str, str]]:
        """Ready while the collector runs and the streams and the pipeline are healthy: every worker's stream is live,
        explicitly quarantined, or has published nothing yet (an idle engine publishes
        nothing: the normal case), or has been recovering or verifying for less than
        `READY_GRACE_S` (a replay is routine); and the pipeline and its export queues have
        room, so spans are not being refused. The answer's detail names each worker's state
        and ``pipeline: full`` when that is what is wrong."""
        now = self.clock()
        states, healthy = {}, True
        if not self.subscriber.alive:  # no event is applied any more: every answer would age
            states["collector"] = "stopped"
            healthy = False
        streams = self.fleet.streams  # replaced, never changed in place, by a fleet change
        for worker in [w for w in self._unsettled if w not in streams]:
            del self._unsettled[worker]  # departed: its state is nobody's readiness
        watch = self.worker_watch
        for worker, stream in streams.items():
            if worker in self._departed:
                continue  # a departed worker followed a little longer (`linger_s`)
            reach = watch.status(worker)
            if reach is not None and watch.past_grace(reach, now):
                states[worker] = reach.state.value
                continue
            state = "quarantined" if stream.quarantined else stream.cursor.name.lower()
            states[worker] = state
            if state in ("recovering", "verifying"):
                since = self._unsettled.setdefault(worker, now)
                healthy &= now - since < READY_GRACE_S
            else:
                self._unsettled.pop(worker, None)
        share, minimum = watch.connected_share(), self.config.metrics.ready_min_connected_share
        if share is not None and share < minimum:
            states["fleet"] = (f"{share:.0%} of the members' event streams connected, below "
                               f"metrics.ready_min_connected_share ({minimum:.0%})")
            healthy = False
        pipeline = self.pipeline
        room = pipeline.max_pending_spans - pipeline.pending_spans
        if room < pipeline.max_pending_spans // 10 or not pipeline.sink.has_capacity(pipeline.pending_spans):
            states["pipeline"] = "full"
            healthy = False
        return healthy, states


def _describe(action: StreamAction) -> str:
    """One log line's worth of a stream fact: enum values and sequence numbers only."""
    fields = {k: getattr(action, k) for k in action.__struct_fields__}
    parts = [f"{k}={getattr(v, 'value', v)}" for k, v in fields.items()]
    return f"{type(action).__name__} " + " ".join(parts)

