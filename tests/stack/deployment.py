"""The recommended deployment of examples/collector/replicas.yaml, all real, on loopback:

    engines (demo publishers, ZeroMQ) ----------------------------.
    router + engine (OTel SDK) -> gateway Collector [traces/ingest] |
        -> loadbalancing/kvmiss by trace id -> kvmiss-0 | kvmiss-1 <'  (each follows every worker)
        -> [traces/enriched] -> spanmetrics -> prometheus exporter <- Prometheus (+ kvmiss /metrics)
                             -> loadbalancing/traceid -> [traces/sample] -> tail_sampling -> Jaeger v2

The gateway runs the shipped replicas.yaml unchanged; its ``${env:...}`` endpoints are set to
free loopback ports. The replicas run kvmiss-replica.toml's settings ([otlp] max_pending_spans,
[history] waits) on loopback ports, exporting to the gateway's enriched receiver.
"""

from __future__ import annotations

import random
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from reliability_rig import BLOCK, PROMPT_TOKENS, Engines, Kvmiss, bring_up, router_attrs, wait_applied
from stack import COLLECTOR_EXAMPLES, Collector, Jaeger, Prometheus, free_port, http_get, wait_until

WORKERS = ["w0", "w1", "w2", "w3"]
ROUTER_SERVICE, ENGINE_SERVICE = "router", "vllm"
REPLICA_TOML = tomllib.loads((COLLECTOR_EXAMPLES / "kvmiss-replica.toml").read_text())


def replica_config(*, grpc: int, http: int, metrics: int, export_grpc: int, workers: dict[str, tuple[str, str]],
                   journal: Path | None = None, max_pending_spans: int | None = None) -> str:
    """kvmiss-replica.toml's settings, on loopback ports, with the test fleet's streams."""
    history = REPLICA_TOML["history"]
    pending = max_pending_spans or REPLICA_TOML["otlp"]["max_pending_spans"]
    text = f"""
[otlp]
grpc = "127.0.0.1:{grpc}"
http = "127.0.0.1:{http}"
max_pending_spans = {pending}
[export]
endpoint = "grpc://127.0.0.1:{export_grpc}"
timeout_s = {REPLICA_TOML["export"]["timeout_s"]}
""" + (f'journal = "{journal}"\n' if journal else "") + f"""
[engine]
block_size = {BLOCK}
[privacy]
digest_key = "stack-test-secret-000001"
[metrics]
listen = "127.0.0.1:{metrics}"
unknown_budget = {REPLICA_TOML["metrics"]["unknown_budget"]}
[history]
wait_s = {history["wait_s"]}
assemble_wait_s = {history["assemble_wait_s"]}
"""
    for worker, (endpoint, replay) in workers.items():
        text += f'[[workers]]\nid = "{worker}"\nendpoint = "{endpoint}"\nreplay_endpoint = "{replay}"\n'
    return text


class Replica:
    """One ``kvmiss serve`` on fixed ports, so that a restart comes back where the Collector sends."""

    def __init__(self, workdir: Path, name: str, export_grpc: int, workers: dict[str, tuple[str, str]],
                 **config):
        if config.get("journal"):  # a journal directory of its own
            config = {**config, "journal": Path(config["journal"]) / name}
        self.workdir, self.name, self.export_grpc, self.workers, self.config = workdir, name, export_grpc, workers, config
        self.grpc, self.http, self.metrics = free_port(), free_port(), free_port()
        self.kvmiss: Kvmiss | None = None

    def start(self) -> Kvmiss:
        text = replica_config(grpc=self.grpc, http=self.http, metrics=self.metrics, export_grpc=self.export_grpc,
                              workers=self.workers, **self.config)
        self.kvmiss = Kvmiss(text, self.workdir, http_port=self.http, metrics_port=self.metrics, grpc_port=self.grpc)
        return self.kvmiss


class HeldSpans(SpanProcessor):
    """Keeps ended spans instead of exporting them: a slow engine's spans, sent later."""

    def __init__(self):
        self.spans: list[ReadableSpan] = []

    def on_end(self, span: ReadableSpan) -> None:
        self.spans.append(span)


