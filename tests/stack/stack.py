"""The observability stack's real parts, as child processes on free loopback ports:

* `Collector`: the OpenTelemetry Collector distribution of tests/peers/otelcol, run with a
  shipped file of examples/collector/ as it is; only the ``${env:...}`` endpoints written into
  the file are set, through the environment;
* `Jaeger`: Jaeger v2 (tests/peers/jaeger) with in-memory storage, queried through its HTTP API;
* `Prometheus`: Debian's ``prometheus``, scraping the targets it is given every second.

The Go binaries come from tests/peers/build_stack.sh's cache, keyed by their module's files
(`module_key` hashes the same bytes as the script). `missing_parts()` says what is absent.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path

from zmq_ports import quiet_port

ROOT = Path(__file__).resolve().parents[2]
PEERS = ROOT / "tests" / "peers"
HERE = Path(__file__).resolve().parent
COLLECTOR_EXAMPLES = ROOT / "examples" / "collector"
CACHE = Path(os.environ.get("KVMISS_PEERS_CACHE") or Path.home() / ".cache" / "kvmiss-peers")
HOW_TO_GET = ("the observability stack is not here: run `bash tests/peers/build_stack.sh` (Go >= 1.26 and "
              "the Go module proxy) and `apt-get install -y prometheus`, or set KVMISS_REQUIRE_STACK=1 to fail")
START_S = 60.0  # a Go binary's first start on a loaded 2-core machine


def module_key(name: str) -> str:
    """go.mod, go.sum and the sorted *.go of tests/peers/<name>, hashed (build_stack.sh's key)."""
    directory = PEERS / name
    files = [directory / "go.mod", directory / "go.sum", *sorted(directory.glob("*.go"), key=lambda p: p.name)]
    return hashlib.sha256(b"".join(p.read_bytes() for p in files)).hexdigest()[:16]


def peer_binary(name: str) -> Path | None:
    path = CACHE / f"{name}-{module_key(name)}" / name
    return path if os.access(path, os.X_OK) else None


def prometheus_binary() -> Path | None:
    found = shutil.which("prometheus")
    return Path(found) if found else None


def missing_parts() -> list[str]:
    missing = [name for name in ("otelcol", "jaeger") if peer_binary(name) is None]
    if prometheus_binary() is None:
        missing.append("prometheus")
    return missing


def free_port() -> int:
    """Below the ephemeral range (zmq_ports.quiet_port): the stack takes a dozen ports at once,
    and an outgoing connection elsewhere must not take one before its process binds it."""
    return quiet_port()


def wait_until(condition: Callable[[], object], what: str, timeout: float, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def http_get(url: str, timeout: float = 10.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (urllib.error.URLError, OSError):
        return 0, b""


def port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


class Process:
    """A child process whose output goes to a log file; stopped with SIGTERM, then SIGKILL."""

    def __init__(self, name: str, argv: list[str], workdir: Path, env: dict[str, str] | None = None):
        self.name = name
        self.log_path = workdir / f"{name}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - open for the process's lifetime
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})}, cwd=str(workdir))

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def wait_ready(self, ready: Callable[[], bool], timeout: float = START_S) -> None:
        def check():
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")
            return ready()
        try:
            wait_until(check, f"{self.name} to be ready", timeout, interval=0.2)
        except AssertionError:
            self.kill()
            raise AssertionError(f"{self.name} did not become ready:\n{self.tail()}") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(20)
        self._log.close()

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


# --- the Collector ----------------------------------------------------------------------------


