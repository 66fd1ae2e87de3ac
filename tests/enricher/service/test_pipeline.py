"""The enrichment pipeline: join spans of one request, wait for history, judge, export once."""

from __future__ import annotations

import asyncio
import json
import os

import pytest
from fleet_builders import H, WorkerFeed, removed, stored
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from kvmiss.enricher.core.attribution import Attributor
from kvmiss.enricher.core.hashing import BlockHasher
from kvmiss.enricher.core.index import ResidencyIndex
from kvmiss.enricher.otlp.interfaces import Outcome
from kvmiss.enricher.service.pipeline import Pipeline
from kvmiss.schemas import span_attributes as names

TRACE = bytes(range(16))


class Sink:
    def __init__(self, capacity: int = 10**9):
        self.requests: list[ExportTraceServiceRequest] = []
        self.capacity = capacity

    def has_capacity(self, spans: int) -> bool:
        return spans <= self.capacity

    def put(self, request, tag=None) -> bool:
        self.requests.append(request)
        return True

    def spans(self) -> list:
        return [s for r in self.requests for rs in r.resource_spans for ss in rs.scope_spans for s in ss.spans]


class Clock:
    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def export_request(*spans: dict, instance: str | None = None) -> ExportTraceServiceRequest:
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    if instance:
        kv = rs.resource.attributes.add()
        kv.key, kv.value.string_value = "service.instance.id", instance
    ss = rs.scope_spans.add()
    for i, spec in enumerate(spans):
        span = ss.spans.add(trace_id=spec.pop("trace_id", TRACE), span_id=spec.pop("span_id", os.urandom(8)),
                            name=spec.pop("name", "span"), start_time_unix_nano=spec.pop("start", 0),
                            end_time_unix_nano=spec.pop("end", 0))
        for key, value in spec.items():
            kv = span.attributes.add()
            kv.key = key
            if isinstance(value, list):
                for item in value:
                    kv.value.array_value.values.add().int_value = item
            elif isinstance(value, str):
                kv.value.string_value = value
            else:
                kv.value.int_value = value
    return req


def attrs(span) -> dict:
    out = {}
    for kv in span.attributes:
        kind = kv.value.WhichOneof("value")
        out[kv.key] = getattr(kv.value, kind) if kind != "array_value" else [
            v.WhichOneof("value") and getattr(v, v.WhichOneof("value")) for v in kv.value.array_value.values]
    return out


def evicted_history():
    index, a = ResidencyIndex(), WorkerFeed("A", ts0=1000.0)
    for b in a.batches(range(0, 30), {5: [stored(H)], 12: [removed(H)]}):
        index.apply(b)
    return index, a


def router_span(**extra) -> dict:
    return {"name": "router", "gen_ai.request.id": "r1", "gen_ai.usage.cache_read.input_tokens": 16,
            "kvmiss.route.worker": "A", "kvmiss.block_hashes": [7, H - 2**64, 9],
            "kvmiss.lookup_time_unix_nano": int(1020.5e9), **extra}


def engine_span() -> dict:
    return {"name": "llm_request", "gen_ai.request.id": "r1", "gen_ai.usage.prompt_tokens": 40}


def make(index, clock, sink=None, **kw) -> tuple[Pipeline, Sink]:
    sink = sink or Sink()
    return Pipeline(Attributor(index), sink, clock=clock, **kw), sink


def test_spans_of_one_request_in_two_batches_are_joined_and_exported_once():
    index, _ = evicted_history()
    clock = Clock()
    pipe, sink = make(index, clock)
    assert asyncio.run(pipe.consume(export_request(engine_span(), {"name": "db.query"}))).outcome is Outcome.ACCEPTED
    assert sink.requests == []  # held: its request is not judged yet
    asyncio.run(pipe.consume(export_request(router_span())))
    assert pipe.poll() == 1
    spans = sink.spans()
    assert len(spans) == 3 and len(sink.requests) == 2
    router = next(s for s in spans if s.name == "router")
    a = attrs(router)
    assert a["kvmiss.label"] == "evicted" and a["kvmiss.owner"] == "platform"
    assert a["kvmiss.first_miss_block"] == 1 and a["kvmiss.missed_tokens"] == 16
    assert "kvmiss.block_hashes" not in a
    assert pipe.stats.spans_in == pipe.stats.spans_out == 3


def test_spans_without_request_facts_pass_straight_through():
    pipe, sink = make(ResidencyIndex(), Clock())
    asyncio.run(pipe.consume(export_request({"name": "http", "http.method": "GET"})))
    assert len(sink.spans()) == 1 and "kvmiss.label" not in attrs(sink.spans()[0])


def test_a_request_waits_for_its_workers_history_then_is_judged():
    index, a = ResidencyIndex(), WorkerFeed("A", ts0=1000.0)
    for b in a.batches(range(0, 10), {5: [stored(H)]}):
        index.apply(b)
    clock = Clock(50.0)
    pipe, sink = make(index, clock, history_wait_s=5.0)
    asyncio.run(pipe.consume(export_request(router_span(), engine_span())))
    assert pipe.poll() == 0 and sink.requests == []  # lookup at 1020.5, history at 1009
    for b in a.batches(range(10, 25), {15: [removed(H)]}):
        index.apply(b)
    clock.t = 51.0
    assert pipe.poll() == 1
    assert attrs(sink.spans()[0])["kvmiss.label"] == "evicted"


