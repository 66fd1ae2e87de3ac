"""Idle workers: engines publish only when a step produced events, so a worker that has gone
quiet has no batch stamped after a later lookup. A tail confirmation from the collector (the
publisher had nothing after the last applied batch when it answered a probe sent at ``at``)
proves its history reaches every lookup at or before ``at - margin``; the lookup step is then
the virtual step after the last applied batch. Anything short of that stays unresolved."""

from __future__ import annotations

import asyncio

import pytest
from fleet_builders import H, WorkerFeed, removed, request, stored
from test_pipeline import Clock, attrs, engine_span, export_request, make, router_span

from kvmiss.collectors.continuity import Apply, TailConfirmed
from kvmiss.enricher.core.attribution import Attributor
from kvmiss.enricher.core.epoch_residency import EpochResidency
from kvmiss.enricher.core.evidence import gather
from kvmiss.enricher.core.index import ResidencyIndex
from kvmiss.schemas.attribution import History, Label, Presence
from kvmiss.schemas.stream import RunStart

RunStartAfterGap = RunStart.AFTER_GAP

MARGIN = 1.25  # clock skew 0.25 s + lookup-to-publish 1.0 s (schemas/config.py defaults)


def judge(index, facts):
    return Attributor(index).attribute(facts)


def feed(index, worker: str, seqs, events=None, **kw) -> WorkerFeed:
    w = WorkerFeed(worker, **kw)
    for batch in w.batches(seqs, events):
        index.apply(batch)
    return w


def busy_b_without_h(index) -> WorkerFeed:
    return feed(index, "B", range(0, 13))  # chosen worker, applied through ts 1012


T = 1009.5  # the lookup: inside B's history, after A's last batch (ts 1005)


# --- the index ----------------------------------------------------------------------------------


def test_history_reaches_t_by_a_batch_stamped_after_it_or_by_a_confirmed_tail():
    index = ResidencyIndex(tail_margin_s=MARGIN)
    feed(index, "A", range(0, 6))
    view = index.current["A"]
    assert view.reaches(1005.0, MARGIN) and not view.reaches(1005.5, MARGIN)
    assert view.lookup_step(1004.5, MARGIN) == 5 and view.lookup_step(T, MARGIN) is None
    index.confirm_tail("A", 0, 5, at=T + MARGIN)
    assert view.reached_through(MARGIN) == T
    assert view.reaches(T, MARGIN) and not view.reaches(T + 0.01, MARGIN)
    assert view.lookup_step(T, MARGIN) == 6  # the virtual step after the last batch
    assert view.run_at_step(6) is view.runs[-1]
    assert view.applied_through_ts == 1005.0  # what was applied, not what is proven


@pytest.mark.parametrize("why, confirm", [
    ("another epoch", dict(epoch=1, seq=5)),
    ("not the last applied batch", dict(epoch=0, seq=4)),
    ("a seq never applied (written off)", dict(epoch=0, seq=6)),
])
def test_a_confirmation_of_anything_but_the_current_last_batch_is_ignored(why, confirm):
    index = ResidencyIndex(tail_margin_s=MARGIN)
    feed(index, "A", range(0, 6))
    index.confirm_tail("A", at=T + MARGIN, **confirm)
    assert index.current["A"].tail is None, why


def test_a_later_batch_supersedes_the_confirmation():
    index = ResidencyIndex(tail_margin_s=MARGIN)
    a = feed(index, "A", range(0, 6))
    index.confirm_tail("A", 0, 5, at=T + MARGIN)
    index.apply(a.batch(6))  # stamped 1006: the tail moved on
    view = index.current["A"]
    assert not view.reaches(T, MARGIN) and view.reached_through(MARGIN) == 1006.0


def test_a_confirmed_tail_survives_retention_dropping_the_whole_log():
    view = EpochResidency("A", 0, None)
    for batch in WorkerFeed("A").batches(range(0, 6)):
        view.apply(batch)
    view.prune(before_ts=1100.0)  # idle for long: every log entry is older than the horizon
    assert len(view.log_seq) == 0 and view.applied_through_ts == 1005.0
    view.confirm_tail(5, at=1200.0)
    assert view.reaches(1150.0, MARGIN) and view.lookup_step(1150.0, MARGIN) == 6


# --- the fleet view: other workers -------------------------------------------------------------


def test_an_idle_other_worker_with_a_confirmed_tail_no_longer_blocks_no_match():
    index = ResidencyIndex(tail_margin_s=MARGIN)
    feed(index, "A", range(0, 6))  # never stores H, idle after ts 1005
    busy_b_without_h(index)
    assert judge(index, request("B", T)).label is Label.UNKNOWN_HISTORY  # A may be lagging
    index.confirm_tail("A", 0, 5, at=T + MARGIN)
    evidence = gather(index, request("B", T))
    assert evidence.unresolved_holders == () and evidence.holders == ()
    assert judge(index, request("B", T)).label is Label.NO_MATCH


