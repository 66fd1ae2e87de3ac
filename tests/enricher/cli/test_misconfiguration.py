"""What an operator meets when the config is wrong, tried as they would: `kvmiss serve --check`
and `kvmiss serve` as processes, real sockets, a real OTLP sink, spans from the OpenTelemetry SDK.

Static faults (a bad address, scheme, port, path, a busy port, no destination): both commands
exit 2 with one line naming the key, no traceback. Runtime faults (an engine that is not there,
a downstream that is down and comes back): serve says so at WARNING within seconds, in its
metrics and in /readyz, and delivers nothing in silence.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from otlp_sink import OtlpSink
from zmq_ports import quiet_port

KEY_ENV = {"KVMISS_DIGEST_KEY": "misconfiguration-test-secret-01"}


def base(export: str = 'endpoint = "http://127.0.0.1:4319"', workers: str = "", **sections: str) -> str:
    otlp = sections.get("otlp", 'grpc = "127.0.0.1:0"\nhttp = "127.0.0.1:0"')
    metrics = sections.get("metrics", 'listen = "127.0.0.1:0"')
    history = sections.get("history", "wait_s = 0.5\nassemble_wait_s = 1.0")
    return (f"[otlp]\n{otlp}\n[export]\n{export}\n[metrics]\n{metrics}\n[history]\n{history}\n"
            f"[privacy]\ndigest_key_env = \"KVMISS_DIGEST_KEY\"\n{workers}")


def worker(endpoint: str, wid: str = "w0", extra: str = "") -> str:
    return f'[[workers]]\nid = "{wid}"\nendpoint = "{endpoint}"\n{extra}'


def kvmiss(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvmiss.enricher.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **KEY_ENV})


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert "Traceback" not in stderr, stderr
    assert len(lines) == 1, stderr
    return lines[0]


# (case, config, the key the message names, words it must hold)
STATIC = [
    ("grpc port out of range", base(otlp='grpc = "127.0.0.1:99999"\nhttp = ""'), "otlp.grpc", "outside 0-65535"),
    ("http port out of range", base(otlp='grpc = ""\nhttp = "127.0.0.1:99999"'), "otlp.http", "outside 0-65535"),
    ("metrics port negative", base(metrics='listen = "127.0.0.1:-5"'), "metrics.listen", "not a number"),
    ("grpc without a port", base(otlp='grpc = "localhost"\nhttp = ""'), "otlp.grpc", "not host:port"),
    ("ipv6 without brackets", base(otlp='grpc = "::1:4317"\nhttp = ""'), "otlp.grpc", "brackets"),
    ("worker without a scheme", base(workers=worker("127.0.0.1:25557")), "workers[0] (id 'w0').endpoint",
     "needs a scheme"),
    ("worker without a port", base(workers=worker("tcp://vllm-0")), "workers[0] (id 'w0').endpoint", "has no port"),
    ("worker with a bad scheme", base(workers=worker("http://vllm-0:5557")), "workers[0] (id 'w0').endpoint",
     "needs a scheme"),
    ("worker port moved past 65535 by its rank", base(workers=worker("tcp://vllm-0:65535", extra="dp_rank = 2\n")),
     "workers[0] (id 'w0').endpoint", "dp_rank 2 moves the port"),
    ("replay endpoint on every interface", base(workers=worker("tcp://vllm-0:5557",
                                                                extra='replay_endpoint = "tcp://*:5558"\n')),
     "replay_endpoint", "for binding"),
    ("dns endpoint template without a port", base() + '[fleet.dns]\nname = "engines.example"\n'
                                                      'endpoint = "tcp://{host}"\n', "fleet.dns.endpoint", "no port"),
    ("no destination", base(export=""), "export", "no destination"),
    ("discard beside a file", base(export='discard = true\nfile = "/tmp/x.jsonl"'), "export.discard", "cannot go"),
    ("export scheme", base(export='endpoint = "ftp://collector:4318"'), "export.endpoint", "must start with"),
    ("export grpc without a port", base(export='endpoint = "grpc://collector"'), "export.endpoint", "needs a port"),
    ("export port out of range", base(export='endpoint = "http://collector:70000"'), "export.endpoint", "out of range"),
    ("export file in a missing directory", base(export='file = "/nonexistent-dir/out.jsonl"'), "export.file",
     "does not exist"),
    ("export file under a file", base(export='file = "/etc/hostname/out.jsonl"'), "export.file", "not a directory"),
    ("request records in a missing directory",
     base(export='endpoint = "http://127.0.0.1:4319"\nrequest_records = "/nonexistent-dir/r.jsonl"'),
     "export.request_records", "does not exist"),
    ("two listeners on one port", base(otlp='grpc = "127.0.0.1:24317"\nhttp = ""', metrics='listen = "127.0.0.1:24317"'),
     "metrics.listen", "also otlp.grpc's address"),
    ("readiness share above 1", base(metrics='listen = "127.0.0.1:0"\nready_min_connected_share = 1.5'),
     "metrics.ready_min_connected_share", "between 0 and 1"),
]


@pytest.mark.parametrize("case, text, key, words", STATIC, ids=[c[0] for c in STATIC])
def test_a_config_that_cannot_start_fails_check_and_serve_with_one_line_naming_the_key(tmp_path, case, text, key,
                                                                                     words):
    path = tmp_path / "kvmiss.toml"
    path.write_text(text)
    for args in (("--check",), ()):
        done = kvmiss("serve", "--config", str(path), *args)
        assert done.returncode == 2, (args, done.stdout, done.stderr)
        line = one_line(done.stderr)
        assert key in line and words in line, line
        assert "configuration OK" not in done.stdout


@pytest.fixture
def busy_port():
    """A port some other process holds, as a local Collector holds 4317."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", quiet_port()))
    sock.listen(1)
    yield sock.getsockname()[1]
    sock.close()