def test_history_that_never_catches_up_gives_lagging_unknown_history():
    index, a = ResidencyIndex(), WorkerFeed("A", ts0=1000.0)
    for b in a.batches(range(0, 10)):
        index.apply(b)
    clock = Clock(0.0)
    pipe, sink = make(index, clock, history_wait_s=2.0)
    asyncio.run(pipe.consume(export_request(router_span(), engine_span())))
    pipe.poll()
    clock.t = 2.5
    pipe.poll()
    a = attrs(sink.spans()[0])
    assert a["kvmiss.label"] == "unknown_history" and a["kvmiss.history"] == "lagging"


def test_facts_that_never_complete_still_leave_with_the_honest_unknown():
    clock = Clock(0.0)
    pipe, sink = make(ResidencyIndex(), clock, assemble_wait_s=3.0)
    asyncio.run(pipe.consume(export_request(engine_span())))  # vLLM alone: no cached tokens
    pipe.poll()
    assert sink.requests == []
    clock.t = 3.0
    pipe.poll()
    a = attrs(sink.spans()[0])
    assert a["kvmiss.label"] == "unknown_history" and "cached_tokens" in a["kvmiss.reason"]


def test_a_span_without_request_id_joins_the_traces_only_request():
    index, _ = evicted_history()
    pipe, sink = make(index, Clock())
    transfer = {"name": "kv_transfer", "kvmiss.transfer.result": "failed", "kvmiss.transfer.source": "B"}
    asyncio.run(pipe.consume(export_request(transfer)))
    asyncio.run(pipe.consume(export_request(router_span(), engine_span())))
    pipe.poll()
    pipe.poll()
    labels = {s.name: attrs(s).get("kvmiss.label") for s in sink.spans()}
    assert labels == {"kv_transfer": None, "router": "transfer_failure", "llm_request": None}


def test_a_failed_transfer_needs_no_lookup_time_and_no_wait():
    # A router span alone: cached tokens, a failed transfer, no lookup time anywhere. The
    # request's own span proves transfer_failure (ATTRIBUTION.md precedence), so it is
    # judged at once -- not held for assemble_wait_s and then called unknown_history.
    index, _ = evicted_history()
    clock = Clock(0.0)
    pipe, sink = make(index, clock, assemble_wait_s=30.0, history_wait_s=30.0)
    span = router_span(**{"kvmiss.transfer.result": "failed", "kvmiss.transfer.source": "B",
                          "gen_ai.usage.prompt_tokens": 40})
    del span["kvmiss.lookup_time_unix_nano"]
    asyncio.run(pipe.consume(export_request(span)))
    assert pipe.poll() == 1  # at clock 0: no wait at all
    a = attrs(sink.spans()[0])
    assert a["kvmiss.label"] == "transfer_failure" and a["kvmiss.owner"] == "platform"
    assert "lookup_time" not in a["kvmiss.reason"]


def test_without_a_failed_transfer_a_miss_still_waits_for_its_lookup_time():
    index, _ = evicted_history()
    clock = Clock(0.0)
    pipe, sink = make(index, clock, assemble_wait_s=3.0)
    span = router_span(**{"kvmiss.transfer.result": "completed", "gen_ai.usage.prompt_tokens": 40})
    del span["kvmiss.lookup_time_unix_nano"]
    asyncio.run(pipe.consume(export_request(span)))
    assert pipe.poll() == 0 and sink.requests == []
    clock.t = 3.0
    pipe.poll()
    a = attrs(sink.spans()[0])
    assert a["kvmiss.label"] == "unknown_history" and "lookup_time" in a["kvmiss.reason"]


def test_token_ids_are_hashed_like_the_engine_and_never_exported():
    hasher = BlockHasher("sha256_cbor", seed="0", block_size=16)
    tokens = list(range(1000, 1040))
    chain = [int.from_bytes(d[-8:], "big") for d in hasher.hash_request(tokens)]
    index, a = ResidencyIndex(), WorkerFeed("A", ts0=1000.0)
    for b in a.batches(range(0, 30), {5: [stored(chain[1])], 12: [removed(chain[1])]}):
        index.apply(b)
    pipe, sink = make(index, Clock(), hasher=hasher)
    span = router_span(**{"kvmiss.token_ids": tokens, "kvmiss.extra_keys": json.dumps({"cache_salt": "tenant-secret"})})
    del span["kvmiss.block_hashes"]
    asyncio.run(pipe.consume(export_request(span, engine_span())))
    pipe.poll()
    out = sink.spans()[0]
    a = attrs(out)
    # The salt changes every hash, so the chain is not the unsalted one: never stored.
    assert a["kvmiss.label"] == "no_match" and a["kvmiss.extra_key_kinds"] == ["cache_salt"]
    raw = out.SerializeToString()
    assert b"tenant-secret" not in raw and "kvmiss.token_ids" not in a and "kvmiss.extra_keys" not in a


def test_a_full_pending_buffer_answers_retryable_and_keeps_nothing():
    pipe, sink = make(ResidencyIndex(), Clock(), max_pending_spans=2)
    result = asyncio.run(pipe.consume(export_request(engine_span(), engine_span(), engine_span())))
    assert result.outcome is Outcome.RETRYABLE and result.retry_after_s > 0
    assert pipe.pending_spans == 0 and pipe.stats.spans_refused == 3