class Router:
    """A router and an engine instrumented with the OTel SDK, exporting OTLP/gRPC to the
    gateway: per request a ``route`` span (kvmiss's inputs) and a child ``llm_request``.
    ``late=True`` requests keep the engine's span back until `release_late`."""

    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        self.providers = []
        self.tracers = {}
        self.held = HeldSpans()
        for service in (ROUTER_SERVICE, ENGINE_SERVICE, "late"):
            provider = TracerProvider(resource=Resource.create({"service.name": service.replace("late", ENGINE_SERVICE)}))
            if service == "late":
                provider.add_span_processor(self.held)
            else:
                provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True),
                                                               schedule_delay_millis=100, max_export_batch_size=256))
            self.providers.append(provider)
            self.tracers[service] = provider.get_tracer("kvmiss.tests.stack")

    def release_late(self, chunk: int = 512, pause_s: float = 0.0) -> int:
        """Exports the held engine spans now, ``chunk`` per request ``pause_s`` apart; returns how many."""
        spans, self.held.spans = self.held.spans, []
        exporter = OTLPSpanExporter(endpoint=self.endpoint, insecure=True)
        for i in range(0, len(spans), chunk):
            assert exporter.export(spans[i:i + chunk]).name == "SUCCESS", "the gateway refused the late spans"
            time.sleep(pause_s)
        exporter.shutdown()
        return len(spans)

    def request(self, rid: str, worker: str, block: int, lookup: float, hit: bool = False, late: bool = False,
                engine_facts: bool = False) -> str:
        """Sends one request's two spans; returns its trace id (hex, as Jaeger shows it)."""
        attrs = router_attrs(rid, worker, block, lookup)
        if engine_facts:  # the prompt length comes from the engine's span (gen_ai.usage.prompt_tokens)
            del attrs["gen_ai.usage.input_tokens"]
        if hit:
            attrs["gen_ai.usage.cache_read.input_tokens"] = PROMPT_TOKENS - 1  # every full block reused
        with self.tracers[ROUTER_SERVICE].start_as_current_span("route", kind=trace.SpanKind.CLIENT,
                                                                attributes=attrs) as route:
            with self.tracers["late" if late else ENGINE_SERVICE].start_as_current_span(
                    "llm_request", kind=trace.SpanKind.SERVER,
                    attributes={"gen_ai.request.id": rid, "gen_ai.usage.prompt_tokens": PROMPT_TOKENS}):
                pass
            return f"{route.get_span_context().trace_id:032x}"

    def flush(self) -> None:
        for provider in self.providers:
            assert provider.force_flush(30_000), "the OTel SDK could not export to the gateway"

    def close(self) -> None:
        for provider in self.providers:
            provider.shutdown()


@dataclass
class Sent:
    """What the test sent: request id -> (trace id, the truth's label)."""
    requests: dict[str, tuple[str, str]] = field(default_factory=dict)

    def traces_with(self, label: str) -> set[str]:
        return {t for t, lab in self.requests.values() if lab == label}


