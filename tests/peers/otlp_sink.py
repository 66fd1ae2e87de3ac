"""A small real OTLP/HTTP trace sink for tests: POST /v1/traces (protobuf, gzip), kept in
memory. It stands where Jaeger, Tempo or Phoenix would."""

from __future__ import annotations

import gzip
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


class OtlpSink:
    def __init__(self, port: int = 0) -> None:
        self.requests: list[ExportTraceServiceRequest] = []
        self.lock = threading.Lock()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                with sink.lock:
                    sink.requests.append(ExportTraceServiceRequest.FromString(body))
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def spans(self) -> list:
        with self.lock:
            return [s for r in self.requests for rs in r.resource_spans
                    for ss in rs.scope_spans for s in ss.spans]

    def wait_for_spans(self, count: int, timeout: float = 15.0) -> list:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            spans = self.spans()
            if len(spans) >= count:
                return spans
            time.sleep(0.05)
        return self.spans()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def attributes(span) -> dict:
    out = {}
    for kv in span.attributes:
        kind = kv.value.WhichOneof("value")
        if kind == "array_value":
            out[kv.key] = [getattr(v, v.WhichOneof("value")) for v in kv.value.array_value.values]
        else:
            out[kv.key] = getattr(kv.value, kind)
    return out