def test_shutdown_judges_everything_still_held():
    pipe, sink = make(ResidencyIndex(["A"]), Clock(), assemble_wait_s=100, history_wait_s=100)
    asyncio.run(pipe.consume(export_request(router_span(), engine_span())))
    asyncio.run(pipe.consume(export_request({"gen_ai.request.id": "r2", "gen_ai.usage.prompt_tokens": 5,
                                             "trace_id": bytes(16)})))
    pipe.poll(final=True)
    assert len(sink.spans()) == 3 and pipe.pending_spans == 0


# --- judge_on_arrival: what `kvmiss serve` runs (no poll interval added to a request) -------


def test_on_arrival_a_complete_request_leaves_with_its_batch_without_a_poll():
    index, _ = evicted_history()
    pipe, sink = make(index, Clock(), judge_on_arrival=True)
    asyncio.run(pipe.consume(export_request(router_span(), engine_span(), {"name": "db.query"})))
    assert len(sink.requests) == 1 and attrs(sink.spans()[0])["kvmiss.label"] == "evicted"
    assert pipe.poll() == 0 and pipe.pending_spans == 0


def test_on_arrival_an_earlier_span_without_request_id_still_joins_first():
    index, _ = evicted_history()
    pipe, sink = make(index, Clock(), judge_on_arrival=True)
    transfer = {"name": "kv_transfer", "kvmiss.transfer.result": "failed", "kvmiss.transfer.source": "B"}
    asyncio.run(pipe.consume(export_request(transfer)))
    assert sink.requests == []
    asyncio.run(pipe.consume(export_request(router_span(), engine_span())))
    labels = {s.name: attrs(s).get("kvmiss.label") for s in sink.spans()}
    assert labels == {"kv_transfer": None, "router": "transfer_failure", "llm_request": None}


def test_on_arrival_the_history_wait_starts_when_the_spans_arrive():
    index, a = ResidencyIndex(), WorkerFeed("A", ts0=1000.0)
    for b in a.batches(range(0, 10), {5: [stored(H)]}):
        index.apply(b)
    clock = Clock(50.0)
    pipe, sink = make(index, clock, history_wait_s=5.0, judge_on_arrival=True)
    asyncio.run(pipe.consume(export_request(router_span(), engine_span())))
    assert sink.requests == []  # lookup at 1020.5, history at 1009: waits
    assert pipe.poll(54.9) == 0 and pipe.poll(55.0) == 1
    assert attrs(sink.spans()[0])["kvmiss.history"] == "lagging"


def test_a_raw_input_with_an_unusable_value_on_a_span_without_facts_is_still_stripped():
    pipe, sink = make(ResidencyIndex(), Clock())
    asyncio.run(pipe.consume(export_request({"name": "odd", "kvmiss.token_ids": "not-a-list"})))
    assert "kvmiss.token_ids" not in attrs(sink.spans()[0])


def test_raw_inputs_are_stripped_from_every_span_when_their_names_are_not_read():
    from kvmiss.enricher.otlp.spans import SpanReader
    from kvmiss.schemas.span_attributes import InputNames

    reader = SpanReader(InputNames(block_hashes=["router.chain"]))  # kvmiss.block_hashes: not an input now
    pipe, sink = make(ResidencyIndex(), Clock(), reader=reader)
    asyncio.run(pipe.consume(export_request({"name": "plain", "kvmiss.block_hashes": [1, 2]})))
    assert "kvmiss.block_hashes" not in attrs(sink.spans()[0])


def test_span_supplied_workers_and_policies_are_bounded_metric_keys():
    pipe, _ = make(ResidencyIndex(["A"]), Clock())
    from kvmiss.schemas.attribution import Label, Owner, RequestFacts, Verdict
    verdict = Verdict(label=Label.HIT, owner=Owner.NONE, reason="r")
    keys = {pipe.metric_key(RequestFacts(prompt_tokens=1, cached_tokens=0, block_size=16,
                                         worker=f"w{i}", route_policy=f"p{i}"), verdict)
            for i in range(100)}
    assert {k[2] for k in keys} == {"untracked"}
    assert len({k[1] for k in keys}) == 17 and ("other" in {k[1] for k in keys})
    tracked = pipe.metric_key(RequestFacts(prompt_tokens=1, cached_tokens=0, block_size=16, worker="A"), verdict)
    assert tracked[2] == "A"


def test_history_waits_are_kept_as_a_fixed_size_histogram_whether_or_not_anyone_scrapes():
    from kvmiss.enricher.service.pipeline import WAIT_BUCKETS, WaitHistogram

    h = WaitHistogram()
    for i in range(10_000):
        h.observe((i % 7) * 0.2)
    assert len(h.counts) == len(WAIT_BUCKETS) and h.total == 10_000
    assert h.counts[0] == len(range(0, 10_000, 7)) and h.counts[-1] == 10_000


# --- one verdict per request: late, early, re-sent and same-id partner spans ---------------------


def vllm_request_span(lookup: float = 1020.5, queue_s: float = 0.25, **extra) -> dict:
    """vLLM's own ``llm_request``: the request id a router shares, prompt tokens, and the
    time in queue from which the lookup time follows (no cached tokens)."""
    return {"name": "llm_request", "gen_ai.request.id": "r1", "gen_ai.usage.prompt_tokens": 40,
            "start": int((lookup - queue_s) * 1e9), "gen_ai.latency.time_in_queue": queue_s, **extra}


