"""NVIDIA Dynamo's standalone KV indexer as a benchmark peer: one subprocess subscribed to one
vLLM-format ZeroMQ publisher, and what it says it has applied.

Dynamo is not a dependency of kvmiss. Install it into a venv of its own, never kvmiss's:

    python3 -m venv ../dynamo-venv && ../dynamo-venv/bin/pip install ai-dynamo-runtime==1.6.1

What ai-dynamo-runtime 1.6.1 does (read from its ``--help``, its log and its HTTP API):

- ``python -m dynamo.indexer`` runs the Rust indexer inside that Python process ("HTTP-only
  mode"): no NATS, etcd or other service. ``--workers 1=tcp://host:port`` opens a ZeroMQ SUB
  (subscribed to every topic) that connects to the engine's PUB; ``--block-size`` must be the
  engine's (16 here); ``--threads`` defaults to 4 (a thread pool; 1 is a single-threaded index).
  Its HTTP server (``--port``) always binds 0.0.0.0.
- ``GET /workers`` shows each listener's status (``active`` once its SUB is connected).
- ``GET /metrics`` has ``dynamo_kvrouter_kv_cache_events_applied{event_type, status}``: one
  count per KV event (a BlockStored of several blocks is one event) taken when the radix tree
  applied it, with the outcome: ``ok``, or why the tree refused it (``parent_block_not_found``,
  ``block_not_found``, ...). A refused event was received and decoded but changed nothing, and
  costs a WARN log line each.

Its radix tree needs every store's parent to be a block it holds: a BlockStored whose
``parent_block_hash`` it has never seen is refused, and so are removals of such blocks, and of
blocks under a removed parent (the tree drops the subtree). Feed it a stream that keeps to that
(bench_ingest_serve.py ``--stream rooted``) or the "applied" count measures its refusals.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import urllib.request
from pathlib import Path

from benchlib import free_port

_APPLIED = re.compile(
    rb'^dynamo_kvrouter_kv_cache_events_applied\{event_type="([a-z_]+)",status="([a-z_]+)"\} ([0-9.e+]+)$', re.M)

_THREADS = re.compile(rb"Starting standalone KV cache indexer.*?threads(?:\x1b\[[0-9;]*m)*=(?:\x1b\[[0-9;]*m)*([0-9]+)")


def default_python() -> str:
    """``$DYNAMO_PYTHON``, else ``dynamo-venv/bin/python`` beside this repository."""
    return os.environ.get("DYNAMO_PYTHON") or str(Path(__file__).resolve().parents[2] / "dynamo-venv" / "bin" / "python")


class DynamoIndexer:
    """``python -m dynamo.indexer`` subscribed to ``endpoint`` as worker 1, dp rank 0."""

    def __init__(self, endpoint: str, *, python: str | None = None, block_size: int = 16,
                 threads: int | None = None, log_path: Path | None = None) -> None:
        self.endpoint = endpoint
        self.python = python or default_python()
        self.port = free_port()
        self.log_path = log_path
        argv = [self.python, "-m", "dynamo.indexer", "--block-size", str(block_size), "--port", str(self.port),
                "--workers", f"1={endpoint}"]
        if threads:
            argv += ["--threads", str(threads)]
        if not Path(self.python).exists():
            raise FileNotFoundError(f"no Python at {self.python} for Dynamo's indexer (see {__file__})")
        self._log = open(log_path, "wb") if log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=self._log)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _get(self, path: str) -> bytes:
        return urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=10).read()

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Until its HTTP server answers and the listener of our endpoint is active."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dynamo.indexer exited {self.proc.returncode}: {self.log_tail()}")
            try:
                workers = json.loads(self._get("/workers"))
                if any(l.get("status") == "active" for w in workers for l in w.get("listeners", {}).values()):
                    return
            except (OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"dynamo.indexer not ready in {timeout_s} s: {self.log_tail()}")
            time.sleep(0.1)

    def counts(self) -> dict[tuple[str, str], int]:
        """``kv_cache_events_applied`` by (event_type, status)."""
        return {(t.decode(), s.decode()): int(float(v)) for t, s, v in _APPLIED.findall(self._get("/metrics"))}

    def applied(self) -> int:
        """KV events its radix tree has taken so far, whatever the outcome (each one is counted
        once, after the tree applied or refused it; see applied_ok)."""
        return sum(self.counts().values())

    def applied_ok(self) -> int:
        """KV events the tree applied with status ``ok`` (it changed the index as the event says)."""
        return sum(n for (_, status), n in self.counts().items() if status == "ok")

    def threads(self) -> int | None:
        """The indexer threads it says it started with (its first log line), or None."""
        try:
            m = _THREADS.search(self.log_path.read_bytes()[:4096]) if self.log_path else None
        except OSError:
            m = None
        return int(m.group(1)) if m else None

    def log_tail(self, n: int = 800) -> str:
        if not self.log_path:
            return ""
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self._log is not subprocess.DEVNULL:
            self._log.close()

    def __enter__(self) -> DynamoIndexer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
