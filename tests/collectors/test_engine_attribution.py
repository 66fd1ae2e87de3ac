"""A TensorRT-LLM worker end to end: its stream over a real PUB socket, `kvmiss serve`'s
subscriber and index, a router's spans over OTLP, the labels on the spans that come out.

TensorRT-LLM's hashes are not vLLM's chained hashes, so the router must send the engine's own
wire hashes (signed int64, as OTel ints are) in ``kvmiss.block_hashes``; token ids alone get an
unknown label that says so, never a chain hashed with the configured vLLM algorithm. Frames are
built to TensorRT-LLM's layout (tests/peers/engine_wires.py)."""

from __future__ import annotations

import time

import pytest
from engine_wires import WirePublisher, signed, trt_payload, trt_removed, trt_stored
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from otlp_sink import OtlpSink, attributes
from running_service import RunningService
from zmq_ports import free_tcp

from kvmiss.collectors.engines import ADAPTERS
from kvmiss.enricher.core.hashing import BlockHasher
from kvmiss.enricher.otlp.assembly import Assembly, Fragment, to_request_facts
from kvmiss.enricher.otlp.spans import SpanFacts
from kvmiss.schemas.config import parse_config

P, H, Q = 0xF000_0000_0000_0001, 0x8000_0000_0000_00AA, 0x0000_0000_0000_0BAD  # H: negative on the wire


@pytest.fixture
def sink():
    s = OtlpSink()
    yield s
    s.close()


def config_text(endpoint: str, replay: str, sink_endpoint: str) -> str:
    return f"""
[otlp]
grpc = "127.0.0.1:0"
http = "127.0.0.1:0"
[export]
endpoint = "{sink_endpoint}"
[engine]
block_size = 4
[privacy]
digest_key = "engine-attribution-test-key"
[metrics]
listen = "127.0.0.1:0"
[history]
wait_s = 1.0
assemble_wait_s = 2.0
[[workers]]
id = "trt0"
endpoint = "{endpoint}"
replay_endpoint = "{replay}"
engine = "trtllm"
"""


def send(port: int, requests: list[dict]) -> None:
    provider = TracerProvider(resource=Resource.create({"service.name": "router"}))
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=f"http://127.0.0.1:{port}/v1/traces")))
    tracer = provider.get_tracer("router")
    for attrs in requests:
        with tracer.start_as_current_span("route", attributes=attrs):
            pass
    provider.shutdown()


def route(rid: str, lookup: float, **chain) -> dict:
    return {"gen_ai.request.id": rid, "kvmiss.route.worker": "trt0", "gen_ai.usage.prompt_tokens": 12,
            "gen_ai.usage.cache_read.input_tokens": 4, "kvmiss.lookup_time_unix_nano": int(lookup * 1e9), **chain}


def test_a_router_sending_tensorrt_llm_wire_hashes_gets_the_labels_the_stream_proves(sink):
    endpoint, replay = free_tcp(), free_tcp()
    pub = WirePublisher("trtllm", endpoint, replay)
    running = RunningService(parse_config(config_text(endpoint, replay, sink.endpoint)))
    try:
        svc = running.service
        t0 = time.time()
        time.sleep(0.3)
        pub.publish(trt_payload(t0, [trt_stored([P, H], None, list(range(8)))]))  # one coalesced store
        pub.publish(trt_payload(t0 + 0.01, [trt_removed([H])]))
        for k in range(2, 6):  # later steps: the stream's history passes the lookup time
            pub.publish(trt_payload(t0 + 0.01 * k, [trt_stored([900 + k], None, [k] * 4)]))
        deadline = time.monotonic() + 10
        while not svc.ready()[0] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert svc.ready()[0], svc.ready()[1]
        lookup = t0 + 0.035
        send(svc.receivers.http_port, [
            route("evicted", lookup, **{"kvmiss.block_hashes": [signed(P), signed(H), 7]}),
            route("never", lookup, **{"kvmiss.block_hashes": [signed(P), Q, 7]}),
            route("tokens-only", lookup, **{"kvmiss.token_ids": list(range(12))}),
        ])
        spans = {attributes(s)["gen_ai.request.id"]: attributes(s) for s in sink.wait_for_spans(3)}
    finally:
        running.stop()
        pub.close()
    assert {rid: a.get("kvmiss.label") for rid, a in spans.items()} == {
        "evicted": "evicted", "never": "no_match", "tokens-only": "unknown_history"}
    assert spans["evicted"]["kvmiss.first_miss_block"] == 1
    assert "TensorRT-LLM" in spans["tokens-only"]["kvmiss.reason"]
    assert "kvmiss.block_hashes" in spans["tokens-only"]["kvmiss.reason"]
    assert all("kvmiss.token_ids" not in a for a in spans.values())


def test_token_ids_for_an_engine_kvmiss_cannot_hash_are_never_hashed():
    """Unit level: the same span's token ids give a vLLM chain for a vLLM worker and none,
    with the engine's reason, for a TensorRT-LLM or ATOM one."""
    hasher = BlockHasher("sha256_cbor", seed="0", block_size=4)
    engines = {"v": "vllm", "t": "trtllm", "a": "atom"}

    def facts(worker: str):
        span = SpanFacts(request_id="r", prompt_tokens=12, cached_tokens=4, worker=worker,
                         token_ids=list(range(12)), lookup_time=1.0)
        assembly = Assembly(b"t" * 16, "r", first_seen=0.0, fragments=[Fragment(span, None, None)])
        return to_request_facts(assembly, hasher=hasher, default_block_size=4, errors=[],
                                unhashable=lambda w: ADAPTERS[engines[w]].token_hashing)

    v, t, a = facts("v"), facts("t"), facts("a")
    assert v.block_hashes is not None and len(v.block_hashes) == 3 and v.chain_unavailable is None
    assert t.block_hashes is None and "TensorRT-LLM" in t.chain_unavailable
    assert a.block_hashes is None and "xxh64" in a.chain_unavailable