def timed_request(*specs: dict) -> ExportTraceServiceRequest:
    """`export_request`, with ``gen_ai.latency.time_in_queue`` as the double vLLM sends."""
    doubles = [{k: spec.pop(k) for k in list(spec) if isinstance(spec[k], float)} for spec in specs]
    request = export_request(*specs)
    for span, extra in zip(request.resource_spans[0].scope_spans[0].spans, doubles):
        for key, value in extra.items():
            kv = span.attributes.add()
            kv.key, kv.value.double_value = key, value
    return request


def labelled(sink: Sink) -> dict[str, str]:
    return {s.name: attrs(s)["kvmiss.label"] for s in sink.spans() if "kvmiss.label" in attrs(s)}


def test_a_router_span_without_lookup_time_waits_for_llm_request_and_takes_its_time():
    index, _ = evicted_history()
    clock = Clock(0.0)
    pipe, sink = make(index, clock, assemble_wait_s=15.0, judge_on_arrival=True)
    router = router_span(**{"gen_ai.usage.input_tokens": 40})
    del router["kvmiss.lookup_time_unix_nano"]
    asyncio.run(pipe.consume(export_request(router)))
    clock.t = 5.0
    pipe.poll()
    assert sink.requests == []  # a miss: it waits for the lookup time, never guesses one
    clock.t = 6.0  # vLLM's batch exporter, seconds later
    asyncio.run(pipe.consume(timed_request(vllm_request_span())))
    pipe.poll()
    assert labelled(sink) == {"router": "evicted"}  # one label, on the span with cached tokens
    router_out = next(s for s in sink.spans() if s.name == "router")
    assert attrs(router_out)["kvmiss.eviction_age_ms"] == 8500  # removed at 1012, lookup 1020.5
    assert pipe.stats.spans_in == pipe.stats.spans_out == 2


def test_a_lookup_time_from_llm_request_is_a_window_and_its_steps_must_agree():
    """H is removed in step 12 (1012.0). vLLM's queue time puts the lookup at 1010.5 at the
    earliest (step 11: resident); its time to first token less prefill at 1012.5 at the latest
    (step 13: removed). Which step it was is not proven: unknown, never resident_miss. The
    earliest time alone (no time to first token) is still taken as the lookup."""
    labels = {}
    for name, extra in (("window", {"gen_ai.latency.time_to_first_token": 2.25,
                                    "gen_ai.latency.time_in_model_prefill": 0.25}), ("queue only", {})):
        index, _ = evicted_history()
        clock = Clock(0.0)
        pipe, sink = make(index, clock, assemble_wait_s=15.0, judge_on_arrival=True)
        router = router_span(**{"gen_ai.usage.input_tokens": 40})
        del router["kvmiss.lookup_time_unix_nano"]
        asyncio.run(pipe.consume(export_request(router)))
        asyncio.run(pipe.consume(timed_request(vllm_request_span(lookup=1010.5, queue_s=0.25, **extra))))
        pipe.poll()
        out = attrs(next(s for s in sink.spans() if s.name == "router"))
        labels[name] = out["kvmiss.label"]
        if name == "window":
            assert "window" in out["kvmiss.reason"] and "evicted" in out["kvmiss.reason"]
    assert labels == {"window": "unknown_history", "queue only": "resident_miss"}


def test_llm_request_first_then_the_router_span_gives_one_label():
    index, _ = evicted_history()
    clock = Clock(0.0)
    pipe, sink = make(index, clock, judge_on_arrival=True)
    asyncio.run(pipe.consume(timed_request(vllm_request_span())))
    clock.t = 4.0
    router = router_span()
    del router["kvmiss.lookup_time_unix_nano"]
    asyncio.run(pipe.consume(export_request(router)))
    pipe.poll()
    assert labelled(sink) == {"router": "evicted"}


def test_a_router_span_whose_lookup_time_never_comes_is_unknown_naming_it():
    index, _ = evicted_history()
    clock = Clock(0.0)
    pipe, sink = make(index, clock, assemble_wait_s=3.0)
    router = router_span(**{"gen_ai.usage.input_tokens": 40})
    del router["kvmiss.lookup_time_unix_nano"]
    asyncio.run(pipe.consume(export_request(router)))
    clock.t = 3.0
    pipe.poll()
    a = attrs(sink.spans()[0])
    assert a["kvmiss.label"] == "unknown_history" and "lookup_time" in a["kvmiss.reason"]


def test_a_hit_judged_from_the_router_span_is_not_judged_again_when_llm_request_comes():
    clock = Clock(0.0)
    pipe, sink = make(ResidencyIndex(), clock, assemble_wait_s=15.0, judge_on_arrival=True)
    hit = {"name": "router", "gen_ai.request.id": "r1", "gen_ai.usage.input_tokens": 40,
           "gen_ai.usage.cache_read.input_tokens": 32, "kvmiss.route.worker": "A"}
    asyncio.run(pipe.consume(export_request(hit)))
    assert labelled(sink) == {"router": "hit"}  # needs no history and no lookup time
    clock.t = 6.0
    asyncio.run(pipe.consume(timed_request(vllm_request_span())))  # the same request id
    clock.t = 30.0
    pipe.poll()
    assert labelled(sink) == {"router": "hit"}  # llm_request passed through, no second label
    assert pipe.stats.unenriched["request_already_judged"] == 1
    assert pipe.stats.unenriched["facts_incomplete"] == 0
    assert pipe.stats.spans_in == pipe.stats.spans_out == 2


