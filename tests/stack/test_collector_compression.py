"""The real Collector's exporters, set to each ``compression`` they offer, sending to kvmiss:

* ``otlphttp``: what kvmiss takes (gzip, the default; zstd, deflate, zlib) delivers every span;
  what it refuses (snappy, lz4) is answered 415 naming what it takes. The Collector drops
  that batch as a permanent error and logs kvmiss's answer, so a user who picked one learns
  it from the first batch, not from missing verdicts.
* ``otlp_grpc``: gzip (the default) and none deliver; zstd and snappy are refused by grpc's
  own core before kvmiss sees the call ("Error parsing 'grpc-encoding' metadata", INTERNAL),
  which docs/COLLECTOR.md states: for zstd, use OTLP/HTTP.

Spans enter the Collector from the OpenTelemetry SDK's OTLP/HTTP exporter, as a router's do.
"""

from __future__ import annotations

import asyncio
import re

import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace.export import SpanExportResult
from sdk_spans import sdk_spans
from stack import Collector, free_port, wait_until

from kvmiss.enricher.otlp.interfaces import ACCEPTED
from kvmiss.enricher.otlp.receiver import Receivers
from kvmiss.schemas.config import OtlpConfig

CONFIG = """\
receivers:
  otlp:
    protocols:
      http:
        endpoint: 127.0.0.1:${env:IN_PORT}
exporters:
  otlphttp:
    endpoint: http://127.0.0.1:${env:KVMISS_HTTP_PORT}
    compression: ${env:COMPRESSION}
    retry_on_failure:
      enabled: false
    sending_queue:
      enabled: false
  otlp_grpc:
    endpoint: 127.0.0.1:${env:KVMISS_GRPC_PORT}
    tls:
      insecure: true
    compression: ${env:COMPRESSION}
    retry_on_failure:
      enabled: false
    sending_queue:
      enabled: false
service:
  telemetry:
    metrics:
      readers:
        - pull:
            exporter:
              prometheus:
                host: ${env:OTELCOL_TELEMETRY_HOST}
                port: ${env:OTELCOL_TELEMETRY_PORT}
  pipelines:
    traces:
      receivers: [otlp]
      exporters:
        - ${env:EXPORTER}
"""
HTTP_TAKEN, HTTP_REFUSED = ("gzip", "zstd", "deflate", "zlib"), ("snappy", "lz4")
GRPC_TAKEN, GRPC_REFUSED = ("gzip", "none"), ("zstd", "snappy")
CASES = ([("otlphttp", c) for c in HTTP_TAKEN + HTTP_REFUSED]
         + [("otlp_grpc", c) for c in GRPC_TAKEN + GRPC_REFUSED])


class Recorder:
    def __init__(self) -> None:
        self.names: list[str] = []

    async def consume(self, request, body=None, gzipped=None):
        self.names += [s.name for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans]
        return ACCEPTED


def exported_failed(collector: Collector) -> float:
    """The Collector's own count of spans its exporter failed to send."""
    found = re.findall(r"^otelcol_exporter_send_failed_spans(?:_total)?\{[^}]*\} (\S+)$", collector.telemetry(), re.M)
    return sum(float(v) for v in found)


@pytest.mark.parametrize("exporter, compression", CASES, ids=[f"{e}-{c}" for e, c in CASES])
def test_the_collectors_compressions_reach_kvmiss_or_are_refused_with_a_reason(exporter, compression, tmp_path):
    taken = compression in (HTTP_TAKEN if exporter == "otlphttp" else GRPC_TAKEN)
    config = tmp_path / "collector.yaml"
    config.write_text(CONFIG)
    recorder = Recorder()
    spans = sdk_spans(20)

    async def scenario():
        receivers = Receivers(OtlpConfig(grpc="127.0.0.1:0", http="127.0.0.1:0"), recorder)
        await receivers.start()
        in_port = free_port()
        env = {"IN_PORT": str(in_port), "KVMISS_HTTP_PORT": str(receivers.http_port),
               "KVMISS_GRPC_PORT": str(receivers.grpc_port), "COMPRESSION": compression, "EXPORTER": exporter}
        collector = None
        try:
            collector = await asyncio.to_thread(Collector, f"otelcol-{compression}", config, tmp_path, env, in_port)
            sender = OTLPSpanExporter(endpoint=f"http://127.0.0.1:{in_port}/v1/traces")
            result = await asyncio.to_thread(sender.export, spans)
            sender.shutdown()
            if taken:
                await asyncio.to_thread(wait_until, lambda: len(recorder.names) >= len(spans),
                                        f"{len(spans)} spans through the Collector with {compression}", 30)
                failed = 0.0
            else:
                failed = await asyncio.to_thread(wait_until, lambda: exported_failed(collector),
                                                 f"the Collector's exporter to report {compression} refused", 30)
            return result, receivers.stats.copy(), failed
        finally:
            if collector is not None:
                await asyncio.to_thread(collector.stop)
            await receivers.shutdown(1.0)

    result, stats, failed = asyncio.run(scenario())
    if taken:
        assert result is SpanExportResult.SUCCESS
        assert sorted(recorder.names) == sorted(s.name for s in spans)
        if exporter == "otlphttp":
            assert stats[f"http_requests_{compression}"] >= 1  # the Collector really compressed
        return
    # Without a sending queue the Collector exports while the sender waits, so the refusal
    # reaches the sender too; the Collector's log says why.
    assert result is SpanExportResult.FAILURE and recorder.names == [] and failed == len(spans)
    log = (tmp_path / f"otelcol-{compression}.log").read_text()
    if exporter == "otlphttp":
        assert stats["requests_unsupported_encoding"] >= 1
        assert "415" in log and "Content-Encoding must be gzip, deflate, zlib, zstd or identity" in log
    else:
        assert "grpc-encoding" in log
