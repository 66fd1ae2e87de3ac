"""End to end into a real trace store: Arize Phoenix, queried by ``kvmiss.label``.

    SGLang publisher --ZMQ--> kvmiss serve (a real process) --OTLP/HTTP gzip--> Phoenix
    OTel SDK exporter --OTLP/HTTP-->  ^                                           |
                                            GET /v1/projects/<p>/spans?attribute=kvmiss.label:evicted

Opt-in (about 1 GB on disk and a minute): ``KVMISS_E2E_PHOENIX=1 .venv/bin/python -m pytest
-m phoenix tests/enricher/service/test_phoenix.py``. Phoenix lives in its own venv,
``.phoenix-venv``, created on first use by tests/peers/phoenix_venv.sh. The test skips, with
the reason, only when Phoenix cannot be installed or does not start here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from sglang_publisher import batch
from zmq_ports import free_port

pytestmark = [
    pytest.mark.phoenix,
    pytest.mark.skipif(os.environ.get("KVMISS_E2E_PHOENIX") != "1",
                       reason="Phoenix end-to-end is opt-in: KVMISS_E2E_PHOENIX=1 (installs ~880 MB once)"),
]

ROOT = Path(__file__).resolve().parents[3]
INSTALL_SCRIPT = ROOT / "tests" / "peers" / "phoenix_venv.sh"
PROJECT = "kvmiss-e2e"  # Phoenix files spans under the resource's openinference.project.name
P, H, Q, R = 1001, 1002, 1003, 1004  # block hashes: parent, evicted, never stored, on w1 only


def get_json(url: str, timeout: float = 5.0):
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read() or b"null")


def wait_until(probe, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            found = probe()
            if found:
                return found
        except (OSError, urllib.error.URLError, ValueError):
            pass
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


class Process:
    """A child process with its output in a file; stopped by its own pid."""

    def __init__(self, argv: list[str], log: Path, env: dict | None = None):
        self.log = log
        self._out = open(log, "wb")
        self.proc = subprocess.Popen(argv, stdout=self._out, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})

    def tail(self, lines: int = 20) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._out.close()


@pytest.fixture(scope="module")
def phoenix(tmp_path_factory):
    """A running Phoenix on free loopback ports: its base URL."""
    try:
        installed = subprocess.run(["bash", str(INSTALL_SCRIPT)], capture_output=True, text=True, timeout=1200)
    except subprocess.TimeoutExpired:
        pytest.skip("Phoenix could not be installed within 20 minutes")
    if installed.returncode != 0:
        pytest.skip(f"Phoenix could not be installed: {installed.stderr.strip().splitlines()[-3:]}")
    command = installed.stdout.strip().splitlines()[-1]
    workdir = tmp_path_factory.mktemp("phoenix")
    port, grpc_port = free_port(), free_port()
    server = Process([command, "serve"], workdir / "phoenix.log", env={
        "PHOENIX_WORKING_DIR": str(workdir), "PHOENIX_HOST": "127.0.0.1", "PHOENIX_PORT": str(port),
        "PHOENIX_GRPC_PORT": str(grpc_port), "PHOENIX_TELEMETRY_ENABLED": "false",
    })
    base = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_until(lambda: server.proc.poll() is None and urllib.request.urlopen(f"{base}/readyz", timeout=2).status == 200,
                       timeout=120, what="Phoenix /readyz")
        except AssertionError:
            pytest.skip(f"Phoenix did not start on this machine:\n{server.tail()}")
        yield base
    finally:
        server.stop()


@pytest.fixture
def kvmiss(tmp_path, fleet, phoenix):
    """``kvmiss serve`` as a real process exporting to Phoenix: (OTLP/HTTP port, metrics port)."""
    eps, _ = fleet
    http_port, metrics_port = free_port(), free_port()
    workers = "".join(f'[[workers]]\nid = "{w}"\nendpoint = "{ep}"\nreplay_endpoint = "{rep}"\n'
                      for w, (ep, rep) in eps.items())
    config = tmp_path / "kvmiss.toml"
    config.write_text(f"""