def test_a_re_sent_copy_of_the_enriched_span_gets_the_same_verdict():
    index, a = evicted_history()
    clock = Clock(0.0)
    pipe, sink = make(index, clock, judge_on_arrival=True)
    span_id = os.urandom(8)
    asyncio.run(pipe.consume(export_request(router_span(span_id=span_id, **{"gen_ai.usage.input_tokens": 40}))))
    first = attrs(sink.spans()[0])
    assert first["kvmiss.label"] == "evicted"
    for b in a.batches(range(30, 40), {31: [stored(H)]}):  # its recompute stored H again since
        index.apply(b)
    clock.t = 2.0
    asyncio.run(pipe.consume(export_request(router_span(span_id=span_id, **{"gen_ai.usage.input_tokens": 40}))))
    again = attrs(sink.spans()[1])
    assert {k: v for k, v in again.items() if k.startswith("kvmiss.")} == \
        {k: v for k, v in first.items() if k.startswith("kvmiss.")}
    assert pipe.stats.resent_spans == 1 and sum(pipe.stats.verdicts.values()) == 1


def test_a_partner_arriving_while_the_request_waits_for_history_leaves_with_it_unlabelled():
    index, a = ResidencyIndex(), WorkerFeed("A", ts0=1000.0)
    for b in a.batches(range(0, 10), {5: [stored(H)]}):
        index.apply(b)
    clock = Clock(0.0)
    pipe, sink = make(index, clock, history_wait_s=5.0, judge_on_arrival=True)
    asyncio.run(pipe.consume(export_request(router_span(**{"gen_ai.usage.input_tokens": 40}))))
    clock.t = 1.0
    asyncio.run(pipe.consume(timed_request(vllm_request_span())))
    assert sink.requests == []  # both held: one request, waiting for history
    for b in a.batches(range(10, 25), {15: [removed(H)]}):
        index.apply(b)
    clock.t = 2.0
    pipe.poll()
    assert labelled(sink) == {"router": "evicted"} and len(sink.spans()) == 2
    assert pipe.stats.unenriched["facts_incomplete"] == 0


def test_two_requests_of_one_trace_with_unrelated_ids_stay_two_verdicts():
    clock = Clock(0.0)
    pipe, sink = make(ResidencyIndex(), clock, judge_on_arrival=True)
    hit = {"name": "router", "gen_ai.usage.input_tokens": 40, "gen_ai.usage.cache_read.input_tokens": 32}
    asyncio.run(pipe.consume(export_request({**hit, "gen_ai.request.id": "agent-step-1"})))
    asyncio.run(pipe.consume(export_request({**hit, "gen_ai.request.id": "agent-step-2"})))
    assert sum(pipe.stats.verdicts.values()) == 2 and pipe.stats.unenriched["request_already_judged"] == 0


def test_judged_requests_expire_after_keep_s_and_are_bounded():
    from kvmiss.enricher.otlp.assembly import Assembly, Fragment, JudgedRequests
    from kvmiss.enricher.otlp.spans import SpanFacts

    def assembly(trace: bytes, *ids: str) -> Assembly:
        a = Assembly(trace, ids[0], 0.0)
        a.fragments.extend(Fragment(SpanFacts(request_id=i), None, None) for i in ids)
        return a

    judged = JudgedRequests(keep_s=10.0, max_traces=2)
    judged.add(assembly(b"t1", "r1"), b"s1", {"kvmiss.label": "hit"}, now=0.0)
    judged.add(assembly(b"t1", "r2"), b"s2", {"kvmiss.label": "no_match"}, now=1.0)
    assert judged.judged_request(assembly(b"t1", "r1")).span_id == b"s1"  # same id
    assert judged.judged_request(assembly(b"t1", "r2-abcdefgh")).span_id == b"s2"  # extends it
    assert judged.judged_request(assembly(b"t1", "x")) is None
    assert judged.judged_request(assembly(b"t2", "r1")) is None  # another trace
    judged.expire(10.5)
    assert judged.judged_request(assembly(b"t1", "r1")) is not None  # t1 last judged at 1.0
    judged.touch(b"t1", 11.0)  # more of the trace's spans came: kept keep_s from then
    judged.expire(11.5)
    assert judged.judged_request(assembly(b"t1", "r1")) is not None
    judged.expire(21.5)
    assert len(judged) == 0
    for i, trace in enumerate((b"a", b"b", b"c")):
        judged.add(assembly(trace, "r"), b"s", {}, now=20.0 + i)
    assert len(judged) == 2 and judged.forgotten_early == 1


# --- an enriched span carries kvmiss's outputs only ------------------------------------------------


def _enrich(span_spec: dict, *, wire: bool) -> tuple[dict, Pipeline]:
    from kvmiss.enricher.otlp.spans import WIRE_SCAN

    if wire and not WIRE_SCAN:
        pytest.skip("the compiled wire path is not built")
    index, _ = evicted_history()
    pipe, sink = make(index, Clock(), judge_on_arrival=True)
    request = export_request(dict(span_spec))
    asyncio.run(pipe.consume(request, request.SerializeToString() if wire else None))
    (span,) = [s for r in sink.requests for s in _spans_of(r)]
    return {k: v for k, v in attrs(span).items() if k.startswith("kvmiss.") or k == "app.keep"}, pipe


