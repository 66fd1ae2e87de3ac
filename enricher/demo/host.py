"""`kvmiss serve` inside the demo: the real `Service` on its own event-loop thread.

The configuration is written as a TOML file in the output directory (so a user can see,
and reuse, what kvmiss ran with) and parsed by the same `parse_config` as `kvmiss serve
--config`: the simulated workers with their real PUB and replay endpoints, OTLP receivers
on free loopback ports, export to an OTLP/JSON-lines file, request records (`[export]
request_records`), and short history and assembly waits so the demo ends quickly.

Three taps watch the service without changing what it decides:
  * the collector's sink (collector thread): stream facts for the report's timeline, and
    the received BlockStored events that confirm the router's speculative entries;
  * the pipeline's ``on_verdict`` (loop thread): attribution records for `kvmiss report
    --records`, and, for a verdict the simulator knows to be wrong, what the index held;
  * the residency index keeps divergence detail (siblings under each parent), which
    `kvmiss serve` has no configuration key for yet;
  * the collector records every message it receives, as `kvmiss collect --record` would
    beside a deployed `kvmiss serve`: with the request records, the input `kvmiss whatif`
    and `kvmiss attribute` replay.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from kvmiss.collectors.continuity import (
    Apply,
    EpochUncertain,
    Hole,
    NewEpoch,
    Quarantine,
    Release,
    StreamAction,
)
from kvmiss.collectors.engines import canonical_medium
from kvmiss.collectors.recording import RecordingWriter
from kvmiss.enricher.core.residency_types import GPU
from kvmiss.enricher.demo.speculative import LatencyReservoir, SpeculativeEntries
from kvmiss.enricher.service.serve import Service
from kvmiss.schemas.attribution import AttributionRecord, RequestFacts, Verdict
from kvmiss.schemas.config import Config, parse_config
from kvmiss.schemas.events import BlockStored

HISTORY_WAIT_S = 0.5  # the chosen worker's events must pass the lookup time within this
ASSEMBLE_WAIT_S = 2.0  # a request's spans must all have arrived within this
SPECULATIVE_TTL_S = 2.0


def demo_config(workers: dict[str, tuple[str, str]], export_file: Path, digest_key: str,
                block_size: int, pool_blocks: int = 0, request_records: Path | None = None) -> str:
    """The kvmiss.toml the demo runs: ``workers`` maps id -> (endpoint, replay endpoint)."""
    lines = [
        "# Written by `kvmiss demo`: the configuration its in-process `kvmiss serve` ran with.",
        "[otlp]", 'grpc = "127.0.0.1:0"', 'http = "127.0.0.1:0"',
        "[export]", f"file = {_toml_str(str(export_file))}",
        *([f"request_records = {_toml_str(str(request_records))}"] if request_records else []),
        "[engine]", 'hash_algo = "sha256"', f"block_size = {block_size}",
        "[privacy]", f"digest_key = {_toml_str(digest_key)}",
        "[metrics]", 'listen = "127.0.0.1:0"',
        "[history]", f"wait_s = {HISTORY_WAIT_S}", f"assemble_wait_s = {ASSEMBLE_WAIT_S}",
        # the simulated engines never re-announce: a store with no parent is a real copy there
        'kv_cache_report_mode = "incremental"',
    ]
    for worker, (endpoint, replay) in workers.items():
        lines += ["[[workers]]", f"id = {_toml_str(worker)}", f"endpoint = {_toml_str(endpoint)}",
                  f"replay_endpoint = {_toml_str(replay)}"]
        if pool_blocks:
            lines.append(f"pool_blocks = {pool_blocks}")  # what-if estimates on evicted misses
    return "\n".join(lines) + "\n"


def _toml_str(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


class _KeptLatencies(LatencyReservoir):
    """The reservoir, also keeping every sample (seconds) for the report's histogram."""

    def __init__(self) -> None:
        super().__init__()
        self.samples: list[float] = []

    def add(self, value: float) -> None:
        super().add(value)
        self.samples.append(value)


class Speculation:
    """`SpeculativeEntries` shared by the router (main thread) and the collector thread."""

    def __init__(self, ttl_s: float = SPECULATIVE_TTL_S):
        self.entries = SpeculativeEntries(ttl_s)
        self.latencies = self.entries.latency = _KeptLatencies()
        self._lock = threading.Lock()

    def route(self, worker: str, blocks: list[int], now: float) -> None:
        with self._lock:
            self.entries.expire(now)
            self.entries.route(worker, blocks, now)

    def stored(self, worker: str, blocks: list[int], recv_ts: float) -> None:
        with self._lock:
            self.entries.stored(worker, blocks, recv_ts)

    def expire(self, now: float) -> None:
        with self._lock:
            self.entries.expire(now)

    def samples_ms(self) -> list[float]:
        with self._lock:
            return [round(v * 1000, 2) for v in self.latencies.samples]

    def summary(self) -> dict[str, Any]:
        with self._lock:
            e = self.entries
            p50, p95, p99 = e.latency.percentiles(0.5, 0.95, 0.99)

            def ms(v: float | None) -> float | None:
                return None if v is None else round(v * 1000, 1)

            return {"p50_ms": ms(p50), "p95_ms": ms(p95), "p99_ms": ms(p99),
                    "entered": e.entered, "confirmed": e.confirmed, "expired": e.expired,
                    "pending": e.entered - e.confirmed - e.expired, "ttl_s": e.ttl_s,
                    "suggested_wait_s": None if p99 is None else round(p99 * 1.5, 3)}


