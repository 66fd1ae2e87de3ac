"""The parts the fault-matrix tests share, all real and all on loopback:

* `Kvmiss`: a real ``kvmiss serve`` process (so it can be SIGKILLed), its stderr kept, its
  metrics scraped and parsed;
* `Sink`: a real OTLP/HTTP sink on a fixed port that can go down and come back on the same
  port, keeping every request in arrival order across restarts;
* `Engines`: kvmiss's own demo publishers (enricher/demo/publisher.py: vLLM 0.33's exact
  wire protocol, real ZeroMQ PUB + ROUTER replay sockets), one per worker, stamping batches
  on an engine clock that may be skewed, and recording every batch into `Truth`;
* `Truth`: what each worker held when, from the batches the test published; the label a
  correct kvmiss must give, or an honest ``unknown_*``;
* span builders and a raw OTLP/HTTP sender that sees every status code (and retries 503s
  after the server's ``Retry-After``, as a Collector's retry queue would).

Every wait has a deadline; nothing sleeps and hopes except a few milliseconds between
an engine step and a lookup time, which only need to differ.
"""

from __future__ import annotations

import bisect
import collections
import gzip
import itertools
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import zmq
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from prometheus_client.parser import text_string_to_metric_families
from publisher_proc import batch as wire_batch  # one batch builder, in the subprocess's module
from zmq_ports import quiet_port  # noqa: F401 - the rig's users take it from here

from kvmiss.enricher.demo.publisher import Publisher

HERE = Path(__file__).resolve().parent
WAIT_S = 15.0  # deadline for any one condition on a loaded 2-core machine
BLOCK = 16
PARENT = 7  # block 0 of every test request: always "cached"
TAIL = 9  # block 2: never looked at (the first miss is block 1)
PROMPT_TOKENS = 3 * BLOCK + 1  # L = 48, so cached 16 is a miss of block 1
UNKNOWN = ("unknown_history", "unknown_epoch")


def wait_until(condition: Callable[[], object], what: str, timeout: float = WAIT_S,
               interval: float = 0.02):
    """Poll ``condition`` until it returns something truthy; fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


# --- kvmiss serve --------------------------------------------------------------------------


def kvmiss_config(*, http_port: int, grpc_port: int, metrics_port: int, sink_port: int,
                  workers: dict[str, tuple[str, str | None]], max_pending_spans: int = 200_000,
                  wait_s: float = 2.0, assemble_wait_s: float = 2.0, retention_s: float = 600.0,
                  export_timeout_s: float = 5.0, history: dict | None = None,
                  journal: str | None = None, journal_max_bytes: int | None = None,
                  otlp_host: str = "127.0.0.1", collector: dict | None = None) -> str:
    blocks = []
    for worker, (endpoint, replay) in workers.items():
        blocks.append(f'[[workers]]\nid = "{worker}"\nendpoint = "{endpoint}"\n'
                      + (f'replay_endpoint = "{replay}"\n' if replay else ""))
    return f"""
[otlp]
grpc = "{otlp_host}:{grpc_port}"
http = "{otlp_host}:{http_port}"
max_pending_spans = {max_pending_spans}
[export]
endpoint = "http://127.0.0.1:{sink_port}"
timeout_s = {export_timeout_s}
""" + (f'journal = "{journal}"\n' if journal else "") + (
    f"journal_max_bytes = {journal_max_bytes}\n" if journal_max_bytes else "") + f"""[engine]