def validate(config: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``otelcol validate --config <file>``: the Collector's own check of a configuration."""
    binary = peer_binary("otelcol")
    assert binary, HOW_TO_GET
    return subprocess.run([str(binary), "validate", "--config", str(config)], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=120)


class Collector(Process):
    """The Collector running ``config`` (a shipped file, unchanged) with ``env`` setting the
    ``${env:...}`` endpoints in it. Its own metrics are on ``telemetry_port``."""

    def __init__(self, name: str, config: Path, workdir: Path, env: dict[str, str], ready_port: int):
        binary = peer_binary("otelcol")
        assert binary, HOW_TO_GET
        self.telemetry_port = free_port()
        self.env = {"OTELCOL_TELEMETRY_HOST": "127.0.0.1", "OTELCOL_TELEMETRY_PORT": str(self.telemetry_port), **env}
        super().__init__(name, [str(binary), "--config", str(config)], workdir, self.env)
        self.wait_ready(lambda: port_open(ready_port) and port_open(self.telemetry_port))

    def telemetry(self) -> str:
        status, body = http_get(f"http://127.0.0.1:{self.telemetry_port}/metrics")
        assert status == 200, f"{self.name}: /metrics answered {status}"
        return body.decode()


# --- Jaeger v2 ----------------------------------------------------------------------------------


class Jaeger(Process):
    """Jaeger v2, in-memory storage (tests/stack/jaeger.yaml); OTLP/gRPC in, HTTP query API out."""

    def __init__(self, workdir: Path):
        binary = peer_binary("jaeger")
        assert binary, HOW_TO_GET
        self.otlp_port, self.query_port = free_port(), free_port()
        env = {"JAEGER_OTLP_GRPC": f"127.0.0.1:{self.otlp_port}",
               "JAEGER_QUERY_HTTP": f"127.0.0.1:{self.query_port}",
               "JAEGER_QUERY_GRPC": f"127.0.0.1:{free_port()}"}
        super().__init__("jaeger", [str(binary), "--config", str(HERE / "jaeger.yaml")], workdir, env)
        self.wait_ready(lambda: port_open(self.otlp_port) and http_get(self.url("/api/services"))[0] == 200)

    def url(self, path: str, **params) -> str:
        query = urllib.parse.urlencode(params)
        return f"http://127.0.0.1:{self.query_port}{path}" + (f"?{query}" if query else "")

    def get(self, path: str, **params) -> dict:
        status, body = http_get(self.url(path, **params))
        assert status == 200, f"jaeger {path} {params}: {status} {body[:300]!r}"
        return json.loads(body)

    def traces(self, service: str, tags: dict[str, str] | None = None, limit: int = 100000,
               lookback: str = "1h") -> list[dict]:
        params = {"service": service, "limit": str(limit), "lookback": lookback}
        if tags:
            params["tags"] = json.dumps(tags)
        return self.get("/api/traces", **params)["data"] or []


def jaeger_tags(span: dict) -> dict:
    return {t["key"]: t["value"] for t in span.get("tags", [])}


# --- Prometheus ---------------------------------------------------------------------------------


class Prometheus(Process):
    """Debian's Prometheus scraping ``jobs`` (job name -> host:port targets) every second."""

    SCRAPE_S = 1.0

    def __init__(self, workdir: Path, jobs: dict[str, list[str]]):
        binary = prometheus_binary()
        assert binary, HOW_TO_GET
        self.port = free_port()
        config = workdir / "prometheus.yml"
        config.write_text(json.dumps({  # JSON is YAML
            "global": {"scrape_interval": f"{self.SCRAPE_S:g}s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": targets}]}
                               for job, targets in jobs.items()],
        }, indent=1))
        super().__init__("prometheus", [str(binary), f"--config.file={config}",
                                        f"--storage.tsdb.path={workdir / 'prometheus-data'}",
                                        f"--web.listen-address=127.0.0.1:{self.port}"], workdir)
        self.wait_ready(lambda: http_get(f"http://127.0.0.1:{self.port}/-/ready")[0] == 200)

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        status, body = http_get(f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode(params))
        answer = json.loads(body or b"{}")
        assert status == 200 and answer.get("status") == "success", f"PromQL {expr!r}: {status} {answer}"
        result = answer["data"]["result"]
        return result if answer["data"]["resultType"] == "vector" else [{"metric": {}, "value": result}]

    def targets_up(self) -> bool:
        status, body = http_get(f"http://127.0.0.1:{self.port}/api/v1/targets")
        active = json.loads(body)["data"]["activeTargets"] if status == 200 else []
        return bool(active) and all(t["health"] == "up" for t in active)
