"""OTLP exporters and the ExportQueue against small real OTLP sinks (aiohttp and grpc servers)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import grpc
import pytest
from aiohttp import web
from opentelemetry.exporter.otlp.proto.http import Compression as HttpCompression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpanExporter
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.trace.export import SpanExportResult
from test_receiver import GOOD, otlp_request, sdk_spans
from zmq_ports import free_port

from kvmiss.enricher.otlp import exporter as exporter_module
from kvmiss.enricher.otlp.exporter import (
    ExportQueue,
    GrpcExporter,
    HttpExporter,
    JsonLinesFileExporter,
    build_exporters,
    classify_grpc,
    classify_http,
    parse_retry_after,
)
from kvmiss.enricher.otlp.interfaces import (
    ACCEPTED,
    ConsumeResult,
    EncodedRequest,
    ExportResult,
    Outcome,
    request_bytes,
    span_count,
)
from kvmiss.enricher.otlp.receiver import Receivers, parse_otlp_json, retry_status_details
from kvmiss.schemas.config import ExportConfig, OtlpConfig


def numbered(i: int, n_spans: int = 2) -> ExportTraceServiceRequest:
    request = otlp_request([GOOD] * n_spans)
    request.resource_spans[0].resource.attributes.add(key="batch").value.int_value = i
    return request


def batch_of(request: ExportTraceServiceRequest) -> int:
    return request.resource_spans[0].resource.attributes[0].value.int_value


class HttpSink:
    """A minimal OTLP/HTTP backend: records requests; answers queued (status, headers) first."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.requests: list[ExportTraceServiceRequest] = []
        self.attempt_times: list[float] = []
        self.encodings: list[str] = []
        self.answers: list[tuple[int, dict]] = []
        self._runner: web.AppRunner | None = None

    async def _handle(self, request: web.Request) -> web.Response:
        self.attempt_times.append(time.monotonic())
        self.encodings.append(request.headers.get("Content-Encoding", ""))
        body = await request.read()  # aiohttp gunzips by itself
        if self.answers:
            status, headers = self.answers.pop(0)
            return web.Response(status=status, headers=headers, text="nope")
        self.requests.append(ExportTraceServiceRequest.FromString(body))
        return web.Response(body=ExportTraceServiceResponse().SerializeToString(), content_type="application/x-protobuf")

    async def start(self) -> HttpSink:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/traces", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class GrpcSink(trace_service_pb2_grpc.TraceServiceServicer):
    """A minimal OTLP/gRPC backend; ``answers`` are (code, retry_after_s or None) to fail with."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.requests: list[ExportTraceServiceRequest] = []
        self.answers: list[tuple[grpc.StatusCode, float | None]] = []
        self._server: grpc.aio.Server | None = None

    async def Export(self, request, context):  # noqa: N802
        if self.answers:
            code, delay = self.answers.pop(0)
            trailer = () if delay is None else (("grpc-status-details-bin", retry_status_details("busy", delay)),)
            await context.abort(code, "sink says no", trailing_metadata=trailer)
        self.requests.append(request)
        return ExportTraceServiceResponse()

    async def start(self) -> GrpcSink:
        self._server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self._server.add_insecure_port(f"127.0.0.1:{self.port}")
        await self._server.start()
        return self

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(0)

    @property
    def endpoint(self) -> str:
        return f"grpc://127.0.0.1:{self.port}"


@contextlib.asynccontextmanager
async def running(sink):
    await sink.start()
    try:
        yield sink
    finally:
        await sink.stop()


class TestExporters:
    def test_http_exporter_posts_gzip_protobuf_to_v1_traces(self):
        request = numbered(7)

        async def scenario():
            async with running(HttpSink()) as sink:
                exporter = HttpExporter(sink.endpoint)
                result = await exporter.export(request)
                await exporter.shutdown()
                return result, sink

        result, sink = asyncio.run(scenario())
        assert result.outcome is Outcome.ACCEPTED
        assert sink.requests == [request] and sink.encodings == ["gzip"]

    def test_a_large_request_is_compressed_off_the_loop_intact(self):
        request = numbered(3, n_spans=4000)
        assert request.ByteSize() > exporter_module.THREAD_COMPRESS_BYTES

        async def scenario():
            async with running(HttpSink()) as sink:
                exporter = HttpExporter(sink.endpoint + "/v1/traces")  # a full URL is kept as is
                result = await exporter.export(request)
                await exporter.shutdown()
                return result, sink

        result, sink = asyncio.run(scenario())
        assert result.outcome is Outcome.ACCEPTED and sink.requests == [request]

    def test_grpc_exporter_sends_the_request_itself(self):
        request = numbered(8)

        async def scenario():
            async with running(GrpcSink()) as sink:
                exporter = GrpcExporter(sink.endpoint)
                result = await exporter.export(request)
                await exporter.shutdown()
                return result, sink

        result, sink = asyncio.run(scenario())
        assert result.outcome is Outcome.ACCEPTED and sink.requests == [request]

    def test_an_encoded_request_goes_as_its_bytes_over_http_grpc_and_into_the_file(self, tmp_path):
        """What the pipeline hands on when it rewrote the received bytes (`EncodedRequest`):
        the same request at every sink, and the bytes sent are exactly those given."""
        request = numbered(9)
        encoded = EncodedRequest(request.SerializeToString(), 1)
        path = tmp_path / "spans.jsonl"

        async def scenario():
            async with running(HttpSink()) as http_sink, running(GrpcSink()) as grpc_sink:
                exporters = [HttpExporter(http_sink.endpoint), GrpcExporter(grpc_sink.endpoint),
                             JsonLinesFileExporter(str(path))]
                results = [await e.export(encoded) for e in exporters]
                results.append(await exporters[1].export(request))  # the message after bytes: both calls work
                for e in exporters:
                    await e.shutdown()
                return results, http_sink, grpc_sink

        results, http_sink, grpc_sink = asyncio.run(scenario())
        assert all(r.outcome is Outcome.ACCEPTED for r in results)
        assert http_sink.requests == [request] and grpc_sink.requests == [request, request]
        assert [parse_otlp_json(line.encode()) for line in path.read_text().splitlines()] == [request]
        assert span_count(encoded) == 1 and request_bytes(encoded) is encoded.body

    def test_real_sinks_answers_are_classified(self):
        async def scenario():
            async with running(HttpSink()) as http_sink, running(GrpcSink()) as grpc_sink:
                http_sink.answers = [(503, {"Retry-After": "4"}), (400, {})]
                grpc_sink.answers = [(grpc.StatusCode.UNAVAILABLE, 1.5), (grpc.StatusCode.INVALID_ARGUMENT, None)]
                http, grpc_ = HttpExporter(http_sink.endpoint), GrpcExporter(grpc_sink.endpoint)
                results = [await e.export(numbered(0)) for e in (http, http, grpc_, grpc_)]
                await http.shutdown()
                await grpc_.shutdown()
                return results

        busy, bad, unavailable, invalid = asyncio.run(scenario())
        assert (busy.outcome, busy.retry_after_s) == (Outcome.RETRYABLE, 4.0)
        assert bad.outcome is Outcome.PERMANENT and "400" in bad.message
        assert (unavailable.outcome, unavailable.retry_after_s) == (Outcome.RETRYABLE, 1.5)
        assert invalid.outcome is Outcome.PERMANENT

    def test_an_unreachable_sink_is_retryable(self):
        async def scenario():
            exporters = [HttpExporter(f"http://127.0.0.1:{free_port()}"), GrpcExporter(f"grpc://127.0.0.1:{free_port()}")]
            results = [await e.export(numbered(0)) for e in exporters]
            for e in exporters:
                await e.shutdown()
            return results

        assert [r.outcome for r in asyncio.run(scenario())] == [Outcome.RETRYABLE, Outcome.RETRYABLE]

    @pytest.mark.parametrize("status, outcome", [
        (200, Outcome.ACCEPTED), (429, Outcome.RETRYABLE), (502, Outcome.RETRYABLE), (503, Outcome.RETRYABLE),
        (504, Outcome.RETRYABLE), (400, Outcome.PERMANENT), (401, Outcome.PERMANENT), (413, Outcome.PERMANENT),
        (500, Outcome.PERMANENT),
    ])  # fmt: skip
    def test_http_status_classes(self, status, outcome):
        assert classify_http(status, None).outcome is outcome

    def test_retry_after_as_seconds_or_http_date(self):
        assert parse_retry_after("7") == 7.0
        assert parse_retry_after("Wed, 21 Oct 2015 07:28:10 GMT", now=1445412480.0) == 10.0
        assert parse_retry_after("soon") is None and parse_retry_after(None) is None

    def test_grpc_codes_and_retry_info(self):
        retry = (("grpc-status-details-bin", retry_status_details("busy", 0.25)),)
        assert classify_grpc(grpc.StatusCode.UNAVAILABLE, retry).retry_after_s == 0.25
        assert classify_grpc(grpc.StatusCode.UNAVAILABLE, ()).outcome is Outcome.RETRYABLE
        assert classify_grpc(grpc.StatusCode.DEADLINE_EXCEEDED, None).outcome is Outcome.RETRYABLE
        assert classify_grpc(grpc.StatusCode.RESOURCE_EXHAUSTED, ()).outcome is Outcome.PERMANENT
        assert classify_grpc(grpc.StatusCode.RESOURCE_EXHAUSTED, retry).outcome is Outcome.RETRYABLE
        assert classify_grpc(grpc.StatusCode.INVALID_ARGUMENT, retry).outcome is Outcome.PERMANENT

    def test_json_lines_file_has_hex_ids_and_reads_back(self, tmp_path):
        path = tmp_path / "spans.jsonl"
        first, second = numbered(1), numbered(2)
        first.resource_spans[0].scope_spans[0].spans[0].parent_span_id = b"\x03" * 8

        async def scenario():
            exporter = JsonLinesFileExporter(str(path))
            results = [await exporter.export(first), await exporter.export(second)]
            await exporter.shutdown()
            return results

        assert all(r.outcome is Outcome.ACCEPTED for r in asyncio.run(scenario()))
        lines = path.read_text().splitlines()
        span = json.loads(lines[0])["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
        assert span["traceId"] == "01" * 16 and span["parentSpanId"] == "03" * 8
        assert [parse_otlp_json(line.encode()) for line in lines] == [first, second]

    def test_build_exporters_from_config(self, tmp_path):
        kinds = lambda config: [type(e).__name__ for e in build_exporters(config)]  # noqa: E731
        assert kinds(ExportConfig()) == []
        assert kinds(ExportConfig(endpoint="http://h:4318", file=str(tmp_path / "x"))) == ["HttpExporter", "JsonLinesFileExporter"]
        assert kinds(ExportConfig(endpoint="grpc://h:4317")) == ["GrpcExporter"]
        with pytest.raises(ValueError, match="export.endpoint"):
            build_exporters(ExportConfig(endpoint="h:4317"))


class BlockedExporter:
    """Holds every export until ``release`` is set; records what it got."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.got: list[ExportTraceServiceRequest] = []
        self.shut = False

    async def export(self, request):
        await self.release.wait()
        self.got.append(request)
        return ExportResult(Outcome.ACCEPTED)

    async def shutdown(self):
        self.shut = True