[otlp]
grpc = ""
http = "127.0.0.1:{http_port}"
[export]
endpoint = "{phoenix}"
[engine]
block_size = 16
[privacy]
digest_key = "phoenix-e2e-secret-0001"
[metrics]
listen = "127.0.0.1:{metrics_port}"
[history]
wait_s = 1.0
assemble_wait_s = 2.0
{workers}""")
    serve = Process([sys.executable, "-m", "kvmiss.enricher.cli", "serve", "--config", str(config)],
                    tmp_path / "kvmiss.log")
    try:
        wait_until(lambda: serve.proc.poll() is None and get_json(f"http://127.0.0.1:{metrics_port}/healthz"),
                   timeout=30, what=f"kvmiss serve to start:\n{serve.tail()}")
        yield http_port, metrics_port
    finally:
        serve.stop()
        assert serve.proc.returncode == 0, serve.tail()


def router_attrs(rid: str, worker: str, chain: list[int], lookup: float) -> dict:
    return {"gen_ai.request.id": rid, "kvmiss.route.worker": worker, "kvmiss.route.policy": "prefix",
            "gen_ai.usage.cache_read.input_tokens": 16, "kvmiss.block_hashes": chain,
            "kvmiss.lookup_time_unix_nano": int(lookup * 1e9), "kvmiss.token_ids": [1, 2, 3]}


def spans_with(phoenix: str, label: str) -> list[dict]:
    query = urllib.parse.urlencode({"attribute": f"kvmiss.label:{label}", "limit": 100})
    return get_json(f"{phoenix}/v1/projects/{PROJECT}/spans?{query}")["data"]


def test_phoenix_finds_the_enriched_spans_by_label(fleet, kvmiss, phoenix):
    _, pubs = fleet
    http_port, metrics_port = kvmiss
    time.sleep(0.3)  # let SUB subscriptions reach the publishers (replay covers the rest)
    t0 = time.time()
    pubs["w0"].publish(batch(t0, stored=[([P, H], None)]))
    pubs["w0"].publish(batch(t0 + 0.01, removed=[[H]]))
    pubs["w1"].publish(batch(t0, stored=[([P, R], None)]))
    for k in range(2, 6):
        pubs["w0"].publish(batch(t0 + 0.01 * k))
        pubs["w1"].publish(batch(t0 + 0.01 * k))
    wait_until(lambda: get_json(f"http://127.0.0.1:{metrics_port}/readyz")["ready"], timeout=15,
               what="both worker streams live")

    provider = TracerProvider(resource=Resource.create({"service.name": "router",
                                                        "openinference.project.name": PROJECT}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=f"http://127.0.0.1:{http_port}/v1/traces")))
    tracer = provider.get_tracer("router")
    lookup = t0 + 0.035
    for rid, worker, chain in (("evicted", "w0", [P, H, 7]), ("never", "w0", [P, Q, 7]), ("routing", "w0", [P, R, 7])):
        with tracer.start_as_current_span("route", attributes=router_attrs(rid, worker, chain, lookup)):
            with tracer.start_as_current_span("llm_request", kind=trace.SpanKind.SERVER,
                                              attributes={"gen_ai.request.id": rid, "gen_ai.usage.prompt_tokens": 40}):
                pass
    provider.shutdown()

    evicted = wait_until(lambda: spans_with(phoenix, "evicted"), timeout=30, what="an evicted span in Phoenix")
    no_match = wait_until(lambda: spans_with(phoenix, "no_match"), timeout=30, what="a no_match span in Phoenix")
    routing = wait_until(lambda: spans_with(phoenix, "routing_miss"), timeout=30, what="a routing_miss span in Phoenix")
    assert [(s["name"], s["attributes"]["gen_ai.request.id"]) for s in evicted] == [("route", "evicted")]
    assert [(s["name"], s["attributes"]["gen_ai.request.id"]) for s in no_match] == [("route", "never")]
    assert [s["attributes"]["gen_ai.request.id"] for s in routing] == ["routing"]
    stored = evicted[0]["attributes"]
    assert stored["kvmiss.owner"] == "platform" and stored["kvmiss.first_miss_block"] == 1
    assert stored["kvmiss.history"] == "continuous" and stored["kvmiss.first_miss_digest"].count(":") == 1
    # Phoenix nests dotted keys: flat output names keep every output a leaf; raw inputs never arrive.
    for span in evicted + no_match + routing:
        assert not {"kvmiss.token_ids", "kvmiss.block_hashes"} & set(span["attributes"])
    engine = get_json(f"{phoenix}/v1/projects/{PROJECT}/spans?" + urllib.parse.urlencode(
        {"name": "llm_request", "limit": 100}))["data"]
    assert len(engine) == 3 and all("kvmiss.label" not in s["attributes"] for s in engine)