@pytest.mark.parametrize("key", ["otlp.grpc", "otlp.http", "metrics.listen"])
def test_a_port_in_use_is_one_line_naming_the_key_and_the_address(tmp_path, busy_port, key):
    listen = {"otlp.grpc": "grpc", "otlp.http": "http", "metrics.listen": "listen"}[key]
    otlp = 'grpc = "127.0.0.1:0"\nhttp = "127.0.0.1:0"'.replace(f'{listen} = "127.0.0.1:0"',
                                                                  f'{listen} = "127.0.0.1:{busy_port}"')
    metrics = f'listen = "127.0.0.1:{busy_port}"' if key == "metrics.listen" else 'listen = "127.0.0.1:0"'
    path = tmp_path / "kvmiss.toml"
    path.write_text(base(otlp=otlp, metrics=metrics))
    for args in (("--check",), ()):
        done = kvmiss("serve", "--config", str(path), *args)
        assert done.returncode == 2, (args, done.stderr)
        line = one_line(done.stderr)
        assert f"{key}: cannot listen on 127.0.0.1:{busy_port}: address already in use" in line, line
        assert "GRPC_VERBOSITY" not in done.stderr


def test_check_warns_naming_a_worker_whose_host_does_not_resolve_and_still_passes(tmp_path):
    path = tmp_path / "kvmiss.toml"
    path.write_text(base(workers=worker("tcp://vllm-0.no-such-domain.invalid:5557", "engine-a")))
    done = kvmiss("serve", "--config", str(path), "--check")
    assert done.returncode == 0, done.stderr
    assert re.search(r"^warning: worker engine-a endpoint: vllm-0.no-such-domain.invalid does not resolve",
                     done.stdout, re.M), done.stdout
    assert done.stdout.rstrip().endswith("configuration OK")


def test_check_warns_when_the_export_host_does_not_resolve(tmp_path):
    path = tmp_path / "kvmiss.toml"
    path.write_text(base(export='endpoint = "http://collector.no-such-domain.invalid:4318"'))
    done = kvmiss("serve", "--config", str(path), "--check")
    assert done.returncode == 0, done.stderr
    assert "warning: export.endpoint: collector.no-such-domain.invalid does not resolve" in done.stdout


# --- runtime faults: a running serve ----------------------------------------------------------