def test_a_confirmation_sent_less_than_the_margin_after_the_lookup_does_not_count():
    index = ResidencyIndex(tail_margin_s=MARGIN)
    feed(index, "A", range(0, 6))
    busy_b_without_h(index)
    # Sent 1 s after t: A's step that contained t may not have reached its ring yet (or the
    # clocks differ by up to the skew bound): no proof.
    index.confirm_tail("A", 0, 5, at=T + MARGIN - 0.25)
    assert gather(index, request("B", T)).unresolved_holders == (History.LAGGING,)
    assert judge(index, request("B", T)).label is Label.UNKNOWN_HISTORY


def test_an_idle_other_worker_that_held_the_block_is_a_routing_miss_once_confirmed():
    index = ResidencyIndex(tail_margin_s=MARGIN)
    feed(index, "A", range(0, 6), {3: [stored(H)]})
    busy_b_without_h(index)
    assert judge(index, request("B", T)).label is Label.UNKNOWN_HISTORY
    index.confirm_tail("A", 0, 5, at=T + MARGIN)
    verdict = judge(index, request("B", T))
    assert verdict.label is Label.ROUTING_MISS and verdict.holders == 1


def test_an_idle_other_worker_whose_last_batch_removed_the_block_did_not_hold_it():
    # A removal in the last batch before t happened before t: not the straddling step.
    index = ResidencyIndex(tail_margin_s=MARGIN)
    feed(index, "A", range(0, 6), {2: [stored(H)], 5: [removed(H)]})
    busy_b_without_h(index)
    index.confirm_tail("A", 0, 5, at=T + MARGIN)
    assert judge(index, request("B", T)).label is Label.NO_MATCH


def test_an_idle_quarantined_worker_stays_unresolved_with_a_confirmed_tail():
    index = ResidencyIndex(tail_margin_s=MARGIN)
    a = WorkerFeed("A")
    for batch in a.batches(range(0, 3)):
        index.apply(batch)
    a.start_run(5, RunStartAfterGap, gap=(3, 4))
    for batch in a.batches(range(5, 6)):
        index.apply(batch)
    busy_b_without_h(index)
    index.confirm_tail("A", 0, 5, at=T + MARGIN)
    assert gather(index, request("B", T)).unresolved_holders == (History.QUARANTINED,)


# --- the chosen worker ---------------------------------------------------------------------------


@pytest.mark.parametrize("events, label, presence", [
    ({2: [stored(H)], 8: [removed(H)]}, Label.EVICTED, Presence.EVICTED),
    ({2: [stored(H)]}, Label.RESIDENT_MISS, Presence.RESIDENT),
    ({}, Label.NO_MATCH, Presence.ABSENT),
])
def test_the_chosen_worker_idle_after_its_last_batch_is_judged_not_lagging(events, label, presence):
    index = ResidencyIndex(tail_margin_s=MARGIN)
    feed(index, "B", range(0, 11), events)  # last batch seq 10, ts 1010; idle since
    t = 1015.0
    lagging = judge(index, request("B", t))
    assert (lagging.label, lagging.history) == (Label.UNKNOWN_HISTORY, History.LAGGING)
    index.confirm_tail("B", 0, 10, at=t + MARGIN)
    evidence = gather(index, request("B", t))
    assert (evidence.history, evidence.presence) == (History.CONTINUOUS, presence)
    assert evidence.lookup_step_seq == 11 and evidence.applied_through_ts == 1010.0
    assert judge(index, request("B", t)).label is label


# --- the pipeline waits for the fleet, not only the chosen worker --------------------------------


def two_workers(b_last_ts: float):
    """A (chosen): H stored at 5, removed at 12, applied through ts 1029; B idle since
    ``b_last_ts``, never had H. The request looks up at 1020.5."""
    index = ResidencyIndex(tail_margin_s=MARGIN)
    feed(index, "A", range(0, 30), {5: [stored(H)], 12: [removed(H)]})
    b = feed(index, "B", range(0, 4), ts0=b_last_ts - 3)
    return index, b


def label_of(sink) -> str:
    return next(attrs(s) for s in sink.spans() if s.name == "router")["kvmiss.label"]


def test_the_pipeline_waits_for_an_idle_worker_until_its_tail_is_confirmed():
    index, _ = two_workers(b_last_ts=1018.0)  # quiet 2.5 s before the lookup: still waited for
    clock = Clock(0.0)
    pipe, sink = make(index, clock, history_wait_s=5.0)
    asyncio.run(pipe.consume(export_request(router_span(), engine_span())))
    assert pipe.poll(0.1) == 0 and sink.requests == []  # B may still send what it did at t
    index.confirm_tail("B", 0, 3, at=1020.5 + MARGIN)
    assert pipe.poll(0.2) == 1
    assert label_of(sink) == "evicted"


def test_without_a_confirmation_the_wait_ends_in_unknown_history():
    index, _ = two_workers(b_last_ts=1018.0)
    pipe, sink = make(index, Clock(0.0), history_wait_s=5.0)
    asyncio.run(pipe.consume(export_request(router_span(), engine_span())))
    assert pipe.poll(0.1) == 0 and pipe.poll(5.0) == 0 and pipe.poll(5.1) == 1
    assert label_of(sink) == "unknown_history"