class StreamLog:
    """What the collector told the index, per worker, with wall times (collector thread
    appends; the main thread reads with a cursor)."""

    def __init__(self) -> None:
        self.applied: dict[str, list[tuple[float, float, bool]]] = {}  # (ts, recv_ts, replayed)
        self.facts: list[tuple[float, str, StreamAction]] = []  # non-Apply actions

    def note(self, worker: str, action: StreamAction) -> None:
        if isinstance(action, Apply):
            b = action.batch
            self.applied.setdefault(worker, []).append((b.ts, b.recv_ts, b.replayed))
        elif isinstance(action, (Hole, Quarantine, Release, NewEpoch, EpochUncertain)):
            self.facts.append((time.time(), worker, action))


class KvmissHost:
    """A `Service` on its own thread, as `kvmiss serve` runs it, plus the demo's taps."""

    def __init__(self, config_text: str, config_path: Path, *, records: Path,
                 speculation: Speculation, diagnose: Callable[[Service, RequestFacts, Verdict], None],
                 events: Path | None = None):
        config_path.write_text(config_text)
        self.events = events  # where the collector records what it receives (None: nowhere)
        self.recorder: RecordingWriter | None = None
        self.config: Config = parse_config(config_text, source=str(config_path))
        self.speculation, self.diagnose = speculation, diagnose
        self.streams = StreamLog()
        self.records = open(records, "wb")
        self._encoder = msgspec.json.Encoder()
        self.service: Service | None = None
        self.error: BaseException | None = None
        self._started = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()),
                                        name="kvmiss-serve", daemon=True)

    def start(self, timeout_s: float = 15.0) -> Service:
        self._thread.start()
        if not self._started.wait(timeout_s):
            raise RuntimeError("kvmiss service did not start")
        if self.error is not None:
            raise self.error
        assert self.service is not None
        return self.service

    def stop(self, timeout_s: float = 20.0) -> None:
        """Shut the service down: it judges what it still holds and flushes the file."""
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout_s)
        self.records.close()

    def call(self, fn: Callable[[Service], Any], timeout_s: float = 5.0) -> Any:
        """Run ``fn(service)`` on the service's loop thread (the index's owner)."""
        assert self._loop is not None

        async def run():
            return fn(self.service)
        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout_s)

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            self.service = service = Service(self.config)
            self._tap(service)
            await service.start()
        except BaseException as exc:  # surfaced on the caller's thread
            self.error = exc
            self._started.set()
            return
        self._started.set()
        await self._stop.wait()
        await service.shutdown()
        if self.recorder is not None:  # the collector thread, its only writer, has stopped
            self.recorder.close()

    def _tap(self, service: Service) -> None:
        # Epoch views take the flag when their first batch is applied: none has been yet.
        assert not any(service.index.views(w.id) for w in self.config.workers)
        service.index.divergence_detail = True
        forward = service.fleet.sink

        def sink(worker: str, action: StreamAction) -> None:
            self.streams.note(worker, action)
            if isinstance(action, Apply):
                stored = [h for e in action.batch.events if isinstance(e, BlockStored)
                          and canonical_medium(e.medium) == GPU for h in e.block_hashes]
                if stored:
                    self.speculation.stored(worker, stored, action.batch.recv_ts)
            forward(worker, action)

        service.fleet.sink = sink
        if self.events is not None:
            self.recorder = service.subscriber.recorder = RecordingWriter(self.events)
        chained = service.pipeline.on_verdict

        def on_verdict(facts: RequestFacts, verdict: Verdict, trace_id: bytes) -> None:
            if chained is not None:
                chained(facts, verdict, trace_id)
            record = AttributionRecord(
                request_id=facts.request_id, trace_id=trace_id.hex(), worker=facts.worker,
                lookup_time=facts.lookup_time, prompt_tokens=facts.prompt_tokens,
                cached_tokens=facts.cached_tokens, verdict=verdict)
            self.records.write(self._encoder.encode(record) + b"\n")
            self.diagnose(service, facts, verdict)

        service.pipeline.on_verdict = on_verdict
