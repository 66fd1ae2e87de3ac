"""examples/rotel/: rotel in front of kvmiss, run for real.

rotel-agent (the Rust collector shipped in the `rotel` wheel) is started with the settings of
examples/rotel/rotel.env, only its ports substituted; `kvmiss serve` runs as a subprocess with
examples/rotel/kvmiss.toml (ports substituted, [[workers]] removed: no engines here), and a
small real OTLP/HTTP sink stands where Tempo or Jaeger would. Spans sent with the OTel SDK's
OTLP exporter to rotel must arrive at the sink exactly once, having passed through kvmiss:
the request spans carry every fact kvmiss needs but name a worker it does not track, so they
arrive labelled unknown_history / untracked, with raw inputs removed.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
import urllib.request

import psutil
import pytest
from example_checks import EXAMPLES, host_port
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from otlp_sink import OtlpSink, attributes
from zmq_ports import free_port

from kvmiss.schemas.config import load_config, parse_config

ROTEL = EXAMPLES / "rotel"
ENV_FILE = ROTEL / "rotel.env"
KVMISS_TOML = ROTEL / "kvmiss.toml"
DIGEST_KEY = "rotel-example-test-secret-01"


def rotel_binary() -> pathlib.Path:
    rotel = pytest.importorskip("rotel", reason="rotel is not installed (pip install -e '.[test]')")
    binary = pathlib.Path(rotel.__file__).parent / "rotel-agent"
    if not binary.exists():
        pytest.skip(f"the rotel wheel has no agent binary at {binary}")
    return binary


def read_env_file(path: pathlib.Path) -> dict[str, str]:
    """KEY=value lines as docker --env-file and systemd EnvironmentFile read them: no quotes,
    no trailing comments (both would become part of the value)."""
    env = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        match = re.fullmatch(r"(ROTEL_[A-Z0-9_]+)=(\S+)", line)
        assert match, f"{path.name}:{number}: not a plain ROTEL_KEY=value line: {line!r}"
        assert match[1] not in env, f"{path.name}:{number}: {match[1]} set twice"
        env[match[1]] = match[2]
    return env


def test_rotel_env_file_sets_only_variables_rotel_documents():
    help_text = subprocess.run([rotel_binary(), "start", "--help"], capture_output=True, text=True,
                               timeout=30).stdout
    documented = set(re.findall(r"\[env: (ROTEL_[A-Z0-9_]+)=", help_text))
    assert documented, "rotel-agent start --help lists no environment variables"
    env = read_env_file(ENV_FILE)
    assert set(env) <= documented, f"unknown to this rotel: {sorted(set(env) - documented)}"
    assert env["ROTEL_EXPORTER"] == "otlp"


def test_rotel_env_forwards_to_the_port_kvmiss_toml_listens_on():
    env, kvmiss = read_env_file(ENV_FILE), load_config(KVMISS_TOML)
    assert env["ROTEL_OTLP_EXPORTER_PROTOCOL"] == "grpc"
    assert host_port(env["ROTEL_OTLP_EXPORTER_ENDPOINT"])[1] == host_port(kvmiss.otlp.grpc)[1]
    rotel_ports = {host_port(env[k])[1] for k in ("ROTEL_OTLP_GRPC_ENDPOINT", "ROTEL_OTLP_HTTP_ENDPOINT")}
    kvmiss_ports = {host_port(a)[1] for a in (kvmiss.otlp.grpc, kvmiss.otlp.http, kvmiss.metrics.listen)}
    assert not rotel_ports & kvmiss_ports, "rotel and kvmiss share a host in this example"
    # kvmiss accepts traces only: rotel must not forward metrics or logs to it
    assert env.get("ROTEL_OTLP_RECEIVER_METRICS_DISABLED") == "true"
    assert env.get("ROTEL_OTLP_RECEIVER_LOGS_DISABLED") == "true"


# --- end to end --------------------------------------------------------------------------------

def kvmiss_config_for_test(tmp_path: pathlib.Path, export: str) -> pathlib.Path:
    """examples/rotel/kvmiss.toml with its [[workers]] removed, exporting to ``export`` and
    listening on ports the system picks (kvmiss prints them when it has bound them)."""
    example = load_config(KVMISS_TOML)
    text = KVMISS_TOML.read_text()
    for old, new in ((example.otlp.grpc, "127.0.0.1:0"), (example.otlp.http, "127.0.0.1:0"),
                     (example.export.endpoint, export), (example.metrics.listen, "127.0.0.1:0")):
        assert text.count(f'"{old}"') == 1, old
        text = text.replace(f'"{old}"', f'"{new}"')
    text = re.sub(r"^\[\[workers\]\]\n(?:(?!\[).*\n)*", "", text, flags=re.M)
    config = parse_config(text)
    assert config.workers == [] and config.engine == example.engine and config.history == example.history
    path = tmp_path / "kvmiss.toml"
    path.write_text(text)
    return path


def wait_for(predicate, timeout: float, what: str, log: pathlib.Path | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    tail = log.read_text()[-2000:] if log and log.exists() else ""
    pytest.fail(f"timed out waiting for {what}\n{tail}")


def listens(pid: int, port: int) -> bool:
    """The process itself listens on the port (not merely: something does; with free ports
    picked by number, another process on a busy machine may have taken it)."""
    process = psutil.Process(pid)
    connections = process.net_connections(kind="tcp") if hasattr(process, "net_connections") \
        else process.connections(kind="tcp")
    return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in connections)


@contextlib.contextmanager
def running(args: list, env: dict, log: pathlib.Path):
    with open(log, "wb") as out:  # a file, not a pipe: a full pipe would stall the process
        process = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)


@contextlib.contextmanager
def rotel_in_front_of(kvmiss_grpc: int, binary: pathlib.Path, base_env: dict, tmp_path: pathlib.Path):
    """rotel-agent with rotel.env's settings, listening on free ports and forwarding to kvmiss.
    Yields (its gRPC port, its log). Ports are picked by number, so on a busy machine another
    process may take one first: rotel then exits, and it is started again on other ports."""
    example_env = read_env_file(ENV_FILE)
    scheme_host, _ = example_env["ROTEL_OTLP_EXPORTER_ENDPOINT"].rsplit(":", 1)
    for attempt in range(3):
        grpc_port, http_port = free_port(), free_port()
        env = {**base_env, **example_env,
               "ROTEL_OTLP_GRPC_ENDPOINT": f"127.0.0.1:{grpc_port}",
               "ROTEL_OTLP_HTTP_ENDPOINT": f"127.0.0.1:{http_port}",
               "ROTEL_OTLP_EXPORTER_ENDPOINT": f"{scheme_host}:{kvmiss_grpc}",
               "ROTEL_PID_FILE": str(tmp_path / f"rotel-{attempt}.pid"),
               "ROTEL_LOG_FILE": str(tmp_path / f"rotel-agent-{attempt}.log")}
        log = tmp_path / f"rotel-{attempt}.log"
        with running([binary, "start"], env, log) as rotel:
            wait_for(lambda: rotel.poll() is not None
                     or (listens(rotel.pid, grpc_port) and listens(rotel.pid, http_port)), 20, "rotel to listen", log)
            if rotel.poll() is None:
                yield grpc_port, log
                return
    pytest.fail(f"rotel-agent did not start:\n{log.read_text()[-2000:]}")


def send_requests(grpc_port: int) -> list:
    """Two requests (a router span with kvmiss's inputs, a child llm_request span with the
    prompt size) and one unrelated span, exported by the SDK's OTLP/gRPC exporter."""
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "router"}))
    exporter = OTLPSpanExporter(endpoint=f"127.0.0.1:{grpc_port}", insecure=True)
    results: list = []

    class Recording(SimpleSpanProcessor):
        def on_end(self, span):
            results.append(exporter.export([span]))

    provider.add_span_processor(SimpleSpanProcessor(memory))
    provider.add_span_processor(Recording(exporter))
    tracer = provider.get_tracer("kvmiss.examples.test")
    now_ns = time.time_ns()
    for rid, worker in (("req-1", "w0"), ("req-2", "w1")):
        with tracer.start_as_current_span("route", attributes={
                "gen_ai.request.id": rid, "kvmiss.route.worker": worker, "kvmiss.route.policy": "prefix",
                "gen_ai.usage.cache_read.input_tokens": 16, "kvmiss.block_hashes": [1001, 1002, 1003, 1004],
                "kvmiss.lookup_time_unix_nano": now_ns}):
            with tracer.start_as_current_span("llm_request", kind=trace.SpanKind.SERVER, attributes={
                    "gen_ai.request.id": rid, "gen_ai.usage.prompt_tokens": 70}):
                pass
    with tracer.start_as_current_span("health-check", attributes={"http.route": "/health"}):
        pass
    provider.shutdown()
    assert results and all(r is SpanExportResult.SUCCESS for r in results), results
    return memory.get_finished_spans()