def _spans_of(request) -> list:
    if not isinstance(request, ExportTraceServiceRequest):  # an EncodedRequest: written as bytes
        parsed = ExportTraceServiceRequest()
        parsed.ParseFromString(request.body)
        request = parsed
    return [s for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans]


@pytest.mark.parametrize("wire", [False, True], ids=["message", "bytes"])
@pytest.mark.parametrize("verdict", ["hit", "evicted"])
@pytest.mark.parametrize("name", names.OUTPUTS)
def test_every_stale_output_name_is_replaced_by_exactly_the_verdicts_own(name, verdict, wire):
    span = router_span(**{"gen_ai.usage.input_tokens": 40, "app.keep": "yes"})
    if verdict == "hit":
        span["gen_ai.usage.cache_read.input_tokens"] = 32
    clean, _ = _enrich(span, wire=wire)
    foreign = {name: 4096 if name != names.LABEL else "hit", names.MISSED_TOKENS: 4096}
    stale, pipe = _enrich({**span, **foreign}, wire=wire)
    assert stale == clean  # exactly what kvmiss decided, whether or not the verdict writes the name
    assert clean["kvmiss.label"] == verdict and clean["app.keep"] == "yes"
    assert pipe.stats.foreign_outputs == len(foreign)


@pytest.mark.parametrize("wire", [False, True], ids=["message", "bytes"])
def test_a_span_kvmiss_does_not_enrich_keeps_its_kvmiss_attributes(wire):
    from kvmiss.enricher.otlp.spans import WIRE_SCAN

    if wire and not WIRE_SCAN:
        pytest.skip("the compiled wire path is not built")
    pipe, sink = make(ResidencyIndex(), Clock())
    request = export_request({"name": "db", names.LABEL: "hit", names.MISSED_TOKENS: 7})
    asyncio.run(pipe.consume(request, request.SerializeToString() if wire else None))
    (span,) = [s for r in sink.requests for s in _spans_of(r)]
    assert attrs(span) == {names.LABEL: "hit", names.MISSED_TOKENS: 7} and pipe.stats.foreign_outputs == 0


# --- part of the fleet unsubscribed: those workers are unresolved holders, never absent --------


def two_worker_fleet():
    index, a, b = ResidencyIndex(["A", "B"]), WorkerFeed("A", ts0=1000.0), WorkerFeed("B", ts0=1000.0)
    for batch in a.batches(range(0, 30)):
        index.apply(batch)
    for batch in b.batches(range(0, 30), {3: [stored(H)]}):  # B holds H from 1003 on
        index.apply(batch)
    return index


def miss(worker: str, request_id: str, block: int = 77) -> dict:
    return {"name": "router", "trace_id": os.urandom(16), "gen_ai.request.id": request_id,
            "gen_ai.usage.input_tokens": 40, "gen_ai.usage.cache_read.input_tokens": 16,
            "kvmiss.route.worker": worker, "kvmiss.block_hashes": [7, block, 9],
            "kvmiss.lookup_time_unix_nano": int(1020.5e9)}


def test_a_span_named_worker_no_replica_follows_leaves_other_misses_unknown_not_no_match():
    index = two_worker_fleet()
    clock = Clock(0.0)
    pipe, sink = make(index, clock, judge_on_arrival=True, unsubscribed_keep_s=60.0)
    asyncio.run(pipe.consume(export_request(miss("A", "before"))))
    asyncio.run(pipe.consume(export_request(miss("C", "on-c"))))  # C: part of the fleet, not in [[workers]]
    asyncio.run(pipe.consume(export_request(miss("A", "after"))))
    asyncio.run(pipe.consume(export_request(miss("A", "routed", block=H - 2**64))))  # B holds H
    out = {attrs(s)["kvmiss.label"]: attrs(s) for s in sink.spans()}
    labels = [attrs(s)["kvmiss.label"] for s in sink.spans()]
    assert labels == ["no_match", "unknown_history", "unknown_history", "routing_miss"]
    after = attrs(sink.spans()[2])
    assert after["kvmiss.history"] == "untracked" and "not subscribed to" in after["kvmiss.reason"]
    assert out["routing_miss"]["kvmiss.holders"] == 1  # a holder proven by a followed worker stands
    clock.t = 61.0
    pipe.poll()  # no span has named C for longer than unsubscribed_keep_s
    asyncio.run(pipe.consume(export_request(miss("A", "later"))))
    assert attrs(sink.spans()[-1])["kvmiss.label"] == "no_match" and pipe.unsubscribed == {}


# --- what-if estimates beside an evicted verdict ---------------------------------------------------