class TestExportQueue:
    def test_retries_until_the_sink_comes_back_then_delivers_in_order(self):
        port = free_port()

        async def scenario():
            queue = ExportQueue(HttpExporter(f"http://127.0.0.1:{port}"), initial_backoff_s=0.05, max_backoff_s=0.2)
            await queue.start()
            for i in range(3):
                assert queue.put(numbered(i))
            await asyncio.sleep(0.4)  # the sink is down: the head request is being retried
            assert queue.sent_spans == 0 and queue.retries >= 1
            async with running(HttpSink(port)) as sink:
                flushed = await queue.force_flush(5.0)
                await queue.shutdown(1.0)
            return flushed, queue, sink

        flushed, queue, sink = asyncio.run(scenario())
        assert flushed and [batch_of(r) for r in sink.requests] == [0, 1, 2]
        assert queue.sent_spans == 6 and not queue.failed_spans and not queue.dropped_spans

    def test_grpc_sink_that_comes_back_is_reached(self):
        port = free_port()

        async def scenario():
            queue = ExportQueue(GrpcExporter(f"grpc://127.0.0.1:{port}"), initial_backoff_s=0.05, max_backoff_s=0.2)
            await queue.start()
            queue.put(numbered(0))
            await asyncio.sleep(0.3)
            async with running(GrpcSink(port)) as sink:
                flushed = await queue.force_flush(10.0)
                await queue.shutdown(1.0)
            return flushed, sink

        flushed, sink = asyncio.run(scenario())
        assert flushed and len(sink.requests) == 1

    def test_the_servers_retry_delay_is_honoured(self):
        async def scenario():
            async with running(HttpSink()) as sink:
                sink.answers = [(503, {"Retry-After": "1"})]
                queue = ExportQueue(HttpExporter(sink.endpoint), initial_backoff_s=0.01)
                await queue.start()
                queue.put(numbered(0))
                flushed = await queue.force_flush(5.0)
                await queue.shutdown(1.0)
                return flushed, sink

        flushed, sink = asyncio.run(scenario())
        assert flushed and len(sink.requests) == 1
        assert sink.attempt_times[1] - sink.attempt_times[0] >= 0.95

    def test_permanent_failures_are_not_retried(self):
        async def scenario():
            async with running(HttpSink()) as sink:
                sink.answers = [(400, {})]
                queue = ExportQueue(HttpExporter(sink.endpoint), initial_backoff_s=0.01)
                await queue.start()
                queue.put(numbered(0, n_spans=5))
                queue.put(numbered(1, n_spans=3))
                flushed = await queue.force_flush(5.0)
                await queue.shutdown(1.0)
                return flushed, queue, sink

        flushed, queue, sink = asyncio.run(scenario())
        assert flushed and len(sink.attempt_times) == 2 and [batch_of(r) for r in sink.requests] == [1]
        assert queue.failed_spans == {"permanent": 5} and queue.sent_spans == 3 and queue.retries == 0

    def test_retrying_stops_after_max_elapsed(self):
        async def scenario():
            queue = ExportQueue(HttpExporter(f"http://127.0.0.1:{free_port()}"), initial_backoff_s=0.05, max_elapsed_s=0.3)
            await queue.start()
            queue.put(numbered(0))
            flushed = await queue.force_flush(5.0)
            await queue.shutdown(0.1)
            return flushed, queue

        flushed, queue = asyncio.run(scenario())
        assert flushed and queue.failed_spans == {"retries_exhausted": 2} and queue.retries >= 2

    def test_the_bound_refuses_beyond_capacity_and_counts_it(self):
        async def scenario():
            exporter = BlockedExporter()
            queue = ExportQueue(exporter, max_spans=10)
            await queue.start()
            assert queue.put(numbered(0, n_spans=6))
            await asyncio.sleep(0.01)  # in flight now: still counted against the bound
            assert queue.has_capacity(4) and not queue.has_capacity(5)
            assert not queue.put(numbered(1, n_spans=5))
            assert queue.put(numbered(2, n_spans=4))
            exporter.release.set()
            assert await queue.force_flush(1.0)
            assert queue.has_capacity(50) and queue.put(numbered(3, n_spans=50))  # empty: any size fits
            await queue.shutdown(1.0)
            return exporter, queue

        exporter, queue = asyncio.run(scenario())
        assert [batch_of(r) for r in exporter.got] == [0, 2, 3]
        assert queue.dropped_spans == {"queue_full": 5} and queue.sent_spans == 60

    def test_shutdown_flushes_refuses_later_puts_and_is_idempotent(self):
        async def scenario():
            async with running(HttpSink()) as sink:
                queue = ExportQueue(HttpExporter(sink.endpoint))
                await queue.start()
                for i in range(5):
                    queue.put(numbered(i))
                await asyncio.gather(queue.shutdown(5.0), queue.shutdown(5.0))
                refused = queue.put(numbered(9))
                await queue.shutdown(5.0)
                return refused, queue, sink

        refused, queue, sink = asyncio.run(scenario())
        assert [batch_of(r) for r in sink.requests] == [0, 1, 2, 3, 4] and queue.sent_spans == 10
        assert not refused and queue.dropped_spans == {"already_shutdown": 2}

    def test_shutdown_gives_up_after_its_timeout_and_counts_the_rest(self):
        async def scenario():
            exporter = BlockedExporter()
            queue = ExportQueue(exporter)
            await queue.start()
            queue.put(numbered(0, n_spans=3))
            queue.put(numbered(1, n_spans=4))
            started = time.monotonic()
            await queue.shutdown(0.2)
            return time.monotonic() - started, exporter, queue

        took, exporter, queue = asyncio.run(scenario())
        assert took < 1.0 and exporter.shut and exporter.got == []
        assert queue.dropped_spans == {"shutdown": 7} and queue.queued_spans == 0