def test_spans_sent_to_rotel_arrive_enriched_by_kvmiss_at_the_sink(tmp_path):
    binary = rotel_binary()
    kvmiss_bin = pathlib.Path(sys.executable).parent / "kvmiss"
    assert kvmiss_bin.exists(), "kvmiss is not installed in this environment"
    sink = OtlpSink()
    try:
        config = kvmiss_config_for_test(tmp_path, sink.endpoint)
        base_env = {k: v for k, v in os.environ.items() if not k.startswith(("ROTEL_", "OTEL_"))}
        kv_log = tmp_path / "kvmiss.log"
        with running([kvmiss_bin, "serve", "--config", config], {**base_env, "KVMISS_DIGEST_KEY": DIGEST_KEY},
                     kv_log) as kvmiss:
            started = wait_for(lambda: kvmiss.poll() is not None or re.search(
                r"OTLP grpc :(\d+) http :\d+, metrics :(\d+)", kv_log.read_text()), 30, "kvmiss to start", kv_log)
            assert kvmiss.poll() is None, kv_log.read_text()
            kv_grpc, metrics_port = int(started[1]), int(started[2])

            with rotel_in_front_of(kv_grpc, binary, base_env, tmp_path) as (rotel_grpc, rotel_log):
                sent = send_requests(rotel_grpc)
                got = sink.wait_for_spans(len(sent), timeout=45)
                if len(got) < len(sent):
                    pytest.fail(f"{len(got)} of {len(sent)} spans reached the sink\n"
                                f"kvmiss:\n{kv_log.read_text()[-3000:]}\nrotel:\n{rotel_log.read_text()[-3000:]}")
                time.sleep(0.5)  # anything sent twice would show up now
                got = sink.spans()
                metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    finally:
        sink.close()

    # every span exactly once, ids unchanged (rotel and kvmiss forward, they do not re-create)
    assert sorted((s.trace_id, s.span_id) for s in got) == sorted(
        (s.context.trace_id.to_bytes(16, "big"), s.context.span_id.to_bytes(8, "big")) for s in sent)
    routes = {attributes(s)["gen_ai.request.id"]: attributes(s) for s in got if s.name == "route"}
    assert set(routes) == {"req-1", "req-2"}
    for a in routes.values():  # judged by kvmiss: facts complete, worker untracked
        assert a["kvmiss.label"] == "unknown_history" and a["kvmiss.owner"] == "telemetry"
        assert a["kvmiss.history"] == "untracked"
        assert 0 < a["kvmiss.missed_tokens"] <= 70 - 16  # reusable prompt tokens not served from cache
        assert "kvmiss.block_hashes" not in a, "raw inputs are removed before export"
    for s in got:
        if s.name != "route":
            assert not any(k.startswith("kvmiss.") for k in attributes(s)), s.name
    services = {kv.value.string_value for r in sink.requests for rs in r.resource_spans
                for kv in rs.resource.attributes if kv.key == "service.name"}
    assert services == {"router"}
    # and kvmiss counted them, under "untracked": span-supplied worker ids that are not in the
    # config never become metric label values
    assert ('kvmiss_requests_total{label="unknown_history",owner="telemetry",route_policy="prefix",'
            'worker="untracked"} 2.0') in metrics
