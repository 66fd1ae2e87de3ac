"""OTLP receivers against real senders: the OTel SDK's OTLP exporters, rotel, raw clients."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import logging
import pathlib
import random
import socket
import subprocess
import time
import zlib

import aiohttp
import grpc
import pytest
from google.rpc import code_pb2, error_details_pb2, status_pb2
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpanExporter
from opentelemetry.exporter.otlp.proto.http import Compression as HttpCompression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.trace.export import SpanExportResult
from sdk_spans import sdk_spans
from zmq_ports import free_port

try:  # Python 3.14 has it; before, its backport (a kvmiss dependency)
    from compression import zstd
except ImportError:
    from backports import zstd

from kvmiss.enricher.otlp import receiver as receiver_module
from kvmiss.enricher.otlp.interfaces import ACCEPTED, ConsumeResult, Outcome, span_count
from kvmiss.enricher.otlp.receiver import Receivers, drop_invalid_spans, parse_otlp_json
from kvmiss.schemas.config import OtlpConfig, parse_listen_address as parse_listen

PROTOBUF = "application/x-protobuf"
JSON = "application/json"
EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


def _raw_deflate(data: bytes) -> bytes:
    packer = zlib.compressobj(wbits=-15)
    return packer.compress(data) + packer.flush()


def _halves(compress):
    return lambda data: compress(data[: len(data) // 2]) + compress(data[len(data) // 2:])


# Test case -> (Content-Encoding, how a client compresses a body).
COMPRESSORS = {
    "gzip": ("gzip", gzip.compress),
    "gzip-two-members": ("gzip", _halves(gzip.compress)),
    "deflate": ("deflate", zlib.compress),
    "deflate-raw": ("deflate", _raw_deflate),
    "zlib": ("zlib", zlib.compress),
    "zstd": ("zstd", zstd.compress),
    "zstd-two-frames": ("zstd", _halves(zstd.compress)),
}


class RecordingConsumer:
    """Records every request; answers ``result`` (or raises ``error``)."""

    def __init__(self, result: ConsumeResult = ACCEPTED, error: Exception | None = None) -> None:
        self.requests: list[ExportTraceServiceRequest] = []
        self.bodies: list[bytes | None] = []  # what the receiver handed over beside each request
        self.gzipped: list[bytes | None] = []  # and the gzip'd bytes it came in as
        self.result, self.error = result, error

    async def consume(self, request: ExportTraceServiceRequest, body: bytes | None = None,
                      gzipped: bytes | None = None) -> ConsumeResult:
        self.requests.append(request)
        self.bodies.append(body)
        self.gzipped.append(gzipped)
        if self.error is not None:
            raise self.error
        return self.result

    def spans(self) -> list:
        return [s for r in self.requests for rs in r.resource_spans for ss in rs.scope_spans for s in ss.spans]


def otlp_request(ids: list[tuple[bytes, bytes]]) -> ExportTraceServiceRequest:
    request = ExportTraceServiceRequest()
    scope_spans = request.resource_spans.add().scope_spans.add()
    for i, (trace_id, span_id) in enumerate(ids):
        span = scope_spans.spans.add(name=f"s{i}", trace_id=trace_id, span_id=span_id)
        span.attributes.add(key="i").value.int_value = i
    return request


GOOD = (b"\x01" * 16, b"\x02" * 8)


@contextlib.asynccontextmanager
async def serving(consumer, **config):
    receivers = Receivers(OtlpConfig(**{"grpc": "127.0.0.1:0", "http": "127.0.0.1:0", **config}), consumer)
    await receivers.start()
    try:
        yield receivers
    finally:
        await receivers.shutdown(1.0)


async def post(receivers: Receivers, body: bytes, ctype: str = PROTOBUF, headers: dict | None = None):
    async with aiohttp.ClientSession(auto_decompress=False) as session:
        url = f"http://127.0.0.1:{receivers.http_port}/v1/traces"
        async with session.post(url, data=body, headers={"Content-Type": ctype, **(headers or {})}) as response:
            return response.status, dict(response.headers), await response.read()


async def grpc_export(receivers: Receivers, body: bytes):
    """Send raw bytes to Export; returns (response, None) or (None, AioRpcError)."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{receivers.grpc_port}") as channel:
        call = channel.unary_unary(EXPORT, response_deserializer=ExportTraceServiceResponse.FromString)
        try:
            return await call(body, timeout=10), None
        except grpc.aio.AioRpcError as exc:
            return None, exc