def test_an_evicted_miss_carries_the_estimate_beside_its_label_and_feeds_the_per_worker_counters():
    from fleet_builders import evicting_worker

    index, _ = evicting_worker(3)
    sink = Sink()
    pipe = Pipeline(Attributor(index), sink, clock=Clock(), judge_on_arrival=True, pool_blocks={"A": 9})
    asyncio.run(pipe.consume(export_request(router_span(**{"gen_ai.usage.input_tokens": 40}))))
    a = attrs(sink.spans()[0])
    assert a["kvmiss.label"] == "evicted"
    assert a["kvmiss.whatif.scale"] == "1.5" and a["kvmiss.whatif.reuse_distance_blocks"] == 4
    assert pipe.stats.whatif_evicted_tokens == {"A": 16}
    assert pipe.stats.whatif_kept_tokens == {("A", "1.5"): 16, ("A", "2"): 16, ("A", "4"): 16, ("A", "8"): 16}
    plain = Pipeline(Attributor(evicting_worker(3)[0]), Sink(), clock=Clock(), judge_on_arrival=True)
    asyncio.run(plain.consume(export_request(router_span(**{"gen_ai.usage.input_tokens": 40}))))
    assert "kvmiss.whatif.scale" not in attrs(plain.sink.spans()[0])  # no pool size: no estimate


# --- what-if facts (finish time, output tokens): read, merged, and never part of a verdict ---------


def _judge_all(requests: list, *, wire: bool, index=None) -> tuple[list, Sink, Pipeline]:
    """Every request through one pipeline (on its bytes or the parsed message); the facts
    each verdict was given, the sink, the pipeline."""
    from kvmiss.enricher.otlp.spans import WIRE_SCAN

    if wire and not WIRE_SCAN:
        pytest.skip("the compiled wire path is not built")
    judged: list = []
    pipe, sink = make(index if index is not None else evicted_history()[0], Clock(), judge_on_arrival=True,
                      on_verdict=lambda facts, verdict, trace: judged.append((facts, verdict)))
    for request in requests:
        asyncio.run(pipe.consume(request, request.SerializeToString() if wire else None))
    pipe.poll(final=True)
    return judged, sink, pipe


@pytest.mark.parametrize("wire", [False, True], ids=["message", "bytes"])
def test_finish_time_and_output_tokens_come_from_llm_request_over_the_router_span(wire):
    router = router_span(end=int(1022.75e9), **{"gen_ai.usage.output_tokens": 99})
    del router["kvmiss.lookup_time_unix_nano"]
    engine = vllm_request_span(end=int(1021.5e9), **{"gen_ai.usage.completion_tokens": 42})
    transfer = {"name": "kv_transfer", "gen_ai.request.id": "r1", "kvmiss.transfer.result": "completed",
                "end": int(1020.4e9)}
    # The router's span first, as it usually comes: the engine's still win these two facts.
    (facts, _), = _judge_all([export_request(router, transfer), timed_request(engine)], wire=wire)[0]
    assert facts.finish_time == pytest.approx(1021.5) and facts.output_tokens == 42
    assert facts.lookup_time == pytest.approx(1020.5)  # the same span's clock


@pytest.mark.parametrize("wire", [False, True], ids=["message", "bytes"])
def test_without_llm_request_the_router_span_gives_them_and_a_transfer_span_never_does(wire):
    transfer = {"name": "kv_transfer", "gen_ai.request.id": "r1", "kvmiss.transfer.result": "failed",
                "end": int(1020.4e9), "gen_ai.usage.output_tokens": 5}
    router = router_span(end=int(1022.75e9), **{"gen_ai.usage.input_tokens": 40, "gen_ai.usage.output_tokens": 99})
    (facts, _), = _judge_all([export_request(transfer, router)], wire=wire)[0]
    assert facts.finish_time == pytest.approx(1022.75)  # the transfer span came first, and ended early
    assert facts.output_tokens == 5  # a count is a count: the first span that has one
    (bare, _), = _judge_all([export_request(router_span(**{"gen_ai.usage.input_tokens": 40}))], wire=wire)[0]
    assert bare.finish_time is None and bare.output_tokens is None  # no end time, no count: left out


def test_the_plugins_lookup_span_never_gives_the_finish_time():
    lookup = {"name": names.PREFIX_LOOKUP_SPAN, "gen_ai.request.id": "r1-abcdefgh", "gen_ai.usage.input_tokens": 40,
              "kvmiss.cached_tokens": 16, "kvmiss.route.worker": "A", "kvmiss.block_hashes": [7, H - 2**64, 9],
              "kvmiss.lookup_time_unix_nano": int(1020.5e9), "end": int(1020.5e9) + 50_000}
    (alone, _), = _judge_all([export_request(dict(lookup))], wire=False)[0]
    assert alone.finish_time is None
    engine = vllm_request_span(end=int(1021.5e9), **{"gen_ai.usage.completion_tokens": 42})
    (joined, _), = _judge_all([export_request(dict(lookup)), timed_request(engine)], wire=False)[0]
    assert joined.finish_time == pytest.approx(1021.5) and joined.output_tokens == 42


@pytest.mark.parametrize("wire", [False, True], ids=["message", "bytes"])
def test_a_span_carrying_only_token_usage_passes_straight_through_as_before(wire):
    """An LLM client's span with its completion count is no request kvmiss could judge: it is
    neither held nor labelled, and joins no request."""
    client = {"name": "openai.chat", "gen_ai.usage.output_tokens": 7, "end": int(1030e9)}
    judged, sink, pipe = _judge_all([export_request(dict(client))], wire=wire)
    assert judged == [] and len(sink.requests) == 1 and _verdict_outputs(sink) == [{}]
    assert pipe.stats.unenriched == {} and pipe.pending_spans == 0
    router = router_span(**{"gen_ai.usage.input_tokens": 40})
    (facts, _), = _judge_all([export_request(dict(client), router)], wire=wire)[0]
    assert facts.output_tokens is None and facts.finish_time is None  # it did not join the request