class Deployment:
    """Starts the parts in dependency order; `close` stops whatever was started."""

    def __init__(self, workdir: Path, *, replicas: int = 2, listed: int | None = None, seed: int = 26,
                 gateway_config: Path = COLLECTOR_EXAMPLES / "replicas.yaml", split_tiers: bool = False,
                 **replica_config_kwargs):
        """``listed``: how many of the replicas the gateway's list names (default: all).
        ``split_tiers``: two Collectors running the same file, one for tier 1 (the router sends
        to it, it balances over the replicas) and one for tier 2 (the replicas export to it,
        it samples): a change of the replica list then restarts only the first."""
        self.gateway_config = gateway_config
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = workdir
        self.closers: list = []
        self.rng = random.Random(seed)
        self.never_stored = 4999
        self.resident: dict[str, set[int]] = {}
        try:
            self.engines = Engines(WORKERS)
            self.closers.append(self.engines.close)
            self.jaeger = Jaeger(workdir)
            self.closers.append(self.jaeger.kill)
            names = ("ingest_grpc", "ingest_http", "enriched", "sampler", "spanmetrics")
            self.ports = {name: free_port() for name in names}
            # tier 2's ports: the same Collector's, or the second one's
            self.tier2 = {name: free_port() for name in names} if split_tiers else self.ports
            streams = {w: self.engines.endpoints(w) for w in WORKERS}
            self.replicas = [Replica(workdir, f"kvmiss-{i}", self.tier2["enriched"], streams, **replica_config_kwargs)
                             for i in range(replicas)]
            if split_tiers:
                sampler = Collector("otelcol-tier2", self.gateway_config, self.workdir,
                                    self.gateway_env([r.grpc for r in self.replicas], self.tier2),
                                    ready_port=self.tier2["enriched"])
                self.closers.append(sampler.kill)
            self.gateway = self.start_gateway([r.grpc for r in self.replicas[:listed]])
            for replica in self.replicas:  # all subscribed before the engines' first batch
                replica.start()
                self.closers.append(lambda r=replica: r.kvmiss and r.kvmiss.kill())
            for replica in self.replicas:
                bring_up(replica.kvmiss, self.engines)
            self.router = Router(f"127.0.0.1:{self.ports['ingest_grpc']}")
            self.closers.append(self.router.close)
            self.prometheus: Prometheus | None = None
        except BaseException:
            self.close()
            raise

    def gateway_env(self, replica_ports: list[int], ports: dict[str, int] | None = None) -> dict[str, str]:
        p = ports or self.ports
        return {"OTELCOL_INGEST_GRPC": f"127.0.0.1:{p['ingest_grpc']}", "OTELCOL_INGEST_HTTP": f"127.0.0.1:{p['ingest_http']}",
                "OTELCOL_ENRICHED_GRPC": f"127.0.0.1:{p['enriched']}", "OTELCOL_SAMPLER_GRPC": f"127.0.0.1:{p['sampler']}",
                "KVMISS_REPLICAS": "[" + ", ".join(f"127.0.0.1:{port}" for port in replica_ports) + "]",
                "OTELCOL_GATEWAYS": f"[127.0.0.1:{self.tier2['sampler']}]",
                "TRACE_BACKEND_OTLP_GRPC": f"127.0.0.1:{self.jaeger.otlp_port}",
                "SPANMETRICS_PROMETHEUS": f"127.0.0.1:{p['spanmetrics']}"}

    def start_gateway(self, replica_ports: list[int]) -> Collector:
        gateway = Collector("otelcol-gateway", self.gateway_config, self.workdir,
                            self.gateway_env(replica_ports), ready_port=self.ports["ingest_grpc"])
        self.closers.append(gateway.kill)
        return gateway

    def start_prometheus(self) -> Prometheus:
        jobs = {"kvmiss": [f"127.0.0.1:{r.metrics}" for r in self.replicas],
                "spanmetrics": [f"127.0.0.1:{self.tier2['spanmetrics']}"]}
        self.prometheus = Prometheus(self.workdir, jobs)
        self.closers.append(self.prometheus.kill)
        wait_until(self.prometheus.targets_up, "Prometheus to scrape every target", 30)
        return self.prometheus

    def round(self, sent: Sent, requests: int, *, hits: int = 0, allowed=None, late: bool = False,
              engine_facts: bool = False) -> None:
        """Every worker stores (mostly its own blocks, one of another's) and evicts some, then
        ``requests`` misses, aiming in turn at each (worker, class) pair -- ``allowed`` ones
        only, if given -- with a block the truth puts there, and ``hits`` hits.
        ``late``: the engine spans wait for `router.release_late()`. ``engine_facts``: the
        prompt length is on the engine's span only, so kvmiss holds each router span until
        its engine span arrives (or [history] assemble_wait_s passes)."""
        for i, worker in enumerate(WORKERS):  # an engine evicts only what it holds
            held = self.resident.setdefault(worker, set())
            removed = self.rng.sample(sorted(held), min(3, len(held)))
            other = self.own_blocks(WORKERS[(i + 1 + self.rng.randrange(len(WORKERS) - 1)) % len(WORKERS)])
            candidates = self.rng.sample(self.own_blocks(worker), 3) + [self.rng.choice(other)]
            stored = [b for b in candidates if b not in held]
            held.difference_update(removed)
            held.update(stored)
            self.engines.publish(worker, stored=stored, removed=removed)
        t = self.engines.mark()
        for replica in self.replicas:
            if replica.kvmiss.proc.poll() is None:
                wait_applied(replica.kvmiss, dict(self.engines.seqs))
        targets = sorted(allowed) if allowed is not None else [
            (w, label) for w in WORKERS for label in ("evicted", "no_match", "routing_miss", "resident_miss")]
        universe = [b for w in WORKERS for b in self.own_blocks(w)] + [self.never_stored]
        offset = len(sent.requests)
        for n in range(requests):
            worker, want = targets[(offset + n) % len(targets)]
            blocks = [b for b in universe if self.engines.truth.label(worker, b, t) == want]
            if not blocks:
                continue  # that class cannot happen on that worker now
            block = self.rng.choice(blocks)
            rid = f"q{len(sent.requests)}"
            sent.requests[rid] = (self.router.request(rid, worker, block, t, late=late, engine_facts=engine_facts), want)
        for i in range(hits):  # spread over the workers in turn
            rid = f"q{len(sent.requests)}"
            sent.requests[rid] = (self.router.request(rid, WORKERS[i % len(WORKERS)], self.never_stored, t, hit=True), "hit")
        self.router.flush()

    def own_blocks(self, worker: str) -> list[int]:
        first = 5000 + 20 * WORKERS.index(worker)
        return list(range(first, first + 20))

    def spanmetrics_text(self) -> str:
        status, body = http_get(f"http://127.0.0.1:{self.tier2['spanmetrics']}/metrics")
        return body.decode() if status == 200 else ""

    def close(self) -> None:
        for close in reversed(self.closers):
            try:
                close()
            except Exception:  # noqa: BLE001 - stop the rest too
                pass
        self.closers.clear()


def wait_quiet(replicas: list[Replica], requests: int, timeout: float = 60.0) -> None:
    """Until the replicas have judged ``requests`` requests between them and each has exported
    all it received (nothing held, nothing queued)."""
    def quiet():
        scrapes = [replica.kvmiss.scrape() for replica in replicas]
        return (sum(m.get("kvmiss_requests") for m in scrapes) >= requests
                and all(m.get("kvmiss_spans_received") == m.get("kvmiss_export_spans_delivered") for m in scrapes))
    wait_until(quiet, f"the replicas to judge {requests} requests and export every span", timeout, interval=0.5)