class TestRealSdkExporters:
    @pytest.mark.parametrize("compression", [grpc.Compression.Gzip, grpc.Compression.Deflate], ids=["gzip", "deflate"])
    def test_grpc_exporter_compressed_delivers_every_span_unchanged(self, compression):
        spans = sdk_spans(3)
        consumer = RecordingConsumer()

        async def scenario():
            async with serving(consumer) as receivers:
                exporter = GrpcSpanExporter(
                    endpoint=f"127.0.0.1:{receivers.grpc_port}", insecure=True, compression=compression
                )
                try:
                    return await asyncio.to_thread(exporter.export, spans)
                finally:
                    exporter.shutdown()

        assert asyncio.run(scenario()) is SpanExportResult.SUCCESS
        got = consumer.spans()
        assert [s.name for s in got] == [s.name for s in spans]
        assert [s.trace_id for s in got] == [s.context.trace_id.to_bytes(16, "big") for s in spans]
        assert [s.span_id for s in got] == [s.context.span_id.to_bytes(8, "big") for s in spans]
        assert {kv.key for kv in got[0].attributes} == {"gen_ai.request.id", "gen_ai.usage.prompt_tokens"}
        # gRPC hands over the request's own bytes too
        assert [ExportTraceServiceRequest.FromString(b) for b in consumer.bodies] == consumer.requests

    @pytest.mark.parametrize("compression", [HttpCompression.Gzip, HttpCompression.Deflate], ids=["gzip", "deflate"])
    def test_http_exporter_compressed_delivers_every_span(self, compression):
        spans = sdk_spans(4)
        consumer = RecordingConsumer()

        async def scenario():
            async with serving(consumer) as receivers:
                exporter = HttpSpanExporter(
                    endpoint=f"http://127.0.0.1:{receivers.http_port}/v1/traces", compression=compression
                )
                try:
                    return await asyncio.to_thread(exporter.export, spans), receivers.stats.copy()
                finally:
                    exporter.shutdown()

        result, stats = asyncio.run(scenario())
        assert result is SpanExportResult.SUCCESS
        assert [s.name for s in consumer.spans()] == [s.name for s in spans]
        assert stats[f"http_requests_{compression.value}"] == 1 and stats["spans_accepted"] == 4


def _rotel_binary() -> pathlib.Path:
    rotel = pytest.importorskip("rotel", reason="rotel is not installed (pip install -e '.[test]')")
    binary = pathlib.Path(rotel.__file__).parent / "rotel-agent"
    if not binary.exists():
        pytest.skip(f"rotel wheel has no agent binary at {binary}")
    return binary


