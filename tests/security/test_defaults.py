"""Secure defaults: every listener is on loopback unless configured wider, the example config
too; the size limits in the config are wired to what enforces them; the digest secret never
shows in a repr, a str, an HTTP answer or a log record of a running service.

Enforcement of the body limits themselves (413 over HTTP, RESOURCE_EXHAUSTED over gRPC, the
gunzip cap) and of ``max_pending_spans`` (RETRYABLE) is tested in tests/enricher/otlp/test_receiver.py
and tests/enricher/service/test_pipeline.py; not repeated here.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import urllib.error
import urllib.request
from pathlib import Path

import msgspec
import psutil
import pytest
from fuzz.fuzz_support import all_logs_at_debug

from kvmiss.enricher.service.serve import Service
from kvmiss.schemas import config as config_module
from kvmiss.schemas.config import Config, load_config, parse_config, parse_listen_address as parse_listen

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "kvmiss.toml"
SECRET = "inline-digest-secret-DKEY-0123456789"


def loopback_ip(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    mapped = getattr(address, "ipv4_mapped", None)  # gRPC binds ::ffff:127.0.0.1
    return (mapped or address).is_loopback


def is_loopback(address: str) -> bool:
    return loopback_ip(parse_listen(address)[0])


def listen_defaults() -> dict[str, str]:
    """Every string default of a config section that is a listen address (host:port)."""
    found = {}
    for section in msgspec.structs.fields(Config):
        section_type = section.type if isinstance(section.type, type) else None
        if section_type is None or not issubclass(section_type, msgspec.Struct):
            continue
        for field in msgspec.structs.fields(section_type):
            default = field.default
            if isinstance(default, str) and default.rpartition(":")[2].isdigit():
                found[f"{section.name}.{field.name}"] = default
    return found


def test_every_listen_address_default_is_loopback():
    defaults = listen_defaults()
    assert {"otlp.grpc", "otlp.http", "metrics.listen"} <= set(defaults)
    assert all(is_loopback(address) for address in defaults.values()), defaults
    config = parse_config("")  # an empty file: the defaults, as a running service gets them
    for address in (config.otlp.grpc, config.otlp.http, config.metrics.listen):
        assert is_loopback(address)


def test_the_example_config_listens_on_loopback_only():
    config = load_config(EXAMPLE)
    for address in (config.otlp.grpc, config.otlp.http, config.metrics.listen):
        assert is_loopback(address), address
    for worker in config.workers:
        assert "*" not in worker.endpoint and "0.0.0.0" not in worker.endpoint
    settings = [line.split("#")[0] for line in EXAMPLE.read_text().splitlines()]
    assert not any(wide in line for line in settings for wide in ("0.0.0.0", "[::]", '"::'))


def test_the_size_limits_in_the_config_reach_what_enforces_them():
    config = parse_config(
        "[otlp]\ngrpc = ''\nhttp = ''\nmax_body_bytes = 12345\nmax_pending_spans = 678\n"
        "[export]\nendpoint = 'http://127.0.0.1:9'\n[metrics]\nlisten = ''\n")
    service = Service(config)
    assert service.receivers._max_body == 12345  # HTTP cap after gunzip, gRPC max receive
    assert service.pipeline.max_pending_spans == 678
    assert service.queues and all(q.max_spans == 678 for q in service.queues)


@pytest.mark.parametrize("key", ["max_body_bytes", "max_pending_spans"])
def test_a_non_positive_limit_is_refused_at_start_up(key):
    with pytest.raises(config_module.ConfigError, match=key):
        parse_config(f"[otlp]\n{key} = -1\n")


# --- a running service --------------------------------------------------------------------


def service_config(**listen: str) -> Config:
    otlp = listen.get("otlp", ":0")
    metrics = listen.get("metrics", ":0")
    return parse_config(f"""