block_size = {BLOCK}
[privacy]
digest_key = "reliability-test-secret-0001"
[metrics]
listen = "127.0.0.1:{metrics_port}"
[history]
wait_s = {wait_s}
assemble_wait_s = {assemble_wait_s}
retention_s = {retention_s}
""" + "".join(f"{k} = {v}\n" for k, v in (history or {}).items()) + (
    "[collector]\n" + "".join(f"{k} = {v}\n" for k, v in collector.items()) if collector else "") + "".join(blocks)


class Metrics:
    """One scrape of /metrics: ``get(name, **labels)`` sums the matching samples."""

    def __init__(self, text: str):
        self.samples: list[tuple[str, dict, float]] = []
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                self.samples.append((sample.name, sample.labels, sample.value))

    def get(self, name: str, **labels) -> float:
        """Counters match with or without their ``_total`` suffix."""
        return sum(v for n, l, v in self.samples
                   if n in (name, name + "_total") and all(l.get(k) == str(x) for k, x in labels.items()))

    def by(self, name: str, key: str) -> dict[str, float]:
        out: dict[str, float] = collections.Counter()
        for n, l, v in self.samples:
            if n in (name, name + "_total"):
                out[l.get(key, "")] += v
        return dict(out)


class Kvmiss:
    """``kvmiss serve --config <file>`` as a child process on fixed loopback ports; under
    ``prefix`` (``ip netns exec <ns>``: in another network namespace) if given."""

    _count = itertools.count()

    def __init__(self, config: str, workdir: Path, *, http_port: int, metrics_port: int,
                 grpc_port: int | None = None, prefix: Sequence[str] = ()):
        self.http_port, self.metrics_port, self.grpc_port = http_port, metrics_port, grpc_port
        self.path = workdir / f"kvmiss-{next(self._count)}.toml"
        self.path.write_text(config)
        self.log: list[str] = []
        self._serving = threading.Event()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "kvmiss.enricher.cli", "serve", "--config", str(self.path)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True, env=env, cwd=str(workdir))
        threading.Thread(target=self._read_log, daemon=True).start()
        deadline = time.monotonic() + 40
        while not self._serving.wait(0.1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise AssertionError("kvmiss serve did not start:\n" + self.tail())

    def _read_log(self) -> None:
        for line in self.proc.stderr:  # type: ignore[union-attr]
            self.log.append(line.rstrip("\n"))
            if "kvmiss serve: OTLP" in line:
                self._serving.set()

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log[-n:])

    @property
    def pid(self) -> int:
        return self.proc.pid

    def scrape(self) -> Metrics:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            return Metrics(response.read().decode())

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/readyz", timeout=5) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def kill(self) -> None:
        """SIGKILL: nothing is flushed, nothing is judged."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(20)

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM: stop intake, judge what is held, flush the exporters, exit."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


# --- the downstream sink -------------------------------------------------------------------


class Sink:
    """A real OTLP/HTTP sink on a fixed port; `stop()` closes the port and every open
    (keep-alive) connection, so it is down for everyone: connection refused or reset.
    `start()` listens again. ``requests`` keeps (arrival monotonic time, request) in order."""

    def __init__(self, port: int | None = None, *, start: bool = True):
        self.port = port or quiet_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.requests: list[tuple[float, ExportTraceServiceRequest]] = []
        self.lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._connections: set = set()
        if start:
            self.start()

    def start(self) -> None:
        sink = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as a real backend

            def setup(self):
                super().setup()
                with sink.lock:
                    sink._connections.add(self.connection)

            def finish(self):
                with sink.lock:
                    sink._connections.discard(self.connection)
                super().finish()

            def do_POST(self):  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                request = ExportTraceServiceRequest.FromString(body)
                with sink.lock:
                    sink.requests.append((time.monotonic(), request))
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args):
                pass

        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        with self.lock:
            connections, self._connections = list(self._connections), set()
        for connection in connections:
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def spans(self) -> list:
        with self.lock:
            return [s for _, r in self.requests for rs in r.resource_spans
                    for ss in rs.scope_spans for s in ss.spans]

    def wait_for(self, count: int, timeout: float = WAIT_S) -> list:
        wait_until(lambda: len(self.spans()) >= count,
                   f"{count} spans at the sink (have {len(self.spans())})", timeout)
        return self.spans()


# --- spans ---------------------------------------------------------------------------------