class Serve:
    """`kvmiss serve` in its own process; its log lines are collected as they come."""

    def __init__(self, path, metrics_port: int, http_port: int):
        self.metrics_port, self.http_port = metrics_port, http_port
        self.proc = subprocess.Popen([sys.executable, "-m", "kvmiss.enricher.cli", "serve", "--config", str(path)],
                                     stderr=subprocess.PIPE, text=True, env={**os.environ, **KEY_ENV})
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.wait_for("kvmiss serving")

    def _read(self):
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, pattern: str, timeout: float = 20.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [line for line in self.lines if re.search(pattern, line)]
            if found:
                return found[0]
            assert self.proc.poll() is None, "\n".join(self.lines)
            time.sleep(0.1)
        raise AssertionError(f"no log line matching {pattern!r}:\n" + "\n".join(self.lines))

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}{path}", timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def metric(self, name: str) -> float | None:
        text = self.get("/metrics")[1]
        match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
        return None if match is None else float(match.group(1))

    def wait_metric(self, name: str, check, timeout: float = 20.0) -> float | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = self.metric(name)
            if value is not None and check(value):
                return value
            time.sleep(0.2)
        return self.metric(name)

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(30)


def send_spans(http_port: int, attributes: list[dict]) -> None:
    provider = TracerProvider(resource=Resource.create({"service.name": "router"}))
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=f"http://127.0.0.1:{http_port}/v1/traces")))
    tracer = provider.get_tracer("misconfiguration-test")
    for attrs in attributes:
        with tracer.start_as_current_span("route", attributes=attrs):
            pass
    provider.shutdown()


def serve_with(tmp_path, export: str, workers: str = "") -> Serve:
    metrics_port, http_port = quiet_port(), quiet_port()
    path = tmp_path / "kvmiss.toml"
    path.write_text(base(export=export, workers=workers, otlp=f'grpc = ""\nhttp = "127.0.0.1:{http_port}"',
                         metrics=f'listen = "127.0.0.1:{metrics_port}"'))
    return Serve(path, metrics_port, http_port)


@pytest.mark.parametrize("endpoint, cause", [
    ("tcp://127.0.0.1:{port}", "connection_refused"),
    ("tcp://vllm-0.no-such-domain.invalid:{port}", "name_not_resolved"),
])
def test_an_engine_kvmiss_never_reaches_is_warned_shown_unready_and_named_in_the_reason(tmp_path, endpoint, cause):
    endpoint = endpoint.format(port=quiet_port())
    sink = OtlpSink()
    serve = serve_with(tmp_path, f'endpoint = "{sink.endpoint}"', worker(endpoint))
    try:
        started = time.monotonic()
        line = serve.wait_for(r"WARNING .*worker w0: event stream", timeout=15)
        assert time.monotonic() - started < 12  # within a few seconds
        assert endpoint in line and cause in line and "not connected once" in line
        status, body = serve.get("/readyz")
        ready = json.loads(body)
        assert status == 503 and ready["ready"] is False
        assert ready["workers"]["w0"] == "never_connected"
        assert ready["detail"]["w0"]["cause"] == cause and ready["detail"]["w0"]["endpoint"] == endpoint
        assert serve.metric(f'kvmiss_workers_unreachable{{cause="{cause}"}}') == 1
        # A request routed to it: unknown_history, and the reason says why.
        send_spans(serve.http_port, [{
            "gen_ai.request.id": "r1", "kvmiss.route.worker": "w0", "gen_ai.usage.cache_read.input_tokens": 0,
            "gen_ai.usage.prompt_tokens": 64, "kvmiss.block_hashes": [11, 12, 13, 14],
            "kvmiss.lookup_time_unix_nano": time.time_ns()}])
        spans = sink.wait_for_spans(1)
        attrs = {a.key: a.value for a in spans[0].attributes}
        assert attrs["kvmiss.label"].string_value == "unknown_history"
        assert attrs["kvmiss.reason"].string_value.startswith("never connected:"), attrs["kvmiss.reason"]
        assert cause in attrs["kvmiss.reason"].string_value
        # Said once, not once a second.
        time.sleep(2.5)
        assert sum("worker w0: event stream" in line for line in serve.lines) == 1
        status_cmd = kvmiss("status", "--url", f"http://127.0.0.1:{serve.metrics_port}")
        assert status_cmd.returncode == 1 and cause in status_cmd.stdout and "ready: NO" in status_cmd.stdout
    finally:
        assert serve.stop() == 0
        sink.close()
    assert any("stopped in" in line for line in serve.lines)