async def _wait_listening(port: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return True
        except OSError:
            await asyncio.sleep(0.05)
    return False


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_rotel_collector_forwards_gzip_otlp_to_the_receiver(protocol, tmp_path):
    """A real (Rust) OTLP collector in front of kvmiss, exporting gzip OTLP to it."""
    binary = _rotel_binary()
    spans = sdk_spans(5)
    consumer = RecordingConsumer()

    async def scenario():
        async with serving(consumer) as receivers:
            rotel_grpc, rotel_http = free_port(), free_port()
            target = receivers.grpc_port if protocol == "grpc" else receivers.http_port
            log_path = tmp_path / "rotel.log"  # a file, not a pipe: a full pipe would stall rotel
            with open(log_path, "wb") as log_file:
                process = subprocess.Popen(
                    [binary, "start",
                     "--otlp-grpc-endpoint", f"127.0.0.1:{rotel_grpc}", "--otlp-http-endpoint", f"127.0.0.1:{rotel_http}",
                     "--exporter", "otlp", "--otlp-exporter-endpoint", f"http://127.0.0.1:{target}",
                     "--otlp-exporter-protocol", protocol, "--otlp-exporter-compression", "gzip",
                     "--batch-timeout", "50ms", "--pid-file", str(tmp_path / "rotel.pid")],
                    stdout=log_file, stderr=subprocess.STDOUT,
                )  # fmt: skip
            try:
                if not await _wait_listening(rotel_grpc, 10.0):
                    process.kill()
                    process.wait(5)
                    pytest.skip(f"rotel did not start here: {log_path.read_text()[-500:]}")
                exporter = GrpcSpanExporter(endpoint=f"127.0.0.1:{rotel_grpc}", insecure=True)
                try:
                    assert await asyncio.to_thread(exporter.export, spans) is SpanExportResult.SUCCESS
                finally:
                    exporter.shutdown()
                deadline = time.monotonic() + 10
                while len(consumer.spans()) < len(spans) and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                return receivers.stats.copy()
            finally:
                if process.poll() is None:
                    process.terminate()
                    process.wait(5)

    stats = asyncio.run(scenario())
    assert sorted(s.name for s in consumer.spans()) == sorted(s.name for s in spans)
    if protocol == "http":
        assert stats["http_requests_gzip"] >= 1  # rotel really compressed


class TestHttpBodies:
    def test_otlp_json_with_hex_ids_integer_enums_and_unknown_fields(self):
        document = {
            "resourceSpans": [{
                "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "vllm"}}]},
                "scopeSpans": [{
                    "scope": {"name": "vllm"},
                    "spans": [{
                        "traceId": "5b8efff798038103d269b633813fc60c", "spanId": "eee19b7ec3c1b174",
                        "parentSpanId": "eee19b7ec3c1b173", "name": "llm_request", "kind": 2,
                        "startTimeUnixNano": "1544712660000000000", "endTimeUnixNano": 1544712661000000000,
                        "attributes": [{"key": "gen_ai.usage.prompt_tokens", "value": {"intValue": "77"}}],
                        "links": [{"traceId": "00000000000000000000000000000001", "spanId": "0000000000000002"}],
                        "status": {"code": 1}, "someFutureField": {"x": 1},
                    }],
                }],
            }],
            "futureTopLevel": True,
        }  # fmt: skip
        consumer = RecordingConsumer()

        async def scenario():
            async with serving(consumer) as receivers:
                return await post(receivers, json.dumps(document).encode(), JSON)

        status, headers, body = asyncio.run(scenario())
        assert status == 200 and headers["Content-Type"].startswith(JSON)
        assert json.loads(body) == {}  # no partial_success when all is accepted
        (span,) = consumer.spans()
        assert span.trace_id.hex() == "5b8efff798038103d269b633813fc60c"
        assert span.parent_span_id.hex() == "eee19b7ec3c1b173"
        assert span.kind == 2 and span.status.code == 1 and span.links[0].span_id.hex() == "0000000000000002"
        assert span.attributes[0].value.int_value == 77

    @pytest.mark.parametrize("ctype", [PROTOBUF, JSON])
    def test_gzip_body_in_either_content_type(self, ctype):
        request = otlp_request([GOOD, GOOD])
        body = request.SerializeToString() if ctype == PROTOBUF else _to_json(request)
        consumer = RecordingConsumer()

        async def scenario():
            async with serving(consumer) as receivers:
                return await post(receivers, gzip.compress(body), ctype, {"Content-Encoding": "gzip"})

        status, headers, _ = asyncio.run(scenario())
        assert status == 200 and headers["Content-Type"].startswith(ctype)
        assert consumer.requests == [request]
        # The consumer gets the gunzipped protobuf bytes beside the message (it may read
        # them instead, enricher/otlp/_otlpwire.c) and the gzip'd ones (the journal keeps
        # those); JSON has no such bytes.
        assert consumer.bodies == [body if ctype == PROTOBUF else None]
        assert [gzip.decompress(g) if g else g for g in consumer.gzipped] == [body if ctype == PROTOBUF else None]

    @pytest.mark.parametrize("encoding", list(COMPRESSORS))
    def test_every_accepted_encoding_in_either_content_type(self, encoding):
        """deflate as the OTel Python SDK sends it (zlib) and raw; zstd as one frame or two;
        gzip as two members (concatenated streams are one body in each format)."""
        request = otlp_request([GOOD, GOOD, GOOD])
        header, compress = COMPRESSORS[encoding]
        consumer = RecordingConsumer()

        async def scenario():
            answers = []
            async with serving(consumer) as receivers:
                for ctype in (PROTOBUF, JSON):
                    body = request.SerializeToString() if ctype == PROTOBUF else _to_json(request)
                    answers.append(await post(receivers, compress(body), ctype, {"Content-Encoding": header}))
                return answers, receivers.stats.copy()

        answers, stats = asyncio.run(scenario())
        assert [a[0] for a in answers] == [200, 200] and consumer.requests == [request, request]
        assert stats[f"http_requests_{header}"] == 2
        # only gzip'd protobuf bytes are handed on as they came (the journal keeps those)
        assert consumer.gzipped[1] is None and (consumer.gzipped[0] is not None) == (header == "gzip")

    @pytest.mark.parametrize("encoding", ["deflate", "zstd"])
    def test_a_large_compressed_body_is_decompressed_off_the_loop_intact(self, encoding):
        rng = random.Random(7)
        request = otlp_request([(rng.randbytes(16), rng.randbytes(8)) for _ in range(3000)])
        body = COMPRESSORS[encoding][1](request.SerializeToString())
        assert len(body) > receiver_module._THREAD_INFLATE_BYTES  # random ids barely compress
        consumer = RecordingConsumer()

        async def scenario():
            async with serving(consumer) as receivers:
                return await post(receivers, body, PROTOBUF, {"Content-Encoding": encoding})

        assert asyncio.run(scenario())[0] == 200 and consumer.requests == [request]

    def test_a_large_gzip_body_is_gunzipped_off_the_loop_intact(self):
        rng = random.Random(7)
        request = otlp_request([(rng.randbytes(16), rng.randbytes(8)) for _ in range(3000)])
        body = gzip.compress(request.SerializeToString())
        assert len(body) > receiver_module._THREAD_INFLATE_BYTES  # random ids barely compress
        consumer = RecordingConsumer()

        async def scenario():
            async with serving(consumer) as receivers:
                return await post(receivers, body, PROTOBUF, {"Content-Encoding": "gzip"})

        assert asyncio.run(scenario())[0] == 200 and consumer.requests == [request]

    def test_bad_ids_are_rejected_as_partial_success_and_the_rest_delivered(self):
        request = otlp_request([GOOD, (b"\x01" * 15, b"\x02" * 8), GOOD, (b"\x01" * 16, b""), GOOD])
        consumer = RecordingConsumer()

        async def scenario():
            async with serving(consumer) as receivers:
                return await post(receivers, request.SerializeToString())

        status, _, body = asyncio.run(scenario())
        response = ExportTraceServiceResponse.FromString(body)
        assert status == 200 and response.partial_success.rejected_spans == 2
        assert "16 bytes" in response.partial_success.error_message
        assert [s.name for s in consumer.spans()] == ["s0", "s2", "s4"]
        assert consumer.bodies == [None]  # the request no longer matches the bytes received

    def test_partial_success_answer_in_json(self):
        consumer = RecordingConsumer(ConsumeResult(Outcome.ACCEPTED, rejected_spans=1, message="one was odd"))
        body = _to_json(otlp_request([GOOD, (b"\x01" * 16, b"\x02" * 7)]))

        async def scenario():
            async with serving(consumer) as receivers:
                return await post(receivers, body, JSON)

        status, _, answer = asyncio.run(scenario())
        partial = json.loads(answer)["partialSuccess"]
        assert status == 200 and int(partial["rejectedSpans"]) == 2
        assert "one was odd" in partial["errorMessage"]

    @pytest.mark.parametrize(
        "body, ctype, headers",
        [
            (b"\x0a\x05abc", PROTOBUF, {}),  # length runs past the end
            (b"{not json", JSON, {}),
            (b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "zz"}]}]}]}', JSON, {}),
            (b'{"resourceSpans": 3}', JSON, {}),
            (b"\x1f\x8b\x08\x00garbage", PROTOBUF, {"Content-Encoding": "gzip"}),
            (gzip.compress(b"x" * 100)[:-6], PROTOBUF, {"Content-Encoding": "gzip"}),  # truncated
            (b"\x78\x9cgarbage", PROTOBUF, {"Content-Encoding": "deflate"}),
            (zlib.compress(b"x" * 100)[:-6], PROTOBUF, {"Content-Encoding": "deflate"}),
            (zlib.compress(b"x" * 100) + b"tail", PROTOBUF, {"Content-Encoding": "deflate"}),
            (b"\x28\xb5\x2f\xfdgarbage", PROTOBUF, {"Content-Encoding": "zstd"}),
            (zstd.compress(bytes(range(256)) * 4)[:-6], PROTOBUF, {"Content-Encoding": "zstd"}),
        ],
        ids=["protobuf", "json-syntax", "json-hex", "json-shape", "gzip-corrupt", "gzip-truncated",
             "deflate-corrupt", "deflate-truncated", "deflate-trailing", "zstd-corrupt", "zstd-truncated"],
    )
    def test_malformed_body_is_400_with_a_status_body(self, body, ctype, headers):
        consumer = RecordingConsumer()

        async def scenario():
            async with serving(consumer) as receivers:
                return await post(receivers, body, ctype, headers)

        status, _, answer = asyncio.run(scenario())
        assert status == 400 and consumer.requests == []
        message = (status_pb2.Status.FromString(answer).message if ctype == PROTOBUF
                   else json.loads(answer)["message"])  # fmt: skip
        encoding = headers.get("Content-Encoding")
        assert f"{encoding} body" in message if encoding else "cannot decode" in message

    @pytest.mark.parametrize("ctype, headers", [("text/plain", {}), (PROTOBUF, {"Content-Encoding": "br"})])
    def test_unsupported_content_type_or_encoding_is_415(self, ctype, headers):
        async def scenario():
            async with serving(RecordingConsumer()) as receivers:
                return await post(receivers, otlp_request([GOOD]).SerializeToString(), ctype, headers)

        status, _, answer = asyncio.run(scenario())
        assert status == 415
        if headers:  # the answer says what is accepted
            assert "gzip, deflate, zlib, zstd or identity" in status_pb2.Status.FromString(answer).message

    @pytest.mark.parametrize("encoding", ["identity", "gzip", "deflate", "zstd"])
    def test_body_over_the_cap_after_decompression_is_413(self, encoding):
        big = otlp_request([GOOD] * 2000).SerializeToString()  # ~60 KiB, very compressible
        assert len(big) > 32 * 1024
        if encoding == "identity":
            body, headers = big, {}
        else:
            body, headers = COMPRESSORS[encoding][1](big), {"Content-Encoding": encoding}
            assert len(body) < 32 * 1024
        consumer = RecordingConsumer()

        async def scenario():
            async with serving(consumer, max_body_bytes=32 * 1024) as receivers:
                return await post(receivers, body, PROTOBUF, headers)

        status, headers, _ = asyncio.run(scenario())
        assert status == 413 and "Retry-After" not in headers and consumer.requests == []


