"""The in-process exporter with the real OTel SDK: a router's own spans enriched on their way
to its real exporter (here the SDK's InMemorySpanExporter)."""

from __future__ import annotations

import logging
import threading
import time

import pytest
from fleet_builders import PARENT, H, WorkerFeed, removed, stored
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvmiss.collectors.continuity import Apply
from kvmiss.enricher.core.attribution import Attributor
from kvmiss.enricher.core.hashing import BlockHasher
from kvmiss.enricher.core.index import ResidencyIndex
from kvmiss.enricher.core.privacy import DigestKey
from kvmiss.enricher.otlp.spans import SpanReader
from kvmiss.enricher.service.inprocess import EnrichingSpanExporter
from kvmiss.schemas.span_attributes import InputNames

NEVER = 0xBEEF_0000_0000_0002  # never stored on A
RAW = ("kvmiss.token_ids", "kvmiss.extra_keys", "kvmiss.block_hashes")
LOOKUP = 1020.5  # engine seconds; A's feed below runs through ts 1029


def history(index: ResidencyIndex | None = None) -> ResidencyIndex:
    """Worker A, seq n at ts 1000 + n: H stored at 5, removed at 12, history through 29."""
    index = index or ResidencyIndex(["A"])
    for b in WorkerFeed("A").batches(range(0, 30), {5: [stored(PARENT, H)], 12: [removed(H)]}):
        index.apply(b)
    return index


def signed(chain: list[int]) -> list[int]:
    """OTel int attributes are int64: hashes >= 2^63 travel as two's complement."""
    return [h - 2**64 if h >= 2**63 else h for h in chain]


def router_attrs(rid: str, first_miss: int, *, lookup: float = LOOKUP, **extra) -> dict:
    return {"gen_ai.request.id": rid, "kvmiss.route.worker": "A", "kvmiss.route.policy": "prefix",
            "gen_ai.usage.input_tokens": 65, "gen_ai.usage.cache_read.input_tokens": 16,
            "kvmiss.block_hashes": signed([PARENT, first_miss, 7, 8]),
            "kvmiss.lookup_time_unix_nano": int(lookup * 1e9), "kvmiss.token_ids": [1, 2, 3],
            "kvmiss.extra_keys": '{"cache_salt": "tenant-secret"}', **extra}


class Router:
    """A TracerProvider whose processor wraps the in-memory exporter with kvmiss."""

    def __init__(self, index: ResidencyIndex, *, batch: bool = False, **kw):
        self.memory = InMemorySpanExporter()
        self.enricher = EnrichingSpanExporter(self.memory, index, digest_key=DigestKey("inprocess-test-key-01"), **kw)
        processor = BatchSpanProcessor(self.enricher) if batch else SimpleSpanProcessor(self.enricher)
        self.provider = TracerProvider(resource=Resource.create({"service.name": "router"}))
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer("router")

    def route(self, attributes: dict, *, children: tuple[tuple[str, dict], ...] = ()) -> None:
        with self.tracer.start_as_current_span("route", kind=trace.SpanKind.SERVER, attributes=attributes) as span:
            span.add_event("picked", {"worker": "A"})
            for name, attrs in children:
                with self.tracer.start_as_current_span(name, attributes=attrs):
                    pass

    def spans(self) -> dict:
        self.provider.force_flush()
        return {(dict(s.attributes).get("gen_ai.request.id"), s.name): s for s in self.memory.get_finished_spans()}