def test_an_engine_that_comes_up_later_is_logged_as_recovered_and_ready(tmp_path):
    import zmq

    port = quiet_port()
    sink = OtlpSink()
    serve = serve_with(tmp_path, f'endpoint = "{sink.endpoint}"', worker(f"tcp://127.0.0.1:{port}"))
    context = zmq.Context()
    try:
        serve.wait_for(r"worker w0: event stream .*connection_refused", timeout=15)
        pub = context.socket(zmq.PUB)
        pub.bind(f"tcp://127.0.0.1:{port}")
        line = serve.wait_for(r"worker w0: event stream connected", timeout=15)
        assert "unreachable" in line
        deadline = time.monotonic() + 10
        while serve.get("/readyz")[0] != 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert serve.get("/readyz")[0] == 200
        pub.close(0)
    finally:
        serve.stop()
        context.term()
        sink.close()


def test_a_downstream_that_is_down_is_warned_counted_and_delivered_to_when_back(tmp_path):
    port = quiet_port()
    serve = serve_with(tmp_path, f'endpoint = "http://127.0.0.1:{port}"')
    sink = None
    try:
        send_spans(serve.http_port, [{"gen_ai.request.id": f"r{i}"} for i in range(5)])
        assert serve.wait_metric("kvmiss_spans_handed_to_export_total", lambda v: v >= 5) == 5
        line = serve.wait_for(rf"WARNING .*export to http://127.0.0.1:{port}/v1/traces failing", timeout=15)
        assert "spans queued" in line
        assert serve.wait_metric('kvmiss_export_spans_retried_total{exporter="http"}', lambda v: v >= 5) >= 5
        assert serve.metric('kvmiss_export_spans_delivered_total{exporter="http"}') == 0
        assert serve.metric('kvmiss_export_spans_enqueued_total{exporter="http"}') == 5
        assert serve.metric('kvmiss_export_failing{exporter="http"}') == 1
        sink = OtlpSink(port)  # the downstream comes back
        assert len(sink.wait_for_spans(5, timeout=30)) == 5
        assert serve.wait_metric('kvmiss_export_spans_delivered_total{exporter="http"}', lambda v: v >= 5) == 5
        serve.wait_for(rf"export to http://127.0.0.1:{port}/v1/traces recovered", timeout=10)
        assert serve.metric('kvmiss_export_failing{exporter="http"}') == 0
        assert 'kvmiss_export_spans_dropped_total{' not in serve.get("/metrics")[1]
        retries = [line for line in serve.lines if "failing" in line]
        assert len(retries) <= 2  # rate-limited, not one per attempt
    finally:
        serve.stop()
        if sink is not None:
            sink.close()


def test_a_file_destination_counts_what_it_wrote_as_delivered(tmp_path):
    out = tmp_path / "out" / "spans.jsonl"
    out.parent.mkdir()
    serve = serve_with(tmp_path, f'file = "{out}"')
    try:
        send_spans(serve.http_port, [{"gen_ai.request.id": "r0"}])
        assert serve.wait_metric('kvmiss_export_spans_delivered_total{exporter="jsonlinesfile"}', lambda v: v >= 1) == 1
        assert len(out.read_text().splitlines()) == 1
    finally:
        serve.stop()


def test_discard_is_explicit_and_counted(tmp_path):
    serve = serve_with(tmp_path, "discard = true")
    try:
        send_spans(serve.http_port, [{"gen_ai.request.id": f"r{i}"} for i in range(3)])
        assert serve.wait_metric("kvmiss_spans_discarded_total", lambda v: v >= 3) == 3
        assert 'kvmiss_export_spans_delivered_total{' not in serve.get("/metrics")[1]  # no exporter at all
    finally:
        serve.stop()