def _set(attributes, key: str, value) -> None:
    kv = attributes.add(key=key)
    if isinstance(value, bool):
        kv.value.bool_value = value
    elif isinstance(value, int):
        kv.value.int_value = value
    elif isinstance(value, float):
        kv.value.double_value = value
    elif isinstance(value, str):
        kv.value.string_value = value
    elif isinstance(value, (list, tuple)):
        for item in value:
            kv.value.array_value.values.add().int_value = item
    else:
        raise TypeError(key)


def attributes(span) -> dict:
    out = {}
    for kv in span.attributes:
        kind = kv.value.WhichOneof("value")
        if kind == "array_value":
            out[kv.key] = [getattr(v, v.WhichOneof("value")) for v in kv.value.array_value.values]
        else:
            out[kv.key] = getattr(kv.value, kind)
    return out


def router_attrs(rid: str, worker: str, first_miss: int, lookup: float, **extra) -> dict:
    """A router span's kvmiss inputs: block 0 cached, block 1 (``first_miss``) missed."""
    return {"gen_ai.request.id": rid, "kvmiss.route.worker": worker, "kvmiss.route.policy": "prefix",
            "gen_ai.usage.cache_read.input_tokens": BLOCK, "gen_ai.usage.input_tokens": PROMPT_TOKENS,
            "kvmiss.block_hashes": [PARENT, first_miss, TAIL],
            "kvmiss.lookup_time_unix_nano": int(round(lookup * 1e9)), **extra}


class Spans:
    """Builds export requests whose every span carries ``test.seq`` (global send order) and
    remembers each span id it built, so the sink's spans can be matched one to one."""

    def __init__(self, seed: int = 1):
        self.rng = random.Random(seed)
        self.seq = itertools.count()

    def request(self, plain: int = 0, routers: Iterable[dict] = (), *, batch: str = "") -> ExportTraceServiceRequest:
        request = ExportTraceServiceRequest()
        rs = request.resource_spans.add()
        _set(rs.resource.attributes, "service.name", "reliability-router")
        if batch:
            _set(rs.resource.attributes, "test.batch", batch)
        ss = rs.scope_spans.add()
        ss.scope.name = "kvmiss.reliability"
        now = time.time_ns()
        for attrs in routers:
            self._span(ss, "route", now, attrs)
        for _ in range(plain):
            self._span(ss, "llm_request", now, {"http.route": "/v1/completions"})
        return request

    def _span(self, ss, name: str, now: int, attrs: dict) -> None:
        span = ss.spans.add(trace_id=self.rng.randbytes(16), span_id=self.rng.randbytes(8), name=name,
                            kind=2, start_time_unix_nano=now, end_time_unix_nano=now + 1_000_000)
        _set(span.attributes, "test.seq", next(self.seq))
        for key, value in attrs.items():
            _set(span.attributes, key, value)


def span_ids(request: ExportTraceServiceRequest) -> list[bytes]:
    return [s.span_id for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans]


def post(port: int, request: ExportTraceServiceRequest, timeout: float = 10.0) -> tuple[int, dict]:
    """One OTLP/HTTP POST; returns (status, headers) whatever the status."""
    http = urllib.request.Request(f"http://127.0.0.1:{port}/v1/traces", data=request.SerializeToString(),
                                  headers={"Content-Type": "application/x-protobuf"}, method="POST")
    try:
        with urllib.request.urlopen(http, timeout=timeout) as response:
            response.read()
            return response.status, dict(response.headers)
    except urllib.error.HTTPError as exc:
        exc.read()
        return exc.code, dict(exc.headers)


