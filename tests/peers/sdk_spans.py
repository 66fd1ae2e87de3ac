"""Real finished spans of the OpenTelemetry SDK (ReadableSpan), as a router's or an engine's
exporter hands them over: for tests that send spans through the SDK's own exporters."""

from __future__ import annotations

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter


def sdk_spans(n: int = 3):
    """``n`` finished spans ``llm_request <i>`` of service ``router``, with a request id and a
    prompt-token count each."""
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "router"}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("kvmiss.test")
    for i in range(n):
        with tracer.start_as_current_span(f"llm_request {i}") as span:
            span.set_attribute("gen_ai.request.id", f"req-{i}")
            span.set_attribute("gen_ai.usage.prompt_tokens", 100 + i)
    return memory.get_finished_spans()
