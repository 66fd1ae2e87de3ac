"""The OTLP side's small interfaces, in Collector vocabulary: receiver -> consumer -> exporter.

A receiver (enricher/otlp/receiver.py) decodes ``ExportTraceServiceRequest`` bodies and hands
them to a `TracesConsumer` (the enrichment pipeline); the pipeline hands finished requests
to a `TracesExporter` (enricher/otlp/exporter.py). Outcomes are values: whether an error is
retryable is decided once, here, and mapped to gRPC status / HTTP codes only in the
receiver (UNAVAILABLE + RetryInfo / 503 + Retry-After for retryable; INVALID_ARGUMENT /
400 for permanent).
"""

from __future__ import annotations

import enum
import os
from typing import Protocol

import msgspec
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


class Outcome(enum.Enum):
    ACCEPTED = "accepted"
    RETRYABLE = "retryable"  # try again later (backpressure, downstream unavailable)
    PERMANENT = "permanent"  # the data is bad: do not retry


class ConsumeResult(msgspec.Struct, frozen=True):
    """What a consumer did with one export request.

    ACCEPTED may still reject some spans (``rejected_spans`` with ``message``: OTLP partial
    success); RETRYABLE carries how long the sender should wait.
    """

    outcome: Outcome
    rejected_spans: int = 0
    message: str = ""
    retry_after_s: float | None = None


ACCEPTED = ConsumeResult(Outcome.ACCEPTED)


class TracesConsumer(Protocol):
    async def consume(self, request: ExportTraceServiceRequest, body: bytes | None = None,
                      gzipped: bytes | None = None) -> ConsumeResult:
        """Take ownership of ``request``. Must not block the event loop; returns fast.
        ``body``: the protobuf bytes the receiver parsed ``request`` from, when it did and
        changed nothing since (a consumer may read them instead of the message);
        ``gzipped``: the gzip'd bytes ``body`` came in as, when it did (the span journal
        stores those: a third of the size)."""
        ...


class ExportResult(msgspec.Struct, frozen=True):
    outcome: Outcome
    message: str = ""
    retry_after_s: float | None = None


class EncodedRequest(msgspec.Struct, frozen=True):
    """An ``ExportTraceServiceRequest`` as its protobuf bytes, with its span count: what the
    pipeline hands on when it wrote the verdicts into the received bytes (enricher/otlp/_otlpwire.c)
    instead of into the parsed message. Immutable, so fan-out needs no copy."""

    body: bytes
    spans: int


OtlpRequest = ExportTraceServiceRequest | EncodedRequest  # what travels from the pipeline to exporters


class TracesExporter(Protocol):
    target: str  # where it sends (a URL, a host:port, a path): for logs, never a secret

    async def export(self, request: OtlpRequest) -> ExportResult:
        """Send one request downstream once (the caller retries RETRYABLE results)."""
        ...

    async def shutdown(self) -> None:
        ...


def span_count(request: OtlpRequest) -> int:
    if type(request) is EncodedRequest:
        return request.spans
    return sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)


def request_bytes(request: OtlpRequest) -> bytes:
    """The protobuf bytes of either form (an `EncodedRequest`'s own: no serializing)."""
    return request.body if type(request) is EncodedRequest else request.SerializeToString()


def request_message(request: OtlpRequest) -> ExportTraceServiceRequest:
    """The message of either form (an `EncodedRequest` parsed: for the slow paths only)."""
    return ExportTraceServiceRequest.FromString(request.body) if type(request) is EncodedRequest else request


try:  # OTLP requests on the wire in C (enricher/otlp/_otlpwire.c; its users: here and enricher/otlp/spans.py)
    if os.environ.get("KVMISS_PURE_PYTHON_OTLP") == "1":  # to rule the compiled path in or out
        raise ImportError("KVMISS_PURE_PYTHON_OTLP=1")
    from kvmiss.enricher.otlp import _otlpwire as WIRE
except ImportError:  # not built (no C compiler at install time): parsed messages only
    WIRE = None


def count_spans(body: bytes) -> tuple[int, int] | None:
    """(spans, spans whose trace id is not 16 bytes or span id not 8) of an encoded
    ``ExportTraceServiceRequest``, read in C from the bytes; None without the extension or
    for an encoding it does not model (then count the parsed message)."""
    return None if WIRE is None else WIRE.count_spans(body)