class Sender:
    """A raw OTLP/HTTP sender that records what kvmiss acknowledged (span ids of 200s)
    and every status it saw; `send` retries 503s after the server's Retry-After."""

    def __init__(self, port: int):
        self.port = port
        self.acked: list[bytes] = []
        self.statuses: list[tuple[int, str | None]] = []  # (status, Retry-After)

    def try_once(self, request: ExportTraceServiceRequest) -> int:
        status, headers = post(self.port, request)
        self.statuses.append((status, headers.get("Retry-After")))
        if status == 200:
            self.acked += span_ids(request)
        return status

    def send(self, request: ExportTraceServiceRequest, timeout: float = WAIT_S) -> int:
        deadline = time.monotonic() + timeout
        while True:
            status, headers = post(self.port, request)
            self.statuses.append((status, headers.get("Retry-After")))
            if status == 200:
                self.acked += span_ids(request)
                return status
            assert status == 503, f"unexpected status {status}"
            delay = float(headers.get("Retry-After", "1"))
            assert time.monotonic() + delay < deadline, "kvmiss kept refusing past the deadline"
            time.sleep(delay)


# --- engines and the truth -----------------------------------------------------------------


class Truth:
    """Every batch the test published, per worker and process lifetime; what a correct
    kvmiss must conclude at a lookup time (engine clock).

    Lookup times are taken between engine steps, and the step right after each (on every
    worker) carries no events (`Engines.mark`), so "stored before t" / "removed before t"
    is unambiguous under the engine's step rule (stores in the step containing t come
    after the lookup, removals in it before).
    """

    def __init__(self) -> None:
        self.batches: dict[str, list[tuple[int, float, tuple, tuple, bool]]] = collections.defaultdict(list)
        self.epoch: dict[str, int] = collections.defaultdict(int)

    def record(self, worker: str, ts: float, stored=(), removed=(), cleared=False) -> None:
        self.batches[worker].append((self.epoch[worker], ts, tuple(stored), tuple(removed), cleared))

    def restart(self, worker: str) -> None:
        self.epoch[worker] += 1

    def _replay(self, worker: str, t: float) -> tuple[set, set] | None:
        """(resident, ever stored) on ``worker`` at ``t`` in the lifetime serving ``t``."""
        before = [b for b in self.batches[worker] if b[1] < t]
        if not before:
            return None
        epoch = before[-1][0]
        resident: set = set()
        ever: set = set()
        for e, _, stored, removed, cleared in before:
            if e != epoch:
                continue
            if cleared:
                resident.clear()
            resident.update(stored)
            ever.update(stored)
            resident.difference_update(removed)
        return resident, ever

    def held(self, worker: str, block: int, t: float) -> bool:
        state = self._replay(worker, t)
        return state is not None and block in state[0]

    def label(self, worker: str, block: int, t: float, members: Iterable[str] | None = None) -> str:
        """``members``: the workers a router could choose at ``t`` (default: every engine)."""
        if any(self.held(other, block, t) for other in (self.batches if members is None else members)
               if other != worker):
            return "routing_miss"
        state = self._replay(worker, t)
        resident, ever = state if state is not None else (set(), set())
        if block in resident:
            return "resident_miss"
        if block in ever:
            return "evicted"
        return "no_match"


class Engines:
    """One demo publisher per worker (in this process, each with its own sending thread).
    ``skew_s``: the engines' clock minus this host's clock. ``worker_skew[w]``: one engine's
    own clock error on top of it (its batches are stamped with it; `Truth` keeps the fleet's
    common clock, since that is when things happened)."""

    def __init__(self, workers: Iterable[str], *, buffer_steps: int = 10_000, skew_s: float = 0.0,
                 truth: Truth | None = None):
        self.ctx = zmq.Context()
        self.skew_s = skew_s
        self.worker_skew: dict[str, float] = {}
        self.truth = truth or Truth()
        self.pubs: dict[str, Publisher] = {}
        self.seqs: dict[str, int] = {}
        for worker in workers:
            pub = Publisher(self.ctx, topic=f"kv@{worker}@m", buffer_steps=buffer_steps)
            pub.start()
            self.pubs[worker] = pub

    def clock(self, worker: str | None = None) -> float:
        """The engines' clock; with ``worker``, that engine's own (``worker_skew``)."""
        return time.time() + self.skew_s + (self.worker_skew.get(worker, 0.0) if worker else 0.0)

    def endpoints(self, worker: str) -> tuple[str, str]:
        pub = self.pubs[worker]
        return pub.pub_endpoint, pub.replay_endpoint

    def publish(self, worker: str, stored=(), removed=(), cleared=False) -> tuple[int, float]:
        ts = self.clock(worker)
        seq = self.pubs[worker].publish(wire_batch(ts, stored, removed, cleared))
        self.seqs[worker] = seq
        self.truth.record(worker, ts - self.worker_skew.get(worker, 0.0), stored, removed, cleared)
        return seq, ts

    def tick(self, workers: Iterable[str] | None = None) -> None:
        for worker in (self.pubs if workers is None else workers):
            self.publish(worker)

    def mark(self, workers: Iterable[str] | None = None) -> float:
        """A lookup time between two engine steps; every worker then publishes an empty step."""
        time.sleep(0.004)
        t = self.clock()
        time.sleep(0.004)
        self.tick(workers)
        return t

    def close(self) -> None:
        for pub in self.pubs.values():
            pub.shutdown()
        self.ctx.term()


