"""Optional TLS: receivers serving TLS to the OTel SDK's exporters, exporters verifying TLS
sinks against ``export.tls_ca``. Certificates are made per test with the openssl CLI."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import ssl
import subprocess
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import grpc
import pytest
from aiohttp import web
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpanExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpanExporter
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from opentelemetry.sdk.trace.export import SpanExportResult
from test_exporter import GrpcSink, HttpSink, batch_of, numbered, running
from test_receiver import EXPORT, GOOD, RecordingConsumer, otlp_request, sdk_spans

from kvmiss.enricher.otlp.exporter import GrpcExporter, HttpExporter, build_exporters
from kvmiss.enricher.otlp.interfaces import Outcome
from kvmiss.enricher.otlp.receiver import Receivers, TlsFilesError, load_server_tls
from kvmiss.schemas.config import ConfigError, ExportConfig, OtlpConfig, parse_config

OPENSSL = shutil.which("openssl") or "/usr/bin/openssl"
pytestmark = pytest.mark.skipif(not Path(OPENSSL).exists(), reason="needs the openssl CLI")


@dataclass
class Pki:
    ca: Path  # the test CA's certificate (what clients trust)
    cert: Path  # server certificate for 127.0.0.1 and localhost, signed by the CA
    key: Path  # its private key (unencrypted)
    other_ca: Path  # an unrelated CA: trusting only it must fail verification
    other_key: Path  # a key that does not match `cert`


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run([OPENSSL, *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _make_ca(d: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2", "-subj", f"/CN=kvmiss test {name}",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             cwd=d)  # fmt: skip


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    _make_ca(tmp_path, "ca")
    _make_ca(tmp_path, "other")
    _openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost", cwd=tmp_path)  # fmt: skip
    (tmp_path / "server.ext").write_text(
        "basicConstraints = critical, CA:FALSE\n"
        "keyUsage = critical, digitalSignature\n"
        "extendedKeyUsage = serverAuth\n"
        "subjectAltName = IP:127.0.0.1, DNS:localhost\n"
        "subjectKeyIdentifier = hash\n"
        "authorityKeyIdentifier = keyid\n"
    )
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", "2", "-extfile", "server.ext", "-out", "server.pem", cwd=tmp_path)  # fmt: skip
    return Pki(tmp_path / "ca.pem", tmp_path / "server.pem", tmp_path / "server.key",
               tmp_path / "other.pem", tmp_path / "other.key")  # fmt: skip


@pytest.fixture
def requests_honours_certificate_file(monkeypatch):
    """requests lets these variables override ``Session.verify``, i.e. the SDK's
    ``certificate_file``; some environments set them."""
    monkeypatch.delenv("REQUESTS_CA_BUNDLE", raising=False)
    monkeypatch.delenv("CURL_CA_BUNDLE", raising=False)


@contextlib.asynccontextmanager
async def tls_serving(pki: Pki, consumer):
    config = OtlpConfig(grpc="127.0.0.1:0", http="127.0.0.1:0", tls_cert=str(pki.cert), tls_key=str(pki.key))
    receivers = Receivers(config, consumer)
    await receivers.start()
    try:
        yield receivers
    finally:
        await receivers.shutdown(1.0)


class TestTlsReceivers:
    def test_sdk_grpc_exporter_over_tls_delivers_every_span(self, pki):
        spans = sdk_spans(3)
        consumer = RecordingConsumer()

        async def scenario():
            async with tls_serving(pki, consumer) as receivers:
                exporter = GrpcSpanExporter(
                    endpoint=f"127.0.0.1:{receivers.grpc_port}", insecure=False,
                    credentials=grpc.ssl_channel_credentials(pki.ca.read_bytes()),
                )  # fmt: skip
                try:
                    return await asyncio.to_thread(exporter.export, spans)
                finally:
                    exporter.shutdown()

        assert asyncio.run(scenario()) is SpanExportResult.SUCCESS
        assert [s.name for s in consumer.spans()] == [s.name for s in spans]

    def test_sdk_http_exporter_over_tls_delivers_every_span(self, pki, requests_honours_certificate_file):
        spans = sdk_spans(4)
        consumer = RecordingConsumer()

        async def scenario():
            async with tls_serving(pki, consumer) as receivers:
                exporter = HttpSpanExporter(
                    endpoint=f"https://127.0.0.1:{receivers.http_port}/v1/traces", certificate_file=str(pki.ca)
                )
                try:
                    return await asyncio.to_thread(exporter.export, spans)
                finally:
                    exporter.shutdown()

        assert asyncio.run(scenario()) is SpanExportResult.SUCCESS
        assert [s.name for s in consumer.spans()] == [s.name for s in spans]

    def test_the_http_receiver_negotiates_at_least_tls_1_2(self, pki):
        context, _ = load_server_tls(str(pki.cert), str(pki.key))
        assert context.minimum_version >= ssl.TLSVersion.TLSv1_2

        async def scenario():
            async with tls_serving(pki, RecordingConsumer()) as receivers:
                client = ssl.create_default_context(cafile=str(pki.ca))
                _, writer = await asyncio.open_connection("127.0.0.1", receivers.http_port, ssl=client)
                try:
                    return writer.get_extra_info("ssl_object").version()
                finally:
                    writer.close()

        assert asyncio.run(scenario()) in ("TLSv1.2", "TLSv1.3")

    def test_plain_text_clients_are_refused_on_both_tls_ports(self, pki):
        consumer = RecordingConsumer()
        body = otlp_request([GOOD]).SerializeToString()

        async def scenario():
            async with tls_serving(pki, consumer) as receivers:
                async with aiohttp.ClientSession() as session:
                    with pytest.raises(aiohttp.ClientError):
                        async with session.post(f"http://127.0.0.1:{receivers.http_port}/v1/traces", data=body,
                                                headers={"Content-Type": "application/x-protobuf"}) as response:
                            await response.read()  # fmt: skip
                async with grpc.aio.insecure_channel(f"127.0.0.1:{receivers.grpc_port}") as channel:
                    call = channel.unary_unary(EXPORT, response_deserializer=ExportTraceServiceResponse.FromString)
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await call(body, timeout=5)
                    return info.value.code()

        assert asyncio.run(scenario()) is grpc.StatusCode.UNAVAILABLE
        assert consumer.requests == []

    def test_a_client_trusting_another_ca_is_refused(self, pki, requests_honours_certificate_file):
        consumer = RecordingConsumer()

        async def scenario():
            async with tls_serving(pki, consumer) as receivers:
                exporter = HttpSpanExporter(
                    endpoint=f"https://127.0.0.1:{receivers.http_port}/v1/traces", certificate_file=str(pki.other_ca),
                    timeout=5,
                )  # fmt: skip
                try:
                    return await asyncio.to_thread(exporter.export, sdk_spans(1))
                finally:
                    exporter.shutdown()

        assert asyncio.run(scenario()) is SpanExportResult.FAILURE
        assert consumer.requests == []


class TestTlsFilesAtStartUp:
    @pytest.mark.parametrize("case", ["missing-cert", "missing-key", "key-is-a-directory", "not-pem", "key-mismatch", "encrypted-key"])
    def test_unusable_files_fail_start_with_the_path_and_no_key_material(self, pki, tmp_path, case):
        cert, key = pki.cert, pki.key
        if case == "missing-cert":
            cert = tmp_path / "nope.pem"
        elif case == "missing-key":
            key = tmp_path / "nope.key"
        elif case == "key-is-a-directory":
            key = tmp_path
        elif case == "not-pem":
            key = tmp_path / "garbage.key"
            key.write_text("not a key at all\n")
        elif case == "key-mismatch":
            key = pki.other_key
        else:
            key = tmp_path / "encrypted.key"
            _openssl("pkey", "-in", str(pki.key), "-aes256", "-passout", "pass:hunter2", "-out", str(key), cwd=tmp_path)
        config = OtlpConfig(grpc="127.0.0.1:0", http="127.0.0.1:0", tls_cert=str(cert), tls_key=str(key))
        receivers = Receivers(config, RecordingConsumer())

        async def scenario():
            try:
                await receivers.start()
            finally:
                await receivers.shutdown(0)

        with pytest.raises(TlsFilesError) as info:
            asyncio.run(scenario())
        message = str(info.value)
        assert isinstance(info.value, ValueError)  # `kvmiss serve` reports it in one line
        assert str(cert) in message or str(key) in message
        assert "otlp.tls_" in message
        secrets = pki.key.read_text() + pki.other_key.read_text()
        assert "BEGIN" not in message and not any(line in message for line in secrets.splitlines() if len(line) > 8)
        assert receivers.grpc_port is None and receivers.http_port is None  # nothing was bound

    @pytest.mark.parametrize("present", ["tls_cert", "tls_key"])
    def test_config_with_only_one_of_cert_and_key_is_refused(self, present):
        text = f'[otlp]\n{present} = "/etc/kvmiss/server.pem"\n'
        with pytest.raises(ConfigError, match="otlp.tls_cert and otlp.tls_key go together"):
            parse_config(text)

    def test_config_with_both_is_accepted(self):
        config = parse_config('[otlp]\ntls_cert = "/a.pem"\ntls_key = "/a.key"\n[export]\ntls_ca = "/ca.pem"\n')
        assert (config.otlp.tls_cert, config.otlp.tls_key, config.export.tls_ca) == ("/a.pem", "/a.key", "/ca.pem")


class TlsHttpSink(HttpSink):
    """`HttpSink` serving https with the test server certificate."""

    def __init__(self, pki: Pki) -> None:
        super().__init__()
        self._context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self._context.load_cert_chain(pki.cert, pki.key)

    async def start(self) -> TlsHttpSink:
        app = web.Application()
        app.router.add_post("/v1/traces", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port, ssl_context=self._context).start()
        return self

    @property
    def endpoint(self) -> str:
        return f"https://127.0.0.1:{self.port}"


class TlsGrpcSink(GrpcSink):
    """`GrpcSink` serving TLS with the test server certificate."""

    def __init__(self, pki: Pki) -> None:
        super().__init__()
        self._credentials = grpc.ssl_server_credentials([(pki.key.read_bytes(), pki.cert.read_bytes())])

    async def start(self) -> TlsGrpcSink:
        self._server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        assert self._server.add_secure_port(f"127.0.0.1:{self.port}", self._credentials)
        await self._server.start()
        return self

    @property
    def endpoint(self) -> str:
        return f"grpcs://127.0.0.1:{self.port}"


def _export_once(sink, tls_ca: str | None):
    """Build the exporter from ``[export]`` as `kvmiss serve` does and send one request."""

    async def scenario():
        async with running(sink):
            (exporter,) = build_exporters(ExportConfig(endpoint=sink.endpoint, timeout_s=3.0, tls_ca=tls_ca))
            try:
                return exporter, await exporter.export(numbered(5))
            finally:
                await exporter.shutdown()

    return asyncio.run(scenario())


class TestTlsExporters:
    @pytest.mark.parametrize("make_sink", [TlsHttpSink, TlsGrpcSink], ids=["https", "grpcs"])
    def test_with_tls_ca_the_sink_is_verified_and_reached(self, pki, make_sink):
        sink = make_sink(pki)
        exporter, result = _export_once(sink, str(pki.ca))
        assert type(exporter) is (HttpExporter if make_sink is TlsHttpSink else GrpcExporter)
        assert result.outcome is Outcome.ACCEPTED, result.message
        assert [batch_of(r) for r in sink.requests] == [5]

    @pytest.mark.parametrize("make_sink", [TlsHttpSink, TlsGrpcSink], ids=["https", "grpcs"])
    @pytest.mark.parametrize("trust", ["system-store", "other-ca"])
    def test_without_the_right_ca_verification_fails_and_nothing_is_sent(self, pki, make_sink, trust):
        sink = make_sink(pki)
        _, result = _export_once(sink, None if trust == "system-store" else str(pki.other_ca))
        assert result.outcome is Outcome.RETRYABLE  # the queue retries; a fixed CA gets through
        expected = "certificate verify failed" if make_sink is TlsHttpSink else "handshake failed"
        assert expected in result.message.lower()
        assert sink.requests == []

    def test_an_unusable_tls_ca_fails_at_build_time(self, tmp_path):
        junk = tmp_path / "junk.pem"
        junk.write_text("nothing here\n")
        for endpoint in ("https://127.0.0.1:1", "grpcs://127.0.0.1:1"):
            for ca in (tmp_path / "missing.pem", junk, tmp_path):
                with pytest.raises(ValueError, match=f"export.tls_ca: .*{ca.name}"):
                    build_exporters(ExportConfig(endpoint=endpoint, tls_ca=str(ca)))

    def test_plain_endpoints_ignore_tls_ca(self, pki):
        for sink in (HttpSink(), GrpcSink()):
            exporter, result = _export_once(sink, str(pki.ca))
            assert result.outcome is Outcome.ACCEPTED and len(sink.requests) == 1