class TestOutcomeMapping:
    @pytest.mark.parametrize("retry_after_s, header", [(2.3, "3"), (0.2, "1"), (None, "1")])
    def test_retryable_is_503_with_integer_retry_after(self, retry_after_s, header):
        consumer = RecordingConsumer(ConsumeResult(Outcome.RETRYABLE, message="busy", retry_after_s=retry_after_s))

        async def scenario():
            async with serving(consumer) as receivers:
                return await post(receivers, otlp_request([GOOD]).SerializeToString())

        status, headers, body = asyncio.run(scenario())
        assert status == 503 and headers["Retry-After"] == header
        assert status_pb2.Status.FromString(body).code == code_pb2.UNAVAILABLE

    def test_retryable_is_unavailable_with_a_decodable_retry_info(self):
        consumer = RecordingConsumer(ConsumeResult(Outcome.RETRYABLE, message="busy", retry_after_s=2.5))

        async def scenario():
            async with serving(consumer) as receivers:
                return await grpc_export(receivers, otlp_request([GOOD]).SerializeToString())

        _, error = asyncio.run(scenario())
        assert error.code() is grpc.StatusCode.UNAVAILABLE and error.details() == "busy"
        details = dict(error.trailing_metadata())["grpc-status-details-bin"]
        status = status_pb2.Status.FromString(details)
        info = error_details_pb2.RetryInfo()
        assert status.code == code_pb2.UNAVAILABLE and status.details[0].Unpack(info)
        assert (info.retry_delay.seconds, info.retry_delay.nanos) == (2, 500_000_000)

    def test_permanent_is_400_and_invalid_argument(self):
        consumer = RecordingConsumer(ConsumeResult(Outcome.PERMANENT, message="no"))

        async def scenario():
            async with serving(consumer) as receivers:
                body = otlp_request([GOOD]).SerializeToString()
                return await post(receivers, body), await grpc_export(receivers, body)

        (status, _, _), (_, error) = asyncio.run(scenario())
        assert status == 400 and error.code() is grpc.StatusCode.INVALID_ARGUMENT

    def test_grpc_malformed_request_is_invalid_argument(self):
        consumer = RecordingConsumer()

        async def scenario():
            async with serving(consumer) as receivers:
                return await grpc_export(receivers, b"\x0a\x05abc"), receivers.stats.copy()

        (_, error), stats = asyncio.run(scenario())
        assert error.code() is grpc.StatusCode.INVALID_ARGUMENT and stats["requests_malformed"] == 1
        assert consumer.requests == []

    def test_grpc_partial_success_for_bad_ids(self):
        consumer = RecordingConsumer()

        async def scenario():
            async with serving(consumer) as receivers:
                body = otlp_request([(b"", b""), GOOD]).SerializeToString()
                return await grpc_export(receivers, body)

        response, _ = asyncio.run(scenario())
        assert response.partial_success.rejected_spans == 1 and len(consumer.spans()) == 1
        assert consumer.bodies == [None]

    def test_grpc_accepts_up_to_the_configured_size_not_4_mib(self):
        request = otlp_request([GOOD] * 100_000)
        assert 4 * 1024 * 1024 < request.ByteSize() < 6 * 1024 * 1024
        consumer = RecordingConsumer()

        async def scenario():
            async with serving(consumer, max_body_bytes=6 * 1024 * 1024) as receivers:
                fits = await grpc_export(receivers, request.SerializeToString())
                too_big = await grpc_export(receivers, otlp_request([GOOD] * 130_000).SerializeToString())
                return fits, too_big

        (response, error), (_, too_big) = asyncio.run(scenario())
        assert error is None and span_count(consumer.requests[0]) == 100_000
        assert too_big.code() is grpc.StatusCode.RESOURCE_EXHAUSTED and len(consumer.requests) == 1

    def test_a_raising_consumer_is_an_internal_error_not_a_retry(self):
        consumer = RecordingConsumer(error=RuntimeError("bug"))

        async def scenario():
            async with serving(consumer) as receivers:
                body = otlp_request([GOOD]).SerializeToString()
                return await post(receivers, body), await grpc_export(receivers, body)

        (status, headers, _), (_, error) = asyncio.run(scenario())
        assert status == 500 and "Retry-After" not in headers
        assert error.code() is grpc.StatusCode.INTERNAL