class PublisherProcess:
    """tests/reliability/publisher_proc.py as a child process (SIGKILL-able); every batch it
    hands to its publisher is recorded into ``truth`` as worker ``worker``'s. ``prefix`` runs
    it under another command (``ip netns exec <ns>``: in another network namespace) and
    ``host`` is the address its sockets bind."""

    def __init__(self, pub_port: int, replay_port: int, truth: Truth, worker: str = "w0", *,
                 host: str = "127.0.0.1", prefix: Sequence[str] = ()):
        self.truth, self.worker = truth, worker
        self.reports: list[dict] = []
        self._cond = threading.Condition()
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, str(HERE / "publisher_proc.py"), "--pub-port", str(pub_port),
             "--replay-port", str(replay_port), "--host", host],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1)
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        assert self._ready.wait(20), "publisher process did not start"

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            report = json.loads(line)
            if report.get("ready"):
                self._ready.set()
                continue
            with self._cond:
                self.reports.append(report)
                self.truth.record(self.worker, report["ts"], report["stored"], report["removed"])
                self._cond.notify_all()

    def _command(self, **command) -> None:
        self.proc.stdin.write(json.dumps(command) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]

    def publish(self, stored=(), removed=()) -> dict:
        with self._cond:
            n = len(self.reports)
        self._command(op="publish", stored=list(stored), removed=list(removed))
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.reports) > n, 10), "publisher did not answer"
            return self.reports[n]

    def stream(self, count: int, interval_s: float, first_block: int, window: int | None = None) -> None:
        self._command(op="stream", count=count, interval_s=interval_s, first_block=first_block, window=window)

    def wait_reports(self, n: int) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.reports) >= n, WAIT_S), "publisher stalled"

    def last(self) -> dict:
        with self._cond:
            return self.reports[-1]

    def report_at(self, ts: float) -> dict:
        """The first batch stamped at or after ``ts`` (the last one if none is yet)."""
        with self._cond:
            i = bisect.bisect_left(self.reports, ts, key=lambda r: r["ts"])
            return self.reports[min(i, len(self.reports) - 1)]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self._command(op="exit")
                self.proc.wait(5)
            except (OSError, subprocess.TimeoutExpired):
                self.kill()


def wait_applied(kvmiss: Kvmiss, seqs: dict[str, int], timeout: float = WAIT_S) -> Metrics:
    """Until kvmiss has applied, with continuity, each worker's batch up to ``seqs[w]``."""
    def reached():
        m = kvmiss.scrape()
        ok = all(m.get("kvmiss_stream_last_contiguous_seq", worker=w) >= s and
                 any(n == "kvmiss_stream_last_contiguous_seq" and l.get("worker") == w
                     for n, l, _ in m.samples)
                 for w, s in seqs.items())
        return m if ok else None
    return wait_until(reached, f"kvmiss to apply {seqs}", timeout, interval=0.05)


