"""Metrics: a prometheus_client Collector that reads pipeline, stream and export state at
scrape time (nothing on the hot path but counter increments the pipeline already keeps).

Label rules (shared/spec/SPANS.md): only low-cardinality values — attribution label, owner,
worker (bounded by the configured fleet), routing policy, reasons from fixed enums. Never a
hash, digest, request id, trace id or tenant id as a label value; trace ids travel only as
exemplars (OpenMetrics exposition), which link a label's counter to one of its traces.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Iterator, Mapping

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.samples import Exemplar

from kvmiss.collectors.membership import RefusalReason
from kvmiss.collectors.stream import WorkerStream
from kvmiss.enricher.service.fleet_watch import FleetStats
from kvmiss.enricher.service.pipeline import MAX_ROUTE_POLICIES, WAIT_BUCKETS, PipelineStats
from kvmiss.enricher.service.request_records import RequestRecords
from kvmiss.schemas.attribution import ClockOffset, Label
from kvmiss.schemas.fleet import MemberState
from kvmiss.schemas.labels import LABELS, MISS_LABELS, UNKNOWN_LABELS

# Why an OTLP request was answered with an error before any of its spans was read (a fixed
# set: the receiver's ``requests_<reason>`` counters).
OTLP_REQUEST_REFUSALS = ("unsupported_media_type", "unsupported_encoding", "too_large", "malformed", "body_timeout")
DNS_OUTCOMES = ("addresses", "empty", "failed")  # collectors/membership_dns.py Outcome
TOPIC_DROPS = ("unmatched", "unlisted", "refused", "held_dropped")  # collectors/topic_feed.py
# Why a request record was not written (RequestRecords.dropped).
REQUEST_RECORD_DROPS = ("queue_full", "write_error", "shut_down")
# The same for the metrics endpoint, which serves GETs only.
ENDPOINT_REQUEST_REFUSALS = ("too_large", "body_timeout")


class KvmissCollector(Collector):
    """Builds every kvmiss metric family from live state when scraped."""

    def __init__(
        self,
        stats: PipelineStats,
        streams: Callable[[], dict[str, WorkerStream]],
        *,
        unknown_budget: float = 0.05,
        exemplars: dict[tuple[Label, str, str], str] | None = None,
        exports: Callable[[], list] = list,
        clock_bounds: tuple[float, float] | None = None,
        intake: Callable[[], Mapping[str, int]] = dict,
        endpoint: Callable[[], Mapping[str, int]] = dict,
        index_feed: Callable[[], tuple[int, int, int]] = lambda: (0, 0, 0),
        aged_out: Callable[[], tuple[int, int, int]] = lambda: (0, 0, 0),
        index_anomalies: Callable[[], Mapping[tuple[str, str], int]] = dict,
        records: RequestRecords | None = None,
        fleet: tuple[FleetStats, Callable[[], Mapping[MemberState, int]]] | None = None,
        recently_departed: Callable[[], Container[str]] = frozenset,
        dns_outcomes: Callable[[], Mapping[str, int]] | None = None,
        engine_answers: Callable[[], Mapping[tuple[str, str], int]] | None = None,
        topic_drops: Callable[[], Mapping[str, int]] | None = None,
        unreachable: Callable[[], Mapping[str, int]] | None = None,
        discarded: Callable[[], int] | None = None,
    ):
        self.unreachable = unreachable  # members not connected past their grace, by cause
        self.discarded = discarded  # `[export] discard = true`: spans dropped on purpose
        self.stats = stats
        self.clock_bounds = clock_bounds  # the receive-lag bound of `ClockOffset`, if checked
        self.streams = streams
        self.exports = exports  # the service's ExportQueues
        self.intake = intake  # the OTLP receivers' counters and gauges (receiver.Receivers)
        self.endpoint = endpoint  # the metrics listener's own counters (listener.HttpListener)
        self.index_feed = index_feed  # (batches applied to the index, waiting to be, refused as stale)
        self.aged_out = aged_out  # (blocks remembered, their bytes, blocks forgotten so far)
        self.index_anomalies = index_anomalies  # ResidencyIndex.anomalies: (name, worker) -> count
        self.records = records  # the request-records file writer, when [export] request_records is set
        self.fleet = fleet  # membership counters, and the members by state (Service.member_states)
        # Workers that left the fleet within retention: still label values, so requests they
        # served (judged after they left) are not counted as "untracked".
        self.recently_departed = recently_departed
        self.dns_outcomes = dns_outcomes  # [fleet.dns]: resolutions by outcome
        self.engine_answers = engine_answers  # [fleet.engines]: asks by (outcome, reason)
        self.topic_drops = topic_drops  # [fleet.topics]: messages not applied, by reason
        self.unknown_budget = unknown_budget
        self.exemplars = exemplars if exemplars is not None else {}

    def describe(self) -> Iterable[Metric]:
        return []  # unchecked collector: families depend on the fleet

    def collect(self) -> Iterator[Metric]:
        yield from self._verdicts()
        yield from self._streams()
        yield from self._index()
        yield from self._spans()
        yield from self._exports()
        yield from self._records()
        yield from self._endpoint()
        yield from self._fleet()

    def _fleet(self) -> Iterator[Metric]:
        """Membership ([fleet]): who is followed, and how changes went."""
        if self.fleet is None:
            return
        stats, states = self.fleet
        workers = GaugeMetricFamily(
            "kvmiss_fleet_workers", "Workers by membership state: following (connected and applied, or idle), "
            "joining (connecting, or replaying its history), unreachable (listed, not connected: an unresolved "
            "holder), departed (left the fleet, kept for lookups before it left until retention).", labels=["state"])
        counts = states()
        for state in MemberState:
            workers.add_metric([state.value], counts.get(state, 0))
        joins = CounterMetricFamily("kvmiss_fleet_joins", "Workers that joined the fleet at run time (membership sources).")
        joins.add_metric([], stats.joins)
        departures = CounterMetricFamily("kvmiss_fleet_departures", "Workers that departed the fleet at run time.")
        departures.add_metric([], stats.departures)
        refused = CounterMetricFamily(
            "kvmiss_fleet_updates_refused", "Membership updates refused, the last good fleet kept, by source and reason: "
            + ", ".join(r.value for r in RefusalReason) + ".", labels=["source", "reason"])
        for (source, reason), n in sorted(stats.refused.items()):
            refused.add_metric([source, reason], n)
        h = stats.first_batch
        first = HistogramMetricFamily("kvmiss_fleet_first_batch_seconds",
                                      "Seconds from a worker's join being seen to its first batch applied.")
        first.add_metric([], h.cumulative(), h.sum)
        yield from (workers, joins, departures, refused, first)
        if stats.membership is not None:
            band = GaugeMetricFamily(
                "kvmiss_fleet_membership_band_seconds", "The membership uncertainty band in force: "
                "[fleet] membership_uncertainty_s, or wider where the router chose a worker after it departed.")
            band.add_metric([], stats.membership.band_s)
            widened = CounterMetricFamily(
                "kvmiss_fleet_band_widened", "Times the router chose a worker later after its departure than the "
                "band allowed, and the band was widened to cover it (docs/FLEET.md).")
            widened.add_metric([], stats.membership.band_widened)
            yield from (band, widened)
        if self.dns_outcomes is not None:
            resolutions = CounterMetricFamily(
                "kvmiss_fleet_dns_resolutions", "[fleet.dns] resolutions by outcome: addresses, empty (NXDOMAIN "
                "or no records: the members depart after empty_grace_s), failed (no answer: nothing departs).",
                labels=["outcome"])
            outcomes = self.dns_outcomes()
            for outcome in DNS_OUTCOMES:
                resolutions.add_metric([outcome], outcomes.get(outcome, 0))
            yield resolutions
        if self.engine_answers is not None:
            answers = CounterMetricFamily(
                "kvmiss_fleet_engine_answers", "[fleet.engines] asks of /kv_event_sources by outcome: answered, "
                "failed (no answer: nothing departs), refused (an answer kvmiss cannot use, by reason).",
                labels=["outcome", "reason"])
            for (outcome, reason), n in sorted(self.engine_answers().items()):
                answers.add_metric([outcome, reason], n)
            yield answers
        if self.topic_drops is not None:
            dropped = CounterMetricFamily(
                "kvmiss_fleet_topic_messages_dropped", "[fleet.topics] messages not applied, by reason: unmatched (the "
                "topic does not fit topic_template), unlisted (members = \"listed\" and no source lists the worker), "
                "refused (beyond max_workers), held_dropped (held for a join beyond the bound, or for one never applied).",
                labels=["reason"])
            drops = self.topic_drops()
            for reason in TOPIC_DROPS:
                dropped.add_metric([reason], drops.get(reason, 0))
            yield dropped

    def _records(self) -> Iterator[Metric]:
        """The request-records file ([export] request_records): what was written, and what
        was not and why -- a full disk shows here, beside its one log line."""
        records = self.records
        if records is None:
            return
        written = CounterMetricFamily("kvmiss_request_records_written", "Request records written to "
                                      "[export] request_records (one per judged request).")
        written.add_metric([], records.written)
        dropped = CounterMetricFamily(
            "kvmiss_request_records_dropped", "Request records not written, by reason: queue_full (the writer "
            "fell behind), write_error (the file could not be written), shut_down.", labels=["reason"])
        for reason in REQUEST_RECORD_DROPS:
            dropped.add_metric([reason], records.dropped.get(reason, 0))
        rotations = CounterMetricFamily("kvmiss_request_records_rotations",
                                        "Times the file reached request_records_max_bytes and was renamed to <file>.old.")
        rotations.add_metric([], records.rotations)
        errors = CounterMetricFamily("kvmiss_request_records_write_errors",
                                     "Failed opens, writes or rotations of the request-records file.")
        errors.add_metric([], records.errors)
        queued = GaugeMetricFamily("kvmiss_request_records_queued", "Request records waiting for the writer thread.")
        queued.add_metric([], records.queued)
        yield from (written, dropped, rotations, errors, queued)

    def _exports(self) -> Iterator[Metric]:
        """What happened to spans after the pipeline, per exporter: handed to its queue,
        delivered (the downstream said yes), retried, dropped by reason. A downstream outage
        must show up here, not only in a log."""
        e, er = ["exporter"], ["exporter", "reason"]
        enqueued = CounterMetricFamily("kvmiss_export_spans_enqueued", "Spans handed to the exporter's queue.", labels=e)
        delivered = CounterMetricFamily("kvmiss_export_spans_delivered",
                                        "Spans the downstream accepted (moves only on delivery).", labels=e)
        retried = CounterMetricFamily("kvmiss_export_spans_retried", "Spans in export attempts that failed and were "
                                      "retried (a span retried twice counts twice).", labels=e)
        dropped = CounterMetricFamily(
            "kvmiss_export_spans_dropped", "Spans that will never be delivered, by reason: permanent (refused, or "
            "the file not writable), retries_exhausted, exporter_error, queue_full, already_shutdown, shutdown.",
            labels=er)
        retries = CounterMetricFamily("kvmiss_export_retries", "Export attempts after the first.", labels=e)
        queued = GaugeMetricFamily("kvmiss_export_queue_spans", "Spans waiting in the export queue.", labels=e)
        failing = GaugeMetricFamily("kvmiss_export_failing", "1 while the exporter's last attempt failed.", labels=e)
        for queue in self.exports():
            name = type(queue.exporter).__name__.removesuffix("Exporter").lower() or "exporter"
            enqueued.add_metric([name], queue.enqueued_spans)
            delivered.add_metric([name], queue.sent_spans)
            retried.add_metric([name], queue.retried_spans)
            for reason, n in sorted((*queue.failed_spans.items(), *queue.dropped_spans.items())):
                dropped.add_metric([name, reason], n)
            retries.add_metric([name], queue.retries)
            queued.add_metric([name], queue.queued_spans)
            failing.add_metric([name], int(queue.failing_since is not None))
        yield from (enqueued, delivered, retried, dropped, retries, queued, failing)
        if self.discarded is not None:
            discarded = CounterMetricFamily("kvmiss_spans_discarded", "Spans judged and dropped: [export] discard = true.")
            discarded.add_metric([], self.discarded())
            yield discarded
        if self.unreachable is not None:
            unreachable = GaugeMetricFamily(
                "kvmiss_workers_unreachable", "Members whose event stream is not connected past the grace, by cause "
                "(connection_refused, name_not_resolved, no_answer, no_handshake, socket_not_opened, "
                "no_publisher_connected, no_such_path, network_error).", labels=["cause"])
            for cause, n in sorted(self.unreachable().items()):
                unreachable.add_metric([cause], n)
            yield unreachable

    def _policy(self, policy: str, seen: list[str]) -> str:
        if policy in seen or len(seen) < MAX_ROUTE_POLICIES:
            if policy not in seen:
                seen.append(policy)
            return policy
        return "other"

    def _verdicts(self) -> Iterator[Metric]:
        names = ["label", "owner", "worker", "route_policy"]
        requests = CounterMetricFamily("kvmiss_requests", "Requests judged, by attribution label.", labels=names)
        tokens = CounterMetricFamily("kvmiss_missed_tokens", "Prompt tokens the cache could have saved (L - C), by label.", labels=names)
        policies: list[str] = []
        fleet, departed = self.streams(), self.recently_departed()
        folded: dict[tuple[str, ...], tuple[int, int, str | None]] = {}
        for (label, policy, worker), count in sorted(self.stats.verdicts.items()):
            # Worker ids come from spans: only members (and workers that left within retention)
            # are label values (a hostile or misconfigured sender must not grow the series).
            shown = worker if not worker or worker in fleet or worker in departed else "untracked"
            key = (label.value, LABELS[label].owner.value, shown, self._policy(policy, policies))
            n, t, ex = folded.get(key, (0, 0, None))
            folded[key] = (n + count, t + self.stats.missed_tokens[(label, policy, worker)],
                           ex or self.exemplars.get((label, policy, worker)))
        for key, (n, t, trace) in folded.items():
            exemplar = Exemplar({"trace_id": trace}, 1.0) if trace else None
            requests.add_metric(list(key), n, exemplar=exemplar)
            tokens.add_metric(list(key), t)
        yield requests
        yield tokens
        misses = sum(n for (label, _, _), n in self.stats.verdicts.items() if label in MISS_LABELS)
        unknown = sum(n for (label, _, _), n in self.stats.verdicts.items() if label in UNKNOWN_LABELS)
        share = GaugeMetricFamily("kvmiss_unknown_share", "Share of misses labelled unknown_*.")
        share.add_metric([], unknown / misses if misses else 0.0)
        yield share
        budget = GaugeMetricFamily("kvmiss_unknown_budget", "Configured budget for the unknown share.")
        budget.add_metric([], self.unknown_budget)
        yield budget

    def _streams(self) -> Iterator[Metric]:
        w = ["worker"]
        fams = {
            "applied": CounterMetricFamily("kvmiss_stream_batches_applied", "Batches applied, live or replayed.", labels=w),
            "gaps": CounterMetricFamily("kvmiss_stream_gaps", "Sequence gaps detected.", labels=w),
            "requested": CounterMetricFamily("kvmiss_stream_replays_requested", "Replay requests sent.", labels=w),
            "recovered": CounterMetricFamily("kvmiss_stream_replays_recovered", "Replays that filled their hole.", labels=w),
            "failed": CounterMetricFamily("kvmiss_stream_replays_failed", "Replays that ended with a hole written off.", labels=w),
            "unrecoverable": CounterMetricFamily("kvmiss_stream_unrecoverable_gaps", "Holes replay could not fill, by reason.", labels=["worker", "reason"]),
            "epochs": CounterMetricFamily("kvmiss_stream_epoch_changes", "Publisher restarts detected.", labels=w),
            "quarantine": CounterMetricFamily("kvmiss_stream_quarantine_seconds", "Seconds spent quarantined.", labels=w),
            "quarantined": GaugeMetricFamily("kvmiss_stream_quarantined", "1 while the worker is quarantined.", labels=w),
            "contiguous": GaugeMetricFamily("kvmiss_stream_last_contiguous_seq", "Last sequence applied with continuity.", labels=w),
            "oldest": GaugeMetricFamily("kvmiss_stream_oldest_replayable_seq", "First sequence of the latest replay reply.", labels=w),
            "peak": GaugeMetricFamily("kvmiss_stream_peak_batches_per_second", "Most batches in one second of engine time.", labels=w),
            "lag": GaugeMetricFamily("kvmiss_stream_receive_lag_seconds", "Receive time minus engine publish time of the last live batch: delivery delay plus clock skew.", labels=w),
            "lag_min": GaugeMetricFamily("kvmiss_stream_receive_lag_min_seconds", "Smallest receive lag of the recent live batches (history.clock_skew_window_s): the clock offset, kvmiss minus engine, plus the quickest delivery.", labels=w),
            "skewed": GaugeMetricFamily("kvmiss_stream_clock_out_of_bounds", "1 while the smallest receive lag is below -history.clock_skew_s or above clock_skew_s + publish_delay_s: verdicts relying on the worker's timing are unknown_history (clock skew).", labels=w),
            "tail_probes": CounterMetricFamily("kvmiss_stream_tail_probes", "Tail probes sent to a quiet worker's replay endpoint, retries included.", labels=w),
            "tail_confirmations": CounterMetricFamily("kvmiss_stream_tail_confirmations", "Tail probes that proved a worker idle since its last batch.", labels=w),
            "tail_recoveries": CounterMetricFamily("kvmiss_stream_tail_recoveries", "Tail probes that found batches lost live and applied them.", labels=w),
            "tail_unanswered": CounterMetricFamily("kvmiss_stream_tail_probes_unanswered", "Tail probes given up without an answer.", labels=w),
            "tail_deferred": CounterMetricFamily("kvmiss_stream_tail_probes_deferred", "Tail probes held back: the fleet had history.tail_probes_in_flight probes out already, or the worker's socket held messages not yet read.", labels=w),
        }
        for worker, stream in sorted(self.streams().items()):
            h = stream.health
            fams["applied"].add_metric([worker], h.batches_applied)
            fams["gaps"].add_metric([worker], h.gaps_detected)
            fams["requested"].add_metric([worker], h.replays_requested)
            fams["recovered"].add_metric([worker], h.replays_recovered)
            fams["failed"].add_metric([worker], h.replays_failed)
            for reason, n in sorted(h.unrecoverable_gaps.items(), key=lambda kv: kv[0].value):
                fams["unrecoverable"].add_metric([worker, reason.value], n)
            fams["epochs"].add_metric([worker], h.epoch_changes)
            fams["quarantine"].add_metric([worker], h.quarantine_s)
            fams["quarantined"].add_metric([worker], 1.0 if stream.quarantined else 0.0)
            if h.last_contiguous_seq is not None:
                fams["contiguous"].add_metric([worker], h.last_contiguous_seq)
            if h.oldest_replayable_seq is not None:
                fams["oldest"].add_metric([worker], h.oldest_replayable_seq)
            fams["peak"].add_metric([worker], h.peak_batches_per_s)
            if h.receive_lag_s is not None:
                fams["lag"].add_metric([worker], h.receive_lag_s)
            if h.receive_lag_min_s is not None:
                fams["lag_min"].add_metric([worker], h.receive_lag_min_s)
                if self.clock_bounds is not None:
                    within = ClockOffset(h.receive_lag_min_s, *self.clock_bounds).within_bound
                    fams["skewed"].add_metric([worker], 0.0 if within else 1.0)
            fams["tail_probes"].add_metric([worker], h.tail_probes)
            fams["tail_confirmations"].add_metric([worker], h.tail_confirmations)
            fams["tail_recoveries"].add_metric([worker], h.tail_recoveries)
            fams["tail_unanswered"].add_metric([worker], h.tail_probes_unanswered)
            fams["tail_deferred"].add_metric([worker], h.tail_probes_deferred)
        yield from fams.values()

    def _index(self) -> Iterator[Metric]:
        """The collector-to-index hand-over: a stream's batch counts as applied when the
        collector thread passes it on; these say when the index itself took it."""
        applied, pending, stale = self.index_feed()
        done = CounterMetricFamily("kvmiss_index_batches_applied", "Batches the residency index has applied, all workers.")
        done.add_metric([], applied)
        refused = CounterMetricFamily("kvmiss_index_stale_batches", "Batches the index refused: under an epoch "
                                      "below the one a rejoined or replaced worker must use, or of a worker released "
                                      "from the fleet (docs/HISTORY.md, Fleets that change). Never merged into a view.")
        refused.add_metric([], stale)
        waiting = GaugeMetricFamily("kvmiss_index_batches_pending",
                                    "Batches handed over by the collector and not yet applied to the index.")
        waiting.add_metric([], pending)
        remembered, filter_bytes, forgotten = self.aged_out()
        kept = GaugeMetricFamily("kvmiss_index_aged_out_remembered", "Blocks whose records retention dropped, "
                                 "remembered for [history] aged_out_horizon_s (a miss needing one is aged_out).")
        kept.add_metric([], remembered)
        size = GaugeMetricFamily("kvmiss_index_aged_out_bytes", "Bytes of the aged-out filters (bounded by the "
                                 "eviction rate times [history] aged_out_horizon_s).")
        size.add_metric([], filter_bytes)
        gone = CounterMetricFamily("kvmiss_index_aged_out_forgotten", "Aged-out blocks forgotten past [history] "
                                   "aged_out_horizon_s: absence is then proven over the remembered window only "
                                   "(no_match, kvmiss.window_start = horizon).")
        gone.add_metric([], forgotten)
        yield from (done, refused, waiting, kept, size, gone)
        families = {
            "re_announced_stores": CounterMetricFamily(
                "kvmiss_index_re_announced_stores", "BlockStored events with no parent whose last block was already "
                "resident: vLLM's kv_cache_report_mode full re-announcing a reused chain, or a recomputed duplicate, "
                "which looks the same on the wire. Never counted as copies; no residency claim rests on one.",
                labels=["worker"]),
            "re_announced_blocks": CounterMetricFamily(
                "kvmiss_index_re_announced_blocks", "Blocks in those stores.", labels=["worker"]),
            "re_announced_confirmed": CounterMetricFamily(
                "kvmiss_index_re_announced_confirmed", "Blocks of those stores a request that hit them in the same "
                "step showed to be its re-announcement (no copy): absence claims over them are made again.",
                labels=["worker"]),
            "uncounted_copies_removed": CounterMetricFamily(
                "kvmiss_index_uncounted_copies_removed", "Removals of a block whose only copy left was one of "
                "those stores: it was a real copy after all (a duplicate). Absence claims since it stay open.",
                labels=["worker"]),
            "events_refused_tiers": CounterMetricFamily(
                "kvmiss_index_events_refused", "Events naming a (medium, KV-cache group) past the 64 tables one "
                "engine lifetime may have (garbage that decoded): not applied; the worker's history is quarantined "
                "from that batch until a cache clear.", labels=["worker"]),
            "clock_steps_back": CounterMetricFamily(
                "kvmiss_index_clock_steps_back", "Batches stamped before the batch before them: the engine clock went "
                "back (a wall-clock step). Lookups at the readings it repeats cannot be ordered against that "
                "worker's events: unknown_history, reason clock step (docs/HISTORY.md, Clocks that go back).",
                labels=["worker"]),
            "stale_partial_stores": CounterMetricFamily(
                "kvmiss_index_stale_partial_stores", "Partial-block stores of a hash removed earlier in the epoch "
                "(vLLM #49125: a stale partial hash re-registered after its block's promotion): applied as new "
                "stores, never as the removed interval going on.", labels=["worker"]),
            "stores_without_hashes": CounterMetricFamily(
                "kvmiss_index_stores_without_hashes", "BlockStored events with no block hash (vLLM caching a range "
                "whose blocks are all null in a sliding-window or Mamba group sends its token ids only): nothing "
                "to hold or look up; skipped.",
                labels=["worker"]),
        }
        for (name, worker), n in sorted(self.index_anomalies().items()):
            family = families.get(name)
            if family is not None:
                family.add_metric([worker], n)
        yield from families.values()

    def _spans(self) -> Iterator[Metric]:
        s = self.stats
        received = CounterMetricFamily("kvmiss_spans_received", "Spans accepted from OTLP senders.")
        received.add_metric([], s.spans_in)
        exported = CounterMetricFamily("kvmiss_spans_handed_to_export",
                                       "Spans the pipeline passed on, enriched or not (delivery: kvmiss_export_spans_*).")
        exported.add_metric([], s.spans_out)
        intake = self.intake()
        refused = CounterMetricFamily(
            "kvmiss_spans_refused", "Spans refused with a retryable error, by reason: pending_full (backpressure), "
            "rate_limit ([otlp] max_spans_per_s), client_rate_limit (max_spans_per_s_per_client).", labels=["reason"])
        refused.add_metric(["pending_full"], s.spans_refused)
        refused.add_metric(["rate_limit"], intake.get("spans_refused_rate_limit", 0))
        refused.add_metric(["client_rate_limit"], intake.get("spans_refused_client_rate_limit", 0))
        journal = s.journal
        lost = CounterMetricFamily("kvmiss_journal_torn_records", "Journal records a crash cut short, found at start-up: "
                                   "the only requests an acknowledged crash can lose.")
        replayed = CounterMetricFamily("kvmiss_journal_replayed_spans", "Spans the previous run acknowledged and had not "
                                       "exported, replayed from the journal at start-up (at least once: a few may be duplicates).")
        refused_full = CounterMetricFamily("kvmiss_journal_refused", "Requests answered UNAVAILABLE / 503 because the journal "
                                           "reached [export] journal_max_bytes.")
        size = GaugeMetricFamily("kvmiss_journal_bytes", "Bytes of live journal segments.")
        bound = GaugeMetricFamily("kvmiss_journal_max_bytes", "[export] journal_max_bytes: beyond it requests are refused.")
        if journal is not None:
            lost.add_metric([], journal.torn_records)
            replayed.add_metric([], journal.recovered_spans)
            refused_full.add_metric([], journal.refused_full)
            size.add_metric([], journal.live_bytes)
            bound.add_metric([], journal.max_bytes)
        unenriched = CounterMetricFamily("kvmiss_requests_unenriched", "Requests passed on without a full judgement, by reason.", labels=["reason"])
        for reason, n in sorted(s.unenriched.items()):
            unenriched.add_metric([reason], n)
        bad = CounterMetricFamily("kvmiss_bad_attributes", "Input attributes with unusable values, by attribute name.", labels=["attribute"])
        for name, n in sorted(s.bad_attributes.items()):
            bad.add_metric([name], n)
        h = s.history_wait
        waits = HistogramMetricFamily("kvmiss_history_wait_seconds", "How long requests waited for their worker's events.")
        buckets = [(str(b), c) for b, c in zip(WAIT_BUCKETS, h.counts)] + [("+Inf", h.total)]
        waits.add_metric([], buckets, h.sum)
        resent = CounterMetricFamily("kvmiss_spans_resent", "Copies of an enriched span that came again (a re-send): given the request's judged verdict, not judged again.")
        resent.add_metric([], s.resent_spans)
        held_back = CounterMetricFamily(
            "kvmiss_verdicts_held_for_confirmation", "Unknown verdicts held (up to assemble_wait_s) because a store "
            "with no parent they rest on may be another request's re-announcement, whose spans had not come yet.")
        held_back.add_metric([], s.held_for_confirmation)
        settled = CounterMetricFamily(
            "kvmiss_verdicts_settled_by_confirmation", "Of those, the ones judged again into a label once that request "
            "was noted (docs/HISTORY.md, \"Counts\").")
        settled.add_metric([], s.settled_by_confirmation)
        foreign = CounterMetricFamily(
            "kvmiss_foreign_outputs_replaced", "Output-named kvmiss.* attributes spans came with, removed when kvmiss wrote "
            "its verdict: another enricher or a client writes into kvmiss's namespace, or enriched spans loop back.")
        foreign.add_metric([], s.foreign_outputs)
        unsubscribed = GaugeMetricFamily(
            "kvmiss_workers_unsubscribed", "Workers spans named recently that no [[workers]] entry subscribes to: "
            "while above 0, misses below routing_miss are unknown_history (they cannot be ruled out as holders).")
        unsubscribed.add_metric([], len(s.unsubscribed))
        held = GaugeMetricFamily("kvmiss_judged_traces", "Traces whose judged requests are remembered (bounded: "
                                 "a later span of a judged request is not judged again).")
        early = CounterMetricFamily(
            "kvmiss_judged_forgotten_early", "Judged requests forgotten before their keep time, by bound: traces "
            "(262,144 traces remembered at most) or per_trace (a trace's newest 64 requests).", labels=["bound"])
        if s.judged is not None:
            held.add_metric([], len(s.judged))
            early.add_metric(["traces"], s.judged.forgotten_early)
            early.add_metric(["per_trace"], s.judged.forgotten_in_trace)
        evicted = CounterMetricFamily(
            "kvmiss_whatif_evicted_tokens", "Missed tokens of evicted misses that got a what-if estimate "
            "(the worker's [[workers]] pool_blocks is known), by worker. An estimate, never a label.", labels=["worker"])
        for worker, n in sorted(s.whatif_evicted_tokens.items()):
            evicted.add_metric([worker], n)
        kept = CounterMetricFamily(
            "kvmiss_whatif_kept_tokens", "Of those, the missed tokens a pool of `scale` times the worker's would have "
            "kept cached (the first missed block survives), by worker and scale: what a larger cache would buy.",
            labels=["worker", "scale"])
        for (worker, scale), n in sorted(s.whatif_kept_tokens.items()):
            kept.add_metric([worker, scale], n)
        yield from (received, exported, refused, lost, replayed, refused_full, size, bound, unenriched, bad, waits, resent, foreign, unsubscribed,
                    held, early, evicted, kept, held_back, settled)
        yield from self._connections(intake)

    def _connections(self, intake: Mapping[str, int]) -> Iterator[Metric]:
        """OTLP intake limits that are not about spans. No peer address is ever a label:
        clients are counted, not named (the receiver logs a limited client once)."""
        refused = CounterMetricFamily("kvmiss_otlp_http_connections_refused",
                                      "OTLP/HTTP connections closed on arrival, by the cap that was reached: "
                                      "max_connections (all clients) or max_connections_per_client (one peer).",
                                      labels=["cap"])
        refused.add_metric(["max_connections"], intake.get("http_connections_refused", 0))
        refused.add_metric(["max_connections_per_client"], intake.get("http_connections_refused_per_client", 0))
        open_ = GaugeMetricFamily("kvmiss_otlp_http_connections", "Open OTLP/HTTP connections.")
        open_.add_metric([], intake.get("http_connections", 0))
        clients = GaugeMetricFamily("kvmiss_otlp_clients_tracked",
                                    "Clients (peer addresses) with a per-client rate bucket; bounded.")
        clients.add_metric([], intake.get("clients_tracked", 0))
        requests = CounterMetricFamily(
            "kvmiss_otlp_requests_refused", "OTLP requests answered with an error before any span was read, by "
            "reason: unsupported_media_type / unsupported_encoding (415), too_large (413), malformed (400 / "
            "INVALID_ARGUMENT), body_timeout (503 + Retry-After: the body took longer than [otlp] body_timeout_s).", labels=["reason"])
        for reason in OTLP_REQUEST_REFUSALS:
            requests.add_metric([reason], intake.get(f"requests_{reason}", 0))
        stalled = CounterMetricFamily("kvmiss_otlp_http_answers_stalled",
                                      "OTLP/HTTP connections closed because the client stopped reading its answer.")
        stalled.add_metric([], intake.get("http_answers_stalled", 0))
        yield from (refused, open_, clients, requests, stalled)

    def _endpoint(self) -> Iterator[Metric]:
        """The metrics endpoint's own bounds (a scraper locked out shows here afterwards)."""
        counts = self.endpoint()
        refused = CounterMetricFamily("kvmiss_metrics_http_connections_refused",
                                      "Metrics endpoint connections closed on arrival: its connection cap was reached.")
        refused.add_metric([], counts.get("connections_refused", 0))
        open_ = GaugeMetricFamily("kvmiss_metrics_http_connections", "Open metrics endpoint connections.")
        open_.add_metric([], counts.get("connections", 0))
        requests = CounterMetricFamily(
            "kvmiss_metrics_http_requests_refused", "Metrics endpoint requests refused, by reason: too_large (a "
            "body over 4 KiB: 413), body_timeout (a body that did not arrive in time: 408).", labels=["reason"])
        for reason in ENDPOINT_REQUEST_REFUSALS:
            requests.add_metric([reason], counts.get(f"requests_{reason}", 0))
        stalled = CounterMetricFamily("kvmiss_metrics_http_answers_stalled",
                                      "Metrics endpoint connections closed because the client stopped reading its answer.")
        stalled.add_metric([], counts.get("answers_stalled", 0))
        yield from (refused, open_, requests, stalled)