class TestLabels:
    def test_router_spans_get_labels_and_lose_their_raw_inputs(self):
        router = Router(history())
        router.route(router_attrs("evicted", H))
        router.route(router_attrs("never", NEVER))
        spans = router.spans()
        evicted, never = dict(spans["evicted", "route"].attributes), dict(spans["never", "route"].attributes)
        assert evicted["kvmiss.label"] == "evicted" and evicted["kvmiss.owner"] == "platform"
        assert evicted["kvmiss.first_miss_block"] == 1 and evicted["kvmiss.missed_tokens"] == 48
        assert evicted["kvmiss.eviction_age_ms"] == 8500 and evicted["kvmiss.history"] == "continuous"
        assert evicted["kvmiss.first_miss_digest"].count(":") == 1
        assert never["kvmiss.label"] == "no_match" and never["kvmiss.owner"] == "application"
        assert never["kvmiss.extra_key_kinds"] == ("cache_salt",)
        for span in spans.values():
            assert not set(RAW) & set(span.attributes)
            assert "tenant-secret" not in span.to_json()
        assert router.enricher.stats["verdicts"] == 2

    def test_the_copy_keeps_everything_but_the_attributes_it_changes(self):
        router = Router(history())
        router.route(router_attrs("evicted", H, **{"app.tier": "gold"}))
        span = router.spans()["evicted", "route"]
        assert span.name == "route" and span.kind is trace.SpanKind.SERVER
        assert span.attributes["app.tier"] == "gold" and span.attributes["kvmiss.route.worker"] == "A"
        assert [e.name for e in span.events] == ["picked"] and span.resource.attributes["service.name"] == "router"
        assert span.instrumentation_scope.name == "router" and span.end_time >= span.start_time > 0

    def test_spans_without_request_facts_go_on_as_the_same_objects(self):
        memory = InMemorySpanExporter()
        enricher = EnrichingSpanExporter(memory, history())
        span = TracerProvider().get_tracer("t").start_span("health", attributes={"http.route": "/health"})
        span.end()
        assert enricher.export([span]) is SpanExportResult.SUCCESS
        assert memory.get_finished_spans()[0] is span

    def test_an_existing_label_is_replaced_not_duplicated(self):
        router = Router(history())
        router.route(router_attrs("evicted", H, **{"kvmiss.label": "hit"}))
        assert router.spans()["evicted", "route"].attributes["kvmiss.label"] == "evicted"


class TestNoWait:
    def test_history_behind_the_lookup_is_judged_at_once_as_lagging(self):
        router = Router(history())
        router.route(router_attrs("late", H, lookup=1100.0))  # history runs through ts 1029
        attrs = router.spans()["late", "route"].attributes
        assert attrs["kvmiss.label"] == "unknown_history" and attrs["kvmiss.history"] == "lagging"

    def test_batches_queued_by_the_collector_thread_are_applied_before_judging(self):
        index = ResidencyIndex(["A"])
        router = Router(index)
        feed = WorkerFeed("A")
        batches = feed.batches(range(0, 30), {5: [stored(PARENT, H)], 12: [removed(H)]})
        collector = threading.Thread(target=lambda: [router.enricher.on_stream_action("A", Apply(b)) for b in batches])
        collector.start()
        collector.join()
        assert index.views("A") == []  # only queued: the index changes under the exporter's lock
        router.route(router_attrs("evicted", H))
        assert router.spans()["evicted", "route"].attributes["kvmiss.label"] == "evicted"


class TestAssemblyWithinABatch:
    def test_a_batch_joins_the_engine_and_transfer_spans_of_one_request(self):
        router = Router(history(), batch=True)
        attrs = router_attrs("r1", H)
        del attrs["gen_ai.usage.input_tokens"]  # the prompt length comes from the engine's span
        router.route(attrs, children=(
            ("llm_request", {"gen_ai.request.id": "r1", "gen_ai.usage.prompt_tokens": 65}),
            ("kv_transfer", {"kvmiss.transfer.result": "timeout", "kvmiss.transfer.source": "CPU"}),
        ))
        spans = router.spans()
        assert spans["r1", "route"].attributes["kvmiss.label"] == "transfer_failure"
        assert "kvmiss.label" not in spans["r1", "llm_request"].attributes
        assert "kvmiss.label" not in spans[None, "kv_transfer"].attributes

    def test_counts_on_no_span_of_the_batch_give_the_pipelines_incomplete_unknown(self):
        router = Router(history())
        attrs = router_attrs("r1", H)
        del attrs["gen_ai.usage.input_tokens"]
        router.route(attrs)
        attrs = router.spans()["r1", "route"].attributes
        assert attrs["kvmiss.label"] == "unknown_history" and "prompt_tokens" in attrs["kvmiss.reason"]

    def test_a_routers_own_attribute_names_map_through_the_same_reader(self):
        reader = SpanReader(InputNames(worker=["router.backend"], cached_tokens=["router.cached"]))
        router = Router(history(), reader=reader)
        attrs = router_attrs("evicted", H, **{"router.backend": "A", "router.cached": 16})
        del attrs["kvmiss.route.worker"], attrs["gen_ai.usage.cache_read.input_tokens"]
        router.route(attrs)
        assert router.spans()["evicted", "route"].attributes["kvmiss.label"] == "evicted"

    def test_token_ids_are_hashed_like_the_engine_and_never_exported(self):
        hasher = BlockHasher("sha256_cbor", seed="0", block_size=16)
        tokens = list(range(1000, 1065))
        chain = [int.from_bytes(d[-8:], "big") for d in hasher.hash_request(tokens)]
        index = ResidencyIndex(["A"])
        for b in WorkerFeed("A").batches(range(0, 30), {5: [stored(*chain)], 12: [removed(chain[1])]}):
            index.apply(b)
        router = Router(index, hasher=hasher)
        attrs = router_attrs("tokens", H, **{"kvmiss.token_ids": tokens})
        del attrs["kvmiss.block_hashes"], attrs["kvmiss.extra_keys"]
        router.route(attrs)
        span = router.spans()["tokens", "route"]
        assert span.attributes["kvmiss.label"] == "evicted" and not set(RAW) & set(span.attributes)


