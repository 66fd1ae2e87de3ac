"""Metrics: the families SPANS.md asks for, low-cardinality labels, exemplars only for traces."""

from __future__ import annotations

import asyncio
import re

import pytest
from fleet_builders import H
from prometheus_client import CollectorRegistry
from prometheus_client.openmetrics.exposition import generate_latest
from test_pipeline import Clock, Sink, engine_span, evicted_history, export_request, router_span

from kvmiss.collectors.stream import WorkerStream
from kvmiss.enricher.core.attribution import Attributor
from kvmiss.enricher.core.privacy import DigestKey
from kvmiss.enricher.service.metrics import KvmissCollector
from kvmiss.enricher.service.pipeline import Pipeline


def scrape() -> tuple[str, str]:
    index, _ = evicted_history()
    exemplars: dict = {}
    trace_hex = bytes(range(16)).hex()

    def remember(facts, verdict, trace_id):
        exemplars[(verdict.label, facts.route_policy or "", facts.worker or "")] = trace_id.hex()

    pipe = Pipeline(Attributor(index, DigestKey("metrics-test-secret-0001")), Sink(), clock=Clock(),
                    on_verdict=remember)
    asyncio.run(pipe.consume(export_request(router_span(**{"kvmiss.route.policy": "prefix"}), engine_span())))
    pipe.poll()
    registry = CollectorRegistry()
    registry.register(KvmissCollector(pipe.stats, lambda: {"A": WorkerStream("A", replay=True)},
                                      exemplars=exemplars))
    return generate_latest(registry).decode(), trace_hex


def test_label_counters_carry_label_owner_worker_policy_and_a_trace_exemplar():
    text, trace_hex = scrape()
    line = next(l for l in text.splitlines() if l.startswith("kvmiss_requests_total{"))
    assert 'label="evicted"' in line and 'owner="platform"' in line
    assert 'worker="A"' in line and 'route_policy="prefix"' in line
    assert f'trace_id="{trace_hex}"' in line  # an exemplar, after the '#'
    assert "kvmiss_missed_tokens_total" in text and "kvmiss_unknown_share" in text
    assert "kvmiss_stream_batches_applied_total" in text and "kvmiss_history_wait_seconds_bucket" in text


def test_no_hash_digest_request_or_trace_id_is_ever_a_label_value():
    text, trace_hex = scrape()
    label_values = re.findall(r'="([^"]*)"', "\n".join(l.split(" # ")[0] for l in text.splitlines()))
    forbidden = {str(H), f"{H:x}", str(H - 2**64), "r1", trace_hex}
    assert not forbidden & set(label_values)
    assert not any(":" in v and len(v) > 16 for v in label_values)  # no keyed digests


def test_a_worker_that_left_within_retention_stays_a_label_value_others_are_untracked():
    index, _ = evicted_history()  # the request was served by A
    pipe = Pipeline(Attributor(index, DigestKey("metrics-test-secret-0001")), Sink(), clock=Clock())
    asyncio.run(pipe.consume(export_request(router_span(), engine_span())))
    pipe.poll()

    def workers(recently_departed) -> set[str]:
        registry = CollectorRegistry()
        registry.register(KvmissCollector(pipe.stats, dict, recently_departed=recently_departed))
        return set(re.findall(r'kvmiss_requests_total\{[^}]*worker="([^"]*)"', generate_latest(registry).decode()))

    assert workers(frozenset) == {"untracked"}  # A is no member: folded
    assert workers(lambda: {"A": 12.0}) == {"A"}  # A departed within retention: its own series


def test_re_announcements_and_stale_partial_stores_are_counted_per_worker():
    from fleet_builders import WorkerFeed, group_stored, removed, stored

    from kvmiss.enricher.core.index import ResidencyIndex
    index, a = ResidencyIndex(), WorkerFeed("A")
    for b in a.batches(range(0, 10), {1: [stored(H - 1, H)], 2: [stored(H - 1, H)],  # reported in full
                                      3: [group_stored(0, H + 1, parent=H, block_size=16)],
                                      4: [removed(H + 1)], 5: [group_stored(0, H + 1, parent=H, block_size=8)],
                                      6: [stored()]}):  # no hash (vLLM's Mamba state group)
        index.apply(b)
    registry = CollectorRegistry()
    registry.register(KvmissCollector(Pipeline(Attributor(index), Sink(), clock=Clock()).stats, dict,
                                      index_anomalies=lambda: index.anomalies))
    sample = registry.get_sample_value
    assert sample("kvmiss_index_re_announced_stores_total", {"worker": "A"}) == 1
    assert sample("kvmiss_index_re_announced_blocks_total", {"worker": "A"}) == 2
    assert sample("kvmiss_index_stale_partial_stores_total", {"worker": "A"}) == 1
    assert sample("kvmiss_index_stores_without_hashes_total", {"worker": "A"}) == 1


def test_every_metric_the_real_engine_run_reports_is_one_kvmiss_declares():
    """examples/vllm-cpu/run_field.py once read a counter kvmiss never exported, and the
    summary showed 0 re-announcements: its reader now refuses a name the page does not
    declare, and every name it reports is on kvmiss's own page (a declared counter with no
    sample yet reads 0)."""
    import sys
    from pathlib import Path

    from prometheus_client import exposition

    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples" / "vllm-cpu"))
    import run_field

    index, _ = evicted_history()
    registry = CollectorRegistry()
    registry.register(KvmissCollector(Pipeline(Attributor(index), Sink(), clock=Clock()).stats,
                                      lambda: {"A": WorkerStream("A", replay=True)},
                                      index_anomalies=lambda: index.anomalies))
    page = exposition.generate_latest(registry).decode()  # the format /metrics serves by default
    values = {name: run_field.metric(page, name) for name in run_field.REPORTED_METRICS}
    assert values["kvmiss_index_re_announced_confirmed_total"] == 0  # declared, never incremented
    assert values["kvmiss_stream_batches_applied_total"] >= 0
    with pytest.raises(run_field.MissingMetric, match="kvmiss_re_announcements_total"):
        run_field.metric(page, "kvmiss_re_announcements_total")