[otlp]
grpc = "{otlp}"
http = "{otlp}"
[privacy]
digest_key = "{SECRET}"
[metrics]
listen = "{metrics}"
""")


async def _get(url: str) -> str:
    def fetch() -> str:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return response.read().decode()
        except urllib.error.HTTPError as err:  # /readyz may answer 503: still an answer
            return err.read().decode()
    return await asyncio.to_thread(fetch)


async def _post(url: str, body: bytes, ctype: str) -> str:
    def post() -> str:
        request = urllib.request.Request(url, data=body, headers={"Content-Type": ctype})
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                return response.read().decode("latin-1")
        except urllib.error.HTTPError as err:
            return err.read().decode("latin-1")
    return await asyncio.to_thread(post)


def run_service(config: Config, during) -> list:
    """Start a Service on this thread's own loop, run ``during(service)``, shut it down."""
    async def main():
        service = Service(config)
        await service.start()
        try:
            return service, await during(service)
        finally:
            await service.shutdown(timeout=2)
    return asyncio.run(main())


def test_a_service_given_only_ports_listens_on_loopback_only():
    async def listening(service):
        ports = {service.receivers.grpc_port, service.receivers.http_port, service.metrics_port}
        sockets = [c for c in psutil.Process().net_connections(kind="inet")
                   if c.status == psutil.CONN_LISTEN and c.laddr.port in ports]
        return ports, sockets

    _, (ports, sockets) = run_service(service_config(otlp=":0", metrics=":0"), listening)
    assert None not in ports and {c.laddr.port for c in sockets} == ports
    assert all(loopback_ip(c.laddr.ip) for c in sockets), sockets


def test_the_digest_secret_never_shows_while_a_service_starts_serves_and_stops():
    config = service_config()
    assert SECRET not in repr(config) and SECRET not in str(config)

    async def serve(service):
        base = f"http://127.0.0.1:{service.metrics_port}"
        answers = [await _get(base + path) for path in ("/metrics", "/healthz", "/readyz")]
        traces = f"http://127.0.0.1:{service.receivers.http_port}/v1/traces"
        answers.append(await _post(traces, b'{"resourceSpans": [', "application/json"))
        answers.append(await _post(traces, b"\x0a\xff", "application/x-protobuf"))
        span = {"traceId": "01" * 16, "spanId": "02" * 8, "attributes": [
            {"key": "gen_ai.request.id", "value": {"stringValue": "r1"}},
            {"key": "gen_ai.usage.prompt_tokens", "value": {"intValue": 40}},
            {"key": "gen_ai.usage.cache_read.input_tokens", "value": {"intValue": 0}},
            {"key": "kvmiss.block_hashes", "value": {"arrayValue": {"values": [{"intValue": 7}]}}}]}
        body = json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [span]}]}]}).encode()
        answers.append(await _post(traces, body, "application/json"))
        return answers

    with all_logs_at_debug() as logs:
        service, answers = run_service(config, serve)
    shown = [repr(service), str(service), repr(service.digest_key), str(service.digest_key),
             *(repr(value) for value in vars(service).values()), *answers, *logs.texts]
    assert logs.texts, "start-up logged nothing: the capture is not working"
    assert any("kvmiss serving" in text for text in logs.texts)
    for text in shown:
        assert SECRET not in text and SECRET.encode().hex() not in text


def test_hostile_worker_ids_in_spans_cannot_grow_the_metrics_without_bound():
    from prometheus_client import CollectorRegistry
    from prometheus_client.exposition import generate_latest

    from kvmiss.enricher.service.metrics import KvmissCollector
    from kvmiss.enricher.service.pipeline import PipelineStats
    from kvmiss.schemas.attribution import Label

    stats = PipelineStats()
    for i in range(1000):
        stats.verdicts[(Label.UNKNOWN_HISTORY, "", f"worker-{i}")] += 1
    registry = CollectorRegistry()
    registry.register(KvmissCollector(stats, dict))
    series = [line for line in generate_latest(registry).decode().splitlines()
              if line.startswith("kvmiss_requests_total{")]
    assert len(series) <= 100


def test_log_capture_sees_every_logger_at_debug():
    """The capture the privacy tests rely on: DEBUG records of kvmiss's and others' loggers."""
    with all_logs_at_debug() as logs:
        logging.getLogger("kvmiss.pipeline").debug("pipeline %s", "debug")
        logging.getLogger("aiohttp.access").debug("third party")
    assert any("pipeline debug" in t for t in logs.texts) and any("third party" in t for t in logs.texts)