class TestLifecycle:
    def test_shutdown_is_idempotent_and_safe_before_start(self):
        async def scenario():
            never_started = Receivers(OtlpConfig(), RecordingConsumer())
            await never_started.shutdown(0.1)
            receivers = Receivers(OtlpConfig(grpc=None, http="127.0.0.1:0"), RecordingConsumer())
            await receivers.start()
            port = receivers.http_port
            await asyncio.gather(receivers.shutdown(0.5), receivers.shutdown(0.5))
            await receivers.shutdown(0.5)
            return receivers.grpc_port, port

        grpc_port, http_port = asyncio.run(scenario())
        assert grpc_port is None and http_port
        with socket.socket() as s:  # the port was released
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", http_port))

    @pytest.mark.parametrize("kind", ["grpc", "http"])
    def test_a_second_receiver_cannot_share_a_port(self, kind):
        async def scenario():
            async with serving(RecordingConsumer(), **{"grpc" if kind == "http" else "http": None}) as first:
                port = first.grpc_port or first.http_port
                second = Receivers(OtlpConfig(**{kind: f"127.0.0.1:{port}", ("http" if kind == "grpc" else "grpc"): None}),
                                   RecordingConsumer())  # fmt: skip
                with pytest.raises((OSError, RuntimeError)):
                    await second.start()

        asyncio.run(scenario())

    def test_protobuf_backend_is_upb_and_other_backends_warn(self, monkeypatch, caplog):
        assert receiver_module.check_protobuf_backend() == "upb"
        monkeypatch.setattr(receiver_module.api_implementation, "Type", lambda: "python")
        with caplog.at_level(logging.WARNING, logger="kvmiss.enricher.otlp.receiver"):
            receiver_module.check_protobuf_backend()
        assert "60x slower" in caplog.text