class PassThrough:
    """The smallest pipeline: forwards to the queue, RETRYABLE when it is full."""

    def __init__(self, queue: ExportQueue) -> None:
        self.queue = queue

    async def consume(self, request, body=None, gzipped=None):
        n = span_count(request)
        if not self.queue.has_capacity(n):
            return ConsumeResult(Outcome.RETRYABLE, message="export queue full", retry_after_s=1.0)
        self.queue.put(request, n)
        return ACCEPTED


def test_sdk_to_receiver_to_queue_to_sink_end_to_end():
    spans = sdk_spans(6)

    async def scenario():
        async with running(HttpSink()) as sink:
            queue = ExportQueue(HttpExporter(sink.endpoint))
            await queue.start()
            receivers = Receivers(OtlpConfig(grpc=None, http="127.0.0.1:0"), PassThrough(queue))
            await receivers.start()
            exporter = HttpSpanExporter(
                endpoint=f"http://127.0.0.1:{receivers.http_port}/v1/traces", compression=HttpCompression.Gzip
            )
            result = await asyncio.to_thread(exporter.export, spans)
            exporter.shutdown()
            await receivers.shutdown(1.0)
            await queue.shutdown(5.0)
            return result, sink

    result, sink = asyncio.run(scenario())
    assert result is SpanExportResult.SUCCESS
    got = [s for r in sink.requests for rs in r.resource_spans for ss in rs.scope_spans for s in ss.spans]
    assert sorted(s.name for s in got) == sorted(s.name for s in spans)
    assert sink.requests[0].resource_spans[0].resource.attributes[0].value.string_value  # resource kept