def labels_at_sink(sink: Sink) -> dict[str, dict]:
    """Request id -> attributes of the span that carries its verdict."""
    out = {}
    for span in sink.spans():
        a = attributes(span)
        if "kvmiss.label" in a:
            out[a["gen_ai.request.id"]] = a
    return out


def check_verdicts(got: dict[str, dict], expected: dict[str, tuple[str, ...]]) -> dict[str, str]:
    """Every request's label is one of those allowed; returns request id -> label.
    ``KVMISS_DEBUG_VERDICTS=1`` prints each verdict (run pytest with -s)."""
    if os.environ.get("KVMISS_DEBUG_VERDICTS"):
        for rid in expected:
            a = got.get(rid, {})
            print(rid, a.get("kvmiss.label"), a.get("kvmiss.history"), "|", a.get("kvmiss.reason"))
    wrong = {rid: (got.get(rid, {}).get("kvmiss.label"), allowed, got.get(rid, {}).get("kvmiss.reason"))
             for rid, allowed in expected.items() if got.get(rid, {}).get("kvmiss.label") not in allowed}
    assert not wrong, f"wrong or missing verdicts: {wrong}"
    return {rid: got[rid]["kvmiss.label"] for rid in expected}


def assert_exactly_once(acked: list[bytes], sink: Sink) -> None:
    """Every acknowledged span reached the sink once, and nothing else did."""
    delivered = [s.span_id for s in sink.spans()]
    duplicates = [k for k, n in collections.Counter(delivered).items() if n > 1]
    assert not duplicates, f"{len(duplicates)} spans delivered twice"
    missing = set(acked) - set(delivered)
    extra = set(delivered) - set(acked)
    assert not missing and not extra, f"{len(missing)} acknowledged spans lost, {len(extra)} unexpected"


# --- one case's parts, started and stopped together -------------------------------------------


class Rig:
    """Starts and, whatever happens, stops the parts of one case."""

    def __init__(self, tmp_path: Path):
        self.tmp_path = tmp_path
        self._closers: list = []
        self.kvmiss: Kvmiss | None = None

    def on_close(self, close) -> None:
        self._closers.append(close)

    def engines(self, workers, **kwargs) -> Engines:
        engines = Engines(workers, **kwargs)
        self.on_close(engines.close)
        return engines

    def sink(self, **kwargs) -> Sink:
        sink = Sink(**kwargs)
        self.on_close(sink.stop)
        return sink

    def start_kvmiss(self, workers: dict[str, tuple[str, str | None]], sink: Sink, *,
                     ports: tuple[int, int, int] | None = None, **config) -> Kvmiss:
        for attempt in range(3):  # fresh ports taken meanwhile by someone else: pick again
            http_port, grpc_port, metrics_port = ports or (quiet_port(), quiet_port(), quiet_port())
            text = kvmiss_config(http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port,
                                 sink_port=sink.port, workers=workers, **config)
            try:
                kvmiss = Kvmiss(text, self.tmp_path, http_port=http_port, metrics_port=metrics_port,
                                grpc_port=grpc_port)
                break
            except AssertionError as exc:
                if ports is not None or "address already in use" not in str(exc) or attempt == 2:
                    raise
        self.on_close(kvmiss.kill)
        self.kvmiss = kvmiss
        return kvmiss

    def close(self) -> None:
        for close in reversed(self._closers):
            try:
                close()
            except Exception:  # noqa: BLE001 - best effort: close the rest too
                pass


def bring_up(kvmiss: Kvmiss, engines: Engines, workers=None) -> None:
    """Publish empty steps until every worker's stream is live in kvmiss (a subscriber that
    just connected misses what is sent before its subscription lands; replay fills it)."""
    def ready():
        engines.tick(workers)
        return kvmiss.ready()
    wait_until(ready, "kvmiss /readyz", interval=0.1)
    wait_applied(kvmiss, {w: s for w, s in engines.seqs.items() if workers is None or w in workers})
