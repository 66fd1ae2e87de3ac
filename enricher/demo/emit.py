"""The simulated fleet's traces, as a real router and real engines would export them.

Two OTel SDK tracer providers, each with the SDK's real OTLP exporter behind a batch
processor, so spans leave asynchronously and in batches as in production:

  router  (gRPC to kvmiss)  ``route`` span (SERVER): the routing decision and the cache outcome
          the API reported -- ``kvmiss.route.worker``, ``kvmiss.route.policy``,
          ``gen_ai.usage.cache_read.input_tokens``, ``kvmiss.block_hashes`` (the router hashes
          like the engine; uint64 values >= 2^63 as their int64 two's complement),
          ``kvmiss.lookup_time_unix_nano``, ``kvmiss.extra_key_kinds``; for requests whose
          prompts vary (timestamp, salt, adapter) also the opt-in ``kvmiss.token_ids`` +
          ``kvmiss.extra_keys`` so kvmiss can say where they diverged.
          ``kv_transfer`` span (CLIENT) for a disaggregated request: ``kvmiss.transfer.result``
          and ``kvmiss.transfer.source``; it ends before the route span, so it is exported
          no later than the span carrying the outcome.
  engine  (HTTP to kvmiss)  vLLM's ``llm_request`` span (SERVER), a child of the route span
          through trace context: ``gen_ai.request.id``, ``gen_ai.usage.prompt_tokens``,
          ``gen_ai.latency.time_in_queue`` and no cached-token attribute (as vLLM).

`request_spans` is the one function that turns a finished simulated request into spans.
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from kvmiss.enricher.demo.engine import SimRequest

MODEL = "demo-model"
# Kinds whose router opts in to raw prompt material (kvmiss hashes it, uses it for the
# divergence detail, and strips it before export).
OPT_IN_KINDS = frozenset({"volatile", "tenant", "lora"})
# The batch processors' schedule delay (the SDK default is 5 s; 1 s is common). It is also what
# gives the *other* workers' streams time to pass a request's lookup time before kvmiss judges
# it: the service's history wait covers only the chosen worker's stream, and an idle engine
# publishes nothing, so a request judged at once finds idle workers "lagging" (an honest
# unknown when they might have held the block). Keep it below the assemble wait: the router's
# and the engine's spans of one request leave from different providers.
EXPORT_DELAY_MS = 1000


def as_int64(value: int) -> int:
    """An engine uint64 block hash as an OTel int attribute (signed 64-bit)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _ns(seconds: float) -> int:
    return round(seconds * 1e9)


def request_spans(router: trace.Tracer, engine: trace.Tracer, request: SimRequest,
                  block_size: int, finished_at: float) -> None:
    """Emit one finished request's spans: route (+ kv_transfer) and llm_request."""
    assert request.lookup_time is not None and request.routed_at is not None
    routed, lookup = _ns(request.routed_at), _ns(request.lookup_time)
    end = max(_ns(finished_at), lookup + 1)
    attributes = {
        "gen_ai.request.id": request.id,
        "gen_ai.request.model": MODEL,
        "kvmiss.route.worker": request.worker,
        "kvmiss.route.policy": request.route_policy,
        "gen_ai.usage.cache_read.input_tokens": request.cached_tokens,
        "kvmiss.block_hashes": [as_int64(h) for h in
                                request.chain[:len(request.token_ids) // block_size]],
        "kvmiss.lookup_time_unix_nano": lookup,
    }
    if request.extra_key_kinds:
        attributes["kvmiss.extra_key_kinds"] = list(request.extra_key_kinds)
    if request.kind in OPT_IN_KINDS:
        attributes["kvmiss.token_ids"] = list(request.token_ids)
        if request.extra_keys_json is not None:
            attributes["kvmiss.extra_keys"] = request.extra_keys_json
    route = router.start_span("route", kind=trace.SpanKind.SERVER, attributes=attributes,
                              start_time=routed)
    context = trace.set_span_in_context(route)
    if request.transfer is not None:
        transfer = router.start_span("kv_transfer", context=context, kind=trace.SpanKind.CLIENT,
                                     start_time=routed, attributes={
                                         "gen_ai.request.id": request.id,
                                         "kvmiss.transfer.result": request.transfer.result.value,
                                         "kvmiss.transfer.source": request.transfer.source or "",
                                     })
        transfer.end(end_time=max(routed + 1, lookup - 1))
    llm = engine.start_span("llm_request", context=context, kind=trace.SpanKind.SERVER,
                            start_time=routed, attributes={
                                "gen_ai.request.id": request.id,
                                "gen_ai.request.model": MODEL,
                                "gen_ai.usage.prompt_tokens": len(request.token_ids),
                                "gen_ai.usage.completion_tokens": len(request.output_ids),
                                "gen_ai.latency.time_in_queue": request.lookup_time - request.routed_at,
                            })
    llm.end(end_time=end)
    route.end(end_time=end + 1_000)


class SpanEmitter:
    """The router's and the engines' tracer providers, exporting to kvmiss's OTLP ports."""

    def __init__(self, grpc_port: int, http_port: int, block_size: int):
        self.block_size = block_size
        self.emitted = 0  # requests
        self.spans = 0
        self.providers = []
        self.router = self._tracer(
            {"service.name": "demo-router"}, "kvmiss-demo-router",
            GrpcExporter(endpoint=f"127.0.0.1:{grpc_port}", insecure=True))
        self.engine = self._tracer(
            {"service.name": "vllm"}, "vllm.engine",
            HttpExporter(endpoint=f"http://127.0.0.1:{http_port}/v1/traces"))

    def _tracer(self, resource: dict, name: str, exporter) -> trace.Tracer:
        provider = TracerProvider(resource=Resource.create(resource))
        provider.add_span_processor(BatchSpanProcessor(
            exporter, schedule_delay_millis=EXPORT_DELAY_MS, max_export_batch_size=256))
        self.providers.append(provider)
        return provider.get_tracer(name)

    def emit(self, request: SimRequest, finished_at: float) -> None:
        request_spans(self.router, self.engine, request, self.block_size, finished_at)
        self.emitted += 1
        self.spans += 3 if request.transfer is not None else 2

    def flush(self, timeout_s: float = 10.0) -> None:
        for provider in self.providers:
            provider.force_flush(int(timeout_s * 1000))

    def close(self) -> None:
        for provider in self.providers:
            provider.shutdown()
