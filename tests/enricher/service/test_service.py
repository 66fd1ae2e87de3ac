"""`kvmiss serve` end to end with real parts: the real SGLang publisher feeding events over
ZeroMQ, the OTel SDK's real OTLP exporter sending spans, kvmiss in between, a real OTLP/HTTP
sink behind it. Checks the labels that arrive, the metrics and readiness."""

from __future__ import annotations

import asyncio
import contextlib
import time
import urllib.request

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from otlp_sink import OtlpSink, attributes
from raw_clients import read_until_closed, until
from running_service import RunningService
from sglang_publisher import batch

from kvmiss.enricher.otlp.listener import ConnectionBounds
from kvmiss.enricher.otlp.receiver import parse_otlp_json
from kvmiss.enricher.service import health_endpoint
from kvmiss.enricher.service.serve import Service
from kvmiss.schemas.config import ConfigError, parse_config

P, H, Q, R = 1001, 1002, 1003, 1004  # block hashes: parent, evicted, never stored, on w1


@pytest.fixture
def sink():
    s = OtlpSink()
    yield s
    s.close()


def make_config(eps, sink_endpoint: str, file: str | None = None) -> str:
    workers = "".join(
        f'[[workers]]\nid = "{w}"\nendpoint = "{ep}"\nreplay_endpoint = "{rep}"\n' for w, (ep, rep) in eps.items())
    also = f'file = "{file}"' if file else ""
    return f"""
[otlp]
grpc = "127.0.0.1:0"
http = "127.0.0.1:0"
[export]
endpoint = "{sink_endpoint}"
{also}
[engine]
block_size = 16
[privacy]
digest_key = "service-test-secret-0001"
[metrics]
listen = "127.0.0.1:0"
[history]
wait_s = 1.0
assemble_wait_s = 2.0
{workers}"""


def send_spans(http_port: int, requests: list[dict]) -> None:
    """Each request: a router span (kvmiss inputs) and a child llm_request span (vLLM's)."""
    provider = TracerProvider(resource=Resource.create({"service.name": "router"}))
    provider.add_span_processor(SimpleSpanProcessor(
        OTLPSpanExporter(endpoint=f"http://127.0.0.1:{http_port}/v1/traces")))
    tracer = provider.get_tracer("test-router")
    for req in requests:
        with tracer.start_as_current_span("route", attributes=req["router"]):
            with tracer.start_as_current_span("llm_request", kind=trace.SpanKind.SERVER,
                                              attributes=req["engine"]):
                pass
    with tracer.start_as_current_span("health-check", attributes={"http.route": "/health"}):
        pass
    provider.shutdown()


def router_attrs(rid: str, worker: str, chain: list[int], cached: int, lookup: float) -> dict:
    return {"gen_ai.request.id": rid, "kvmiss.route.worker": worker, "kvmiss.route.policy": "prefix",
            "gen_ai.usage.cache_read.input_tokens": cached, "kvmiss.block_hashes": chain,
            "kvmiss.lookup_time_unix_nano": int(lookup * 1e9),
            "kvmiss.token_ids": [1, 2, 3]}