def test_a_worker_silent_for_longer_than_the_wait_before_the_lookup_is_not_waited_for():
    index, _ = two_workers(b_last_ts=1010.0)  # proven nothing for 10.5 s before t: down?
    pipe, sink = make(index, Clock(0.0), history_wait_s=5.0)
    asyncio.run(pipe.consume(export_request(router_span(), engine_span())))
    assert pipe.poll(0.1) == 1  # waiting would not help: judged now, honestly
    assert label_of(sink) == "unknown_history"


# --- the service hands confirmations from the collector thread to the index, in order -----------


def test_the_service_applies_tail_confirmations_in_order_with_the_batches(tmp_path):
    from kvmiss.enricher.service.serve import Service
    from kvmiss.schemas.config import parse_config

    config = parse_config(
        '[metrics]\nlisten = ""\n[[workers]]\nid = "A"\nendpoint = "tcp://127.0.0.1:1"\n'
        'replay_endpoint = "tcp://127.0.0.1:2"\n[history]\nclock_skew_s = 0.5\npublish_delay_s = 0.5\n')
    service = Service(config)
    assert service.index.tail_margin_s == 1.0
    assert service.fleet.streams["A"].config.tail_probe_interval_s == 0.5
    a = WorkerFeed("A")
    service._on_stream_action("A", Apply(a.batch(0)))
    service._on_stream_action("A", TailConfirmed(0, 0, at=1003.0))  # seq 0 was the tail then
    service._on_stream_action("A", Apply(a.batch(1)))
    service._on_stream_action("A", TailConfirmed(0, 1, at=1005.0))
    service.feed.drain()
    view = service.index.current["A"]
    assert view.tail == (1, 1005.0) and service.index.reaches(view, 1004.0)


def test_probing_is_configured_under_history_and_zero_turns_it_off():
    from kvmiss.enricher.service.serve import Service
    from kvmiss.schemas.config import ConfigError, HistoryConfig, parse_config

    assert (HistoryConfig().tail_probe_interval_s, HistoryConfig().clock_skew_s,
            HistoryConfig().publish_delay_s) == (0.5, 0.25, 1.0)
    config = parse_config('[metrics]\nlisten = ""\n[[workers]]\nid = "A"\nendpoint = "tcp://127.0.0.1:1"\n'
                          '[history]\ntail_probe_interval_s = 0\n')
    assert Service(config).fleet.streams["A"].config.tail_probe_interval_s is None
    with pytest.raises(ConfigError, match="clock_skew_s"):
        parse_config("[history]\nclock_skew_s = -1\n")


def test_the_fleet_wide_probe_bound_is_configured_under_history():
    from kvmiss.enricher.service.serve import Service
    from kvmiss.schemas.config import ConfigError, HistoryConfig, parse_config

    assert HistoryConfig().tail_probes_in_flight == 64
    config = parse_config('[metrics]\nlisten = ""\n[[workers]]\nid = "A"\nendpoint = "tcp://127.0.0.1:1"\n'
                          '[history]\ntail_probes_in_flight = 3\n')
    assert Service(config).fleet.max_tail_probes == 3
    with pytest.raises(ConfigError, match="tail_probes_in_flight"):
        parse_config("[history]\ntail_probes_in_flight = 0\n")


def test_tail_probe_counters_are_exported_per_worker():
    from prometheus_client import CollectorRegistry
    from prometheus_client.openmetrics.exposition import generate_latest
    from test_pipeline import Sink

    from kvmiss.collectors.stream import WorkerStream
    from kvmiss.enricher.service.metrics import KvmissCollector
    from kvmiss.enricher.service.pipeline import Pipeline

    stream = WorkerStream("A", replay=True)
    stream.health.tail_probes, stream.health.tail_confirmations = 5, 3
    stream.health.tail_recoveries, stream.health.tail_probes_unanswered = 1, 1
    stream.health.tail_probes_deferred = 7
    pipe = Pipeline(Attributor(ResidencyIndex()), Sink(), clock=Clock())
    registry = CollectorRegistry()
    registry.register(KvmissCollector(pipe.stats, lambda: {"A": stream}))
    text = generate_latest(registry).decode()
    for line in ('kvmiss_stream_tail_probes_total{worker="A"} 5.0',
                 'kvmiss_stream_tail_confirmations_total{worker="A"} 3.0',
                 'kvmiss_stream_tail_recoveries_total{worker="A"} 1.0',
                 'kvmiss_stream_tail_probes_unanswered_total{worker="A"} 1.0',
                 'kvmiss_stream_tail_probes_deferred_total{worker="A"} 7.0'):
        assert line in text.splitlines(), line


def test_a_request_that_missed_nothing_reusable_does_not_wait_for_the_fleet():
    index, _ = two_workers(b_last_ts=1018.0)
    pipe, sink = make(index, Clock(0.0), history_wait_s=5.0)
    hit = router_span(**{"gen_ai.usage.cache_read.input_tokens": 32})  # 40 tokens: L = 32
    asyncio.run(pipe.consume(export_request(hit, engine_span())))
    assert pipe.poll(0.1) == 1 and label_of(sink) == "hit"