class TestValidation:
    def test_drop_invalid_spans_removes_only_spans_with_wrong_id_lengths(self):
        request = otlp_request([GOOD, (b"\x01" * 17, b"\x02" * 8), GOOD, (b"\x01" * 16, b"\x02" * 9)])
        assert drop_invalid_spans(request) == 2
        assert [s.name for s in request.resource_spans[0].scope_spans[0].spans] == ["s0", "s2"]
        assert drop_invalid_spans(request) == 0

    def test_listen_addresses(self):
        assert parse_listen("0.0.0.0:4317") == ("0.0.0.0", 4317)
        assert parse_listen("[::1]:4318") == ("::1", 4318)
        assert parse_listen(":4318") == ("127.0.0.1", 4318)

    def test_otlp_json_accepts_snake_case_keys(self):
        body = b'{"resource_spans":[{"scope_spans":[{"spans":[{"trace_id":"01010101010101010101010101010101","span_id":"0202020202020202","name":"x"}]}]}]}'
        request = parse_otlp_json(body)
        assert request.resource_spans[0].scope_spans[0].spans[0].span_id == b"\x02" * 8


def _to_json(request: ExportTraceServiceRequest) -> bytes:
    from kvmiss.enricher.otlp.exporter import to_otlp_json  # the exporter's writer, read back here

    return to_otlp_json(request).encode()