def test_labels_arrive_downstream_on_the_routers_spans(fleet, sink, tmp_path):
    eps, pubs = fleet
    file = tmp_path / "spans.jsonl"  # a second exporter: the same requests reach both
    running = RunningService(parse_config(make_config(eps, sink.endpoint, str(file))))
    try:
        svc = running.service
        t0 = time.time()
        time.sleep(0.3)  # let SUB subscriptions reach the publishers (replay covers the rest)
        pubs["w0"].publish(batch(t0, stored=[([P, H], None)]))
        pubs["w0"].publish(batch(t0 + 0.01, removed=[[H]]))
        pubs["w1"].publish(batch(t0, stored=[([P, R], None)]))
        for k in range(2, 6):
            pubs["w0"].publish(batch(t0 + 0.01 * k))
            pubs["w1"].publish(batch(t0 + 0.01 * k))
        deadline = time.monotonic() + 10
        while not svc.ready()[0] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert svc.ready()[0], svc.ready()[1]
        lookup = t0 + 0.035
        send_spans(svc.receivers.http_port, [
            {"router": router_attrs("evicted", "w0", [P, H, 7], 16, lookup), "engine": {"gen_ai.request.id": "evicted", "gen_ai.usage.prompt_tokens": 40}},
            {"router": router_attrs("never", "w0", [P, Q, 7], 16, lookup), "engine": {"gen_ai.request.id": "never", "gen_ai.usage.prompt_tokens": 40}},
            {"router": router_attrs("routing", "w0", [P, R, 7], 16, lookup), "engine": {"gen_ai.request.id": "routing", "gen_ai.usage.prompt_tokens": 40}},
            {"router": router_attrs("lagging", "w0", [P, H, 7], 16, t0 + 100), "engine": {"gen_ai.request.id": "lagging", "gen_ai.usage.prompt_tokens": 40}},
        ])
        sink.wait_for_spans(9)
        # Last, once the others are judged: a span naming a worker no [[workers]] entry
        # follows makes every miss judged after it unknown (that worker may hold the block).
        send_spans(svc.receivers.http_port, [
            {"router": router_attrs("unknown-worker", "w9", [P, H, 7], 16, lookup), "engine": {"gen_ai.request.id": "unknown-worker", "gen_ai.usage.prompt_tokens": 40}},
        ])
        spans = sink.wait_for_spans(12)
        assert len(spans) == 12  # every span out exactly once, enriched or not
        labels = {attributes(s)["gen_ai.request.id"]: attributes(s).get("kvmiss.label")
                  for s in spans if s.name == "route"}
        assert labels == {"evicted": "evicted", "never": "no_match", "routing": "routing_miss",
                          "lagging": "unknown_history", "unknown-worker": "unknown_history"}
        for s in spans:
            a = attributes(s)
            assert "kvmiss.token_ids" not in a and "kvmiss.block_hashes" not in a
            if s.name != "route":
                assert "kvmiss.label" not in a
        evicted = next(attributes(s) for s in spans if attributes(s).get("gen_ai.request.id") == "evicted" and s.name == "route")
        assert evicted["kvmiss.first_miss_block"] == 1 and evicted["kvmiss.owner"] == "platform"
        assert evicted["kvmiss.first_miss_digest"].count(":") == 1
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{svc.metrics_port}/metrics").read().decode()
        assert 'kvmiss_requests_total{label="evicted",owner="platform",route_policy="prefix",worker="w0"} 1.0' in metrics
        assert "kvmiss_stream_batches_applied_total" in metrics
        assert 'kvmiss_export_spans_delivered_total{exporter="http"}' in metrics
        for forbidden in (str(H), "evicted\",trace", "service-test-secret"):
            assert forbidden not in metrics
        ready = urllib.request.urlopen(f"http://127.0.0.1:{svc.metrics_port}/readyz")
        assert ready.status == 200
        deadline = time.monotonic() + 10
        while not (file.exists() and len(_file_spans(file)) == 12) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sorted(s.SerializeToString(deterministic=True) for s in _file_spans(file)) == sorted(
            s.SerializeToString(deterministic=True) for s in spans)
    finally:
        running.stop()


def _file_spans(path) -> list:
    requests = [parse_otlp_json(line.encode()) for line in path.read_text().splitlines()]
    return [s for r in requests for rs in r.resource_spans for ss in rs.scope_spans for s in ss.spans]