def _verdict_outputs(sink: Sink) -> list[dict]:
    return [{k: v for k, v in attrs(s).items() if k.startswith("kvmiss.")} for r in sink.requests for s in _spans_of(r)]


@pytest.mark.parametrize("wire", [False, True], ids=["message", "bytes"])
@pytest.mark.parametrize("cached", [16, 32], ids=["evicted", "hit"])
def test_the_verdict_is_the_same_with_and_without_finish_time_and_output_tokens(cached, wire):
    def requests(whatif: bool) -> list:
        extra_router = {"end": int(1022.75e9), "gen_ai.usage.output_tokens": 99} if whatif else {}
        extra_engine = {"end": int(1021.5e9), "gen_ai.usage.completion_tokens": 42} if whatif else {}
        router = router_span(**{"gen_ai.usage.cache_read.input_tokens": cached, **extra_router})
        del router["kvmiss.lookup_time_unix_nano"]
        return [export_request(router), timed_request(vllm_request_span(**extra_engine))]

    with_facts, with_sink, _ = _judge_all(requests(True), wire=wire)
    without, without_sink, _ = _judge_all(requests(False), wire=wire)
    assert with_facts[0][0].finish_time is not None and without[0][0].finish_time is None
    assert [v for _, v in with_facts] == [v for _, v in without]
    assert _verdict_outputs(with_sink) == _verdict_outputs(without_sink)
    assert with_facts[0][1].label.value == ("hit" if cached == 32 else "evicted")


def re_announced_then_removed():
    """H-1, H stored at 3 (counted), stored again with no parent at 6 (a full-report request's
    re-announcement, or a second copy), H removed at 15."""
    index, a = ResidencyIndex(), WorkerFeed("A", ts0=1000.0)
    for b in a.batches(range(0, 30), {3: [stored(H - 1, H)], 6: [stored(H - 1, H)], 15: [removed(H)]}):
        index.apply(b)
    return index, a


def miss_span(a: WorkerFeed) -> dict:
    """A request that hit H-1 and missed H at step 20."""
    return {"name": "router", "trace_id": b"m" * 16, "gen_ai.request.id": "m", "gen_ai.usage.input_tokens": 40,
            "gen_ai.usage.cache_read.input_tokens": 16, "kvmiss.route.worker": "A",
            "kvmiss.block_hashes": [H - 1 - 2**64, H - 2**64, 9], "kvmiss.lookup_time_unix_nano": int((a.ts(20) - 0.5) * 1e9)}


def reporter_span(a: WorkerFeed) -> dict:
    """The request whose re-announcement the store at 6 was: it hit H-1, H in that step."""
    return {"name": "router", "trace_id": b"r" * 16, "gen_ai.request.id": "r", "gen_ai.usage.input_tokens": 33,
            "gen_ai.usage.cache_read.input_tokens": 32, "kvmiss.route.worker": "A",
            "kvmiss.block_hashes": [H - 1 - 2**64, H - 2**64, 0xDEAD], "kvmiss.kv_cache_report_mode": "full",
            "kvmiss.lookup_time_unix_nano": int((a.ts(6) - 0.5) * 1e9)}


def test_a_verdict_resting_on_a_store_a_later_request_confirms_waits_for_it():
    """Concurrent requests' spans come in any order: the miss is judged first, while the store
    at 6 may still be a second copy (unknown). It is held, not exported, and settled as
    `evicted` once the request that re-announced it is noted, seconds later."""
    index, a = re_announced_then_removed()
    clock = Clock(0.0)
    pipe, sink = make(index, clock, assemble_wait_s=10.0, judge_on_arrival=True)
    asyncio.run(pipe.consume(export_request(miss_span(a))))
    assert sink.requests == [] and pipe.stats.held_for_confirmation == 1
    clock.t = 4.0
    asyncio.run(pipe.consume(export_request(reporter_span(a))))
    pipe.poll()
    labels = {attrs(s)["gen_ai.request.id"]: attrs(s)["kvmiss.label"] for s in sink.spans()}
    assert labels == {"m": "evicted", "r": "hit"} and pipe.stats.settled_by_confirmation == 1


def test_requests_of_one_round_are_noted_before_any_is_judged():
    index, a = re_announced_then_removed()
    pipe, sink = make(index, Clock(0.0), assemble_wait_s=10.0)
    asyncio.run(pipe.consume(export_request(miss_span(a), reporter_span(a))))
    assert pipe.poll() == 2
    assert {attrs(s)["gen_ai.request.id"]: attrs(s)["kvmiss.label"] for s in sink.spans()} == {"m": "evicted", "r": "hit"}
    assert pipe.stats.held_for_confirmation == 0


def test_a_held_verdict_whose_confirmation_never_comes_leaves_unknown_after_the_wait():
    index, a = re_announced_then_removed()
    clock = Clock(0.0)
    pipe, sink = make(index, clock, assemble_wait_s=10.0, judge_on_arrival=True)
    asyncio.run(pipe.consume(export_request(miss_span(a))))
    clock.t = 9.0
    assert pipe.poll() == 0 and sink.requests == []
    clock.t = 10.0
    assert pipe.poll() == 1
    out = attrs(sink.spans()[0])
    assert out["kvmiss.label"] == "unknown_history" and "re-announce" in out["kvmiss.reason"]