class Exploding(Attributor):
    def attribute(self, facts):
        raise RuntimeError("attribution bug")


class TestFailures:
    def test_an_exception_inside_attribution_passes_spans_on_unenriched_and_logs_once(self, caplog):
        index = history()
        router = Router(index, attributor=Exploding(index))
        with caplog.at_level(logging.ERROR, logger="kvmiss.inprocess"):
            router.route(router_attrs("r1", H))
            router.route(router_attrs("r2", H))
        spans = router.spans()
        assert {k for k in spans} == {("r1", "route"), ("r2", "route")}
        for span in spans.values():
            assert "kvmiss.label" not in span.attributes
            assert not set(RAW) & set(span.attributes)  # still never exported
        assert len([r for r in caplog.records if r.name == "kvmiss.inprocess"]) == 1
        assert router.enricher.stats["unenriched_error"] == 2

    def test_a_raising_wrapped_exporter_is_answered_failure_not_raised(self):
        class Broken(SpanExporter):
            def export(self, spans):
                raise ConnectionError("down")

        enricher = EnrichingSpanExporter(Broken(), history())
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(enricher))
        span = provider.get_tracer("t").start_span("route", attributes=router_attrs("r1", H))
        span.end()
        assert enricher.export([span]) is SpanExportResult.FAILURE
        assert enricher.stats["export_error"] == 2

    def test_shutdown_is_idempotent_and_later_exports_are_refused_and_counted(self):
        memory = InMemorySpanExporter()
        enricher = EnrichingSpanExporter(memory, history())
        enricher.shutdown()
        enricher.shutdown()
        provider = TracerProvider()
        span = provider.get_tracer("t").start_span("route")
        span.end()
        assert enricher.export([span]) is SpanExportResult.FAILURE
        assert enricher.stats["already_shutdown"] == 1


@pytest.mark.parametrize("batch", [False, True], ids=["simple", "batch"])
def test_both_sdk_processors_deliver_every_span_exactly_once(batch):
    router = Router(history(), batch=batch)
    for i in range(50):
        router.route(router_attrs(f"r{i}", H if i % 2 else NEVER), children=(("tokenize", {}),))
    router.provider.shutdown()
    spans = router.memory.get_finished_spans()
    assert len(spans) == 100
    labels = [s.attributes.get("kvmiss.label") for s in spans if s.name == "route"]
    assert labels.count("evicted") == 25 and labels.count("no_match") == 25


def test_a_router_process_fed_by_a_real_publisher_through_its_own_subscriber():
    """The wiring of the module docstring, with the real SGLang publisher on a real socket."""
    from sglang_publisher import batch, close, publisher
    from zmq_ports import free_tcp

    from kvmiss.collectors.fleet import Fleet
    from kvmiss.collectors.subscriber import Subscriber
    from kvmiss.schemas.config import WorkerSpec

    endpoint, replay = free_tcp(), free_tcp()
    pub = publisher(endpoint=endpoint, replay_endpoint=replay, topic="kv@A@m")
    index = ResidencyIndex(["A"])
    router = Router(index)
    subscriber = Subscriber(Fleet([WorkerSpec(id="A", endpoint=endpoint, replay_endpoint=replay)],
                                  router.enricher.on_stream_action))
    subscriber.start()
    try:
        time.sleep(0.3)  # let the SUB subscription reach the publisher (replay covers the rest)
        t0 = time.time()
        pub.publish(batch(t0, stored=[([PARENT, H], None)]))
        pub.publish(batch(t0 + 0.01, removed=[[H]]))
        for k in range(2, 6):
            pub.publish(batch(t0 + 0.01 * k))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            router.enricher.force_flush()  # drains what the collector thread queued
            view = index.views("A")
            if view and (view[0].applied_through_ts or 0) >= t0 + 0.05:
                break
            time.sleep(0.05)
        router.route(router_attrs("evicted", H, lookup=t0 + 0.035))
        router.route(router_attrs("never", NEVER, lookup=t0 + 0.035))
        spans = router.spans()
        assert spans["evicted", "route"].attributes["kvmiss.label"] == "evicted"
        assert spans["never", "route"].attributes["kvmiss.label"] == "no_match"
    finally:
        subscriber.shutdown()
        close(pub)