def test_judged_requests_leave_request_records_with_the_engines_finish_and_no_prompt_material(fleet, sink, tmp_path):
    """[export] request_records: real spans from the OTel SDK's OTLP exporter in, one line per
    judged request out, read back by `kvmiss attribute`'s reader -- the finish time is vLLM's
    span end, no token id is written -- and the file's metrics on /metrics."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from kvmiss.enricher.service.offline import read_requests

    eps, pubs = fleet
    path = tmp_path / "requests.jsonl"
    config = make_config(eps, sink.endpoint).replace("[engine]", f'request_records = "{path}"\n[engine]')
    running = RunningService(parse_config(config))
    try:
        svc = running.service
        t0 = time.time()
        time.sleep(0.3)
        pubs["w0"].publish(batch(t0, stored=[([P, H], None)]))
        for k in range(1, 6):
            pubs["w0"].publish(batch(t0 + 0.01 * k))
            pubs["w1"].publish(batch(t0 + 0.01 * k))
        lookup = t0 + 0.035
        memory = InMemorySpanExporter()
        provider = TracerProvider(resource=Resource.create({"service.name": "router"}))
        provider.add_span_processor(SimpleSpanProcessor(memory))
        provider.add_span_processor(SimpleSpanProcessor(
            OTLPSpanExporter(endpoint=f"http://127.0.0.1:{svc.receivers.http_port}/v1/traces")))
        tracer = provider.get_tracer("test-router")
        for rid, cached, out in (("hit", 32, 7), ("miss", 16, 40)):
            with tracer.start_as_current_span("route", attributes=router_attrs(rid, "w0", [P, H, 7], cached, lookup)):
                time.sleep(0.01)
                with tracer.start_as_current_span("llm_request", kind=trace.SpanKind.SERVER, attributes={
                        "gen_ai.request.id": rid, "gen_ai.usage.prompt_tokens": 40,
                        "gen_ai.usage.completion_tokens": out, "gen_ai.latency.time_in_queue": 0.001}):
                    time.sleep(0.01)
                time.sleep(0.01)  # the router's span ends later: the engine's end is the finish
        provider.shutdown()
        sink.wait_for_spans(4)
        assert svc.request_records.force_flush()
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{svc.metrics_port}/metrics").read().decode()
    finally:
        running.stop()
    ends = {s.attributes["gen_ai.request.id"]: s.end_time / 1e9 for s in memory.get_finished_spans()
            if s.name == "llm_request"}
    with open(path, "rb") as lines:
        records = {r.request_id: r for r in read_requests(lines)}
    assert set(records) == {"hit", "miss"}
    for rid, out in (("hit", 7), ("miss", 40)):
        r = records[rid]
        assert (r.worker, r.block_hashes, r.output_tokens) == ("w0", [P, H, 7], out)
        assert r.finish_time == pytest.approx(ends[rid], abs=1e-6) and r.lookup_time == pytest.approx(lookup)
        assert r.token_ids is None and r.extra_keys is None
    text = path.read_text()
    assert "token_ids" not in text and "[1,2,3]" not in text  # the router's opt-in token ids stay in memory
    assert "kvmiss_request_records_written_total 2.0" in metrics
    assert 'kvmiss_request_records_dropped_total{reason="write_error"} 0.0' in metrics


def test_a_bad_worker_endpoint_is_refused_with_the_worker_and_key_named(sink):
    with pytest.raises(ConfigError) as info:
        parse_config(make_config({"w0": ("tcp://127.0.0.1", None)}, sink.endpoint)
                     .replace('replay_endpoint = "None"\n', ""))
    assert "workers[0] (id 'w0').endpoint: 'tcp://127.0.0.1' has no port" in str(info.value)


# --- the /metrics, /healthz, /readyz listener: bounded like the OTLP receiver ------------------

ENDPOINT_ONLY = """
[otlp]
grpc = ""
http = ""
[privacy]
digest_key = "service-test-secret-0001"
[metrics]
listen = "127.0.0.1:0"
"""






async def scrape(port: int, path: str = "/metrics") -> tuple[int, str]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: kvmiss\r\nConnection: close\r\n\r\n".encode())
    answer = await read_until_closed(reader)
    writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode()


@contextlib.asynccontextmanager
async def metrics_endpoint():
    service = Service(parse_config(ENDPOINT_ONLY))
    await service.start()
    try:
        yield service
    finally:
        await service.shutdown(timeout=2)


class TestMetricsEndpointBounds:
    def test_connections_past_its_small_cap_are_closed_and_counted(self, monkeypatch):
        monkeypatch.setattr(health_endpoint, "BOUNDS", ConnectionBounds(max_connections=2, idle_s=60.0))

        async def scenario():
            async with metrics_endpoint() as service:
                port = service.metrics_port
                held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
                assert await until(lambda: service.health.listener.connections == 2)
                extra_reader, extra_writer = await asyncio.open_connection("127.0.0.1", port)
                extra = await read_until_closed(extra_reader)
                extra_writer.close()
                for _, writer in held:
                    writer.close()
                assert await until(lambda: service.health.listener.connections == 0)
                return extra, await scrape(port)

        extra, (status, text) = asyncio.run(scenario())
        assert extra == b"" and status == 200
        assert "kvmiss_metrics_http_connections_refused_total 1.0" in text
        assert "kvmiss_metrics_http_connections 1.0" in text  # the scrape itself

    @pytest.mark.parametrize("method, path", [("GET", "/healthz"), ("POST", "/metrics"), ("GET", "/nowhere")])
    def test_a_body_over_4_kib_is_refused_413_and_the_connection_closed(self, method, path):
        async def scenario():
            async with metrics_endpoint() as service:
                reader, writer = await asyncio.open_connection("127.0.0.1", service.metrics_port)
                writer.write(f"{method} {path} HTTP/1.1\r\nHost: kvmiss\r\nContent-Length: 100000\r\n\r\n".encode()
                             + b"x" * 1000)  # the rest never comes: no need to wait for it
                answer = await read_until_closed(reader)
                writer.close()
                return answer, await scrape(service.metrics_port)

        answer, (_, text) = asyncio.run(scenario())
        assert answer is not None and answer.startswith(b"HTTP/1.1 413")
        assert 'kvmiss_metrics_http_requests_refused_total{reason="too_large"} 1.0' in text

    def test_a_small_body_on_a_get_is_read_and_ignored(self):
        async def scenario():
            async with metrics_endpoint() as service:
                reader, writer = await asyncio.open_connection("127.0.0.1", service.metrics_port)
                writer.write(b"GET /healthz HTTP/1.1\r\nHost: kvmiss\r\nContent-Length: 100\r\n"
                             b"Connection: close\r\n\r\n" + b"x" * 100)
                answer = await read_until_closed(reader)
                writer.close()
                return answer

        answer = asyncio.run(scenario())
        assert answer is not None and answer.startswith(b"HTTP/1.1 200") and answer.endswith(b'{"status": "ok"}')

    def test_a_trickled_body_is_answered_408_and_a_trickled_header_cut_off(self, monkeypatch):
        monkeypatch.setattr(health_endpoint, "BOUNDS", ConnectionBounds(max_connections=1, idle_s=1.0))
        monkeypatch.setattr(health_endpoint, "BODY_TIMEOUT_S", 0.5)

        async def trickle(writer, data: bytes) -> None:
            with contextlib.suppress(ConnectionError, OSError):
                for i in range(len(data)):
                    writer.write(data[i:i + 1])
                    await writer.drain()
                    await asyncio.sleep(0.05)

        async def slow(port: int, head: bytes, rest: bytes) -> bytes | None:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(head)
            sending = asyncio.ensure_future(trickle(writer, rest))
            answer = await read_until_closed(reader)
            sending.cancel()
            writer.close()
            return answer

        async def scenario():
            async with metrics_endpoint() as service:
                port, listener = service.metrics_port, service.health.listener
                body = await slow(port, b"GET /healthz HTTP/1.1\r\nHost: kvmiss\r\nContent-Length: 2000\r\n\r\n",
                                  b"x" * 2000)
                assert await until(lambda: listener.connections == 0)  # the only slot is free again
                header = await slow(port, b"GET /healthz HTTP/1.1\r\n", b"X-Slow: " + b"a" * 4000)
                assert await until(lambda: listener.connections == 0)
                return body, header, await scrape(port)

        body, header, (status, text) = asyncio.run(scenario())
        assert body is not None and body.startswith(b"HTTP/1.1 408")
        assert header == b""  # no request ever arrived: closed without an answer
        assert status == 200
        assert 'kvmiss_metrics_http_requests_refused_total{reason="body_timeout"} 1.0' in text


def test_readiness_holds_for_an_idle_engine_and_fails_when_the_pipeline_is_full():
    """An engine that has published nothing yet is the normal idle case: ready. A pipeline
    with no room (spans would be refused) is not, and the detail says so."""
    config = parse_config(make_config({"w0": ("tcp://127.0.0.1:1", "tcp://127.0.0.1:2")}, "http://127.0.0.1:1"))
    svc = Service(config)  # not started: no socket, streams at their initial state
    ready, states = svc.ready()
    assert ready and states == {"w0": "initial"}
    svc.pipeline.pending_spans = svc.pipeline.max_pending_spans
    ready, states = svc.ready()
    assert not ready and states["pipeline"] == "full"


def test_a_collector_that_stopped_makes_the_service_unready():
    """The collector thread dying (a socket it could not open mid-run, say) stops all
    ingest: /readyz must say so instead of answering from stale streams."""
    config = parse_config(make_config({"w0": ("tcp://127.0.0.1:1", "tcp://127.0.0.1:2")}, "http://127.0.0.1:1"))
    svc = Service(config)
    assert svc.ready()[0]
    svc.subscriber.failed = RuntimeError("Too many open files")  # what the loop records as it dies
    ready, states = svc.ready()
    assert not ready and states["collector"] == "stopped"


def test_the_collectors_context_is_sized_to_the_fleet():
    import zmq

    from kvmiss.collectors.subscriber import SOCKETS_PER_WORKER

    workers = {f"w{i}": (f"tcp://127.0.0.1:{20000 + i}", f"tcp://127.0.0.1:{21000 + i}") for i in range(300)}
    svc = Service(parse_config(make_config(workers, "http://127.0.0.1:1")))
    assert svc.subscriber._ctx.get(zmq.MAX_SOCKETS) >= SOCKETS_PER_WORKER * 300
