"""`kvmiss demo`: a simulated vLLM fleet through the whole real kvmiss pipeline.

Wiring, all on loopback in one process:

    Workload -> Router -> Engine (per worker) -> Publisher (real PUB + replay ROUTER)
        ~~ ZeroMQ ~~> kvmiss serve (the real Service, its own thread: collector, index)
    finished request -> spans (OTel SDK: router over OTLP/gRPC, engine over OTLP/HTTP)
        ~~ OTLP ~~> kvmiss serve: assemble, wait for history, attribute, strip raw inputs
        -> [export] file: enriched OTLP/JSON lines -> read back here -> kvmiss.label per
           request -> compared with the simulator's ground truth -> summary + HTML report

The engines step on the main thread, one after another, with one strictly increasing wall
clock: lookups are stamped during a step, batches after it, as in vLLM. At routing time the
router enters the prompt blocks it expects the worker to compute as speculative entries;
the stores kvmiss collects confirm them (route-to-BlockStored latency).
"""

from __future__ import annotations

import collections
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import msgspec
import zmq

from kvmiss.enricher.demo.emit import SpanEmitter
from kvmiss.enricher.demo.engine import SimRequest
from kvmiss.enricher.demo.faults import FAULTS, FaultRunner, SimWorker, plan_faults
from kvmiss.enricher.demo.host import ASSEMBLE_WAIT_S, HISTORY_WAIT_S, KvmissHost, Speculation, demo_config
from kvmiss.enricher.demo.report import UNKNOWN_BUDGET, DemoReport
from kvmiss.enricher.demo.router import Router
from kvmiss.enricher.demo.timeline import StreamNarrator, report_context
from kvmiss.enricher.demo.truth import Agreement, holder_as_seen, judge, truth_label
from kvmiss.enricher.demo.workload import Workload
from kvmiss.enricher.estimates.whatif import LADDER, ladder_label
from kvmiss.enricher.report import SpanFileTail, load_spans, write_report
from kvmiss.enricher.service.serve import Service
from kvmiss.schemas.attribution import Label, RequestFacts, Verdict

BLOCK_SIZE = 16
NUM_BLOCKS = 150  # per worker: small enough for LRU pressure from the long documents
TICK_S = 0.012  # one engine step of every worker
CLOCK_STEP_S = 1e-5  # lookups and batch stamps stay apart through ns <-> float conversions
PROGRESS_EVERY = 100
READ_BACK_S = 10.0  # beyond the waits, how long the last enriched spans may take
DEMO_DIGEST_SECRET = "kvmiss-demo: not a deployment secret"
ENRICHED = "enriched.otlp.jsonl"
REQUEST_RECORDS = "requests.jsonl"  # [export] request_records: for kvmiss whatif / attribute
EVENTS = "events.rec"  # what the collector received, as `kvmiss collect --record` writes it
RAW_MARKERS = ("kvmiss.token_ids", "kvmiss.extra_keys", "salt-", "/adapters/")


@dataclass(frozen=True)
class DemoOptions:
    requests: int = 600
    workers: int = 4
    seed: int = 7
    faults: frozenset[str] = field(default_factory=lambda: frozenset(FAULTS))
    out: str = "./kvmiss-demo-out"


class StrictClock:
    """Wall-clock seconds, strictly increasing by at least `CLOCK_STEP_S`: a lookup and the
    batch stamped after its step must never share a timestamp, even after the lookup time
    travelled as integer nanoseconds in a span."""

    def __init__(self) -> None:
        self.last = 0.0

    def __call__(self) -> float:
        self.last = max(time.time(), self.last + CLOCK_STEP_S)
        return self.last


def run_demo(options: DemoOptions, log: IO[str] = sys.stderr) -> tuple[dict[str, Any], DemoReport]:
    """Run the whole demo; returns the JSON summary and the scored report."""
    started = time.monotonic()
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in (ENRICHED, "attributions.jsonl", "report.html", REQUEST_RECORDS, REQUEST_RECORDS + ".old", EVENTS):
        (out / stale).unlink(missing_ok=True)

    def say(text: str) -> None:
        print(f"[{time.monotonic() - started:5.1f}s] {text}", file=log, flush=True)

    requests = Workload(options.seed, block_size=BLOCK_SIZE).generate(options.requests)
    by_id = {r.id: r for r in requests}
    ids = [f"w{i}" for i in range(options.workers)]
    plan, rings = plan_faults(options.faults, ids, [r.arrival_tick for r in requests])
    ctx = zmq.Context()
    sims = {w: SimWorker(ctx, w, dp_rank=0, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                         buffer_steps=rings[w]) for w in ids}
    diagnoses: dict[str, list[str]] = {}
    report = DemoReport(by_id, BLOCK_SIZE, diagnoses)
    speculation = Speculation()
    host: KvmissHost | None = None
    emitter: SpanEmitter | None = None
    faults: FaultRunner | None = None
    metrics_total = None
    try:
        say(f"phase: starting {len(ids)} simulated vLLM workers (PUB + replay ROUTER on loopback)")
        for sim in sims.values():
            sim.start()
        endpoints = {w: (f"tcp://127.0.0.1:{s.pub_port}", f"tcp://127.0.0.1:{s.replay_port}")
                     for w, s in sims.items()}
        host = KvmissHost(demo_config(endpoints, out / ENRICHED, DEMO_DIGEST_SECRET, BLOCK_SIZE, NUM_BLOCKS,
                                      request_records=out / REQUEST_RECORDS),
                          out / "kvmiss.toml", records=out / "attributions.jsonl",
                          speculation=speculation, diagnose=_diagnoser(by_id, diagnoses), events=out / EVENTS)
        service = host.start()
        emitter = SpanEmitter(service.receivers.grpc_port, service.receivers.http_port, BLOCK_SIZE)
        say(f"phase: kvmiss serve running in-process (config {out / 'kvmiss.toml'}): OTLP gRPC "
            f":{service.receivers.grpc_port}, HTTP :{service.receivers.http_port}, metrics "
            f":{service.metrics_port}, export {out / ENRICHED}")
        time.sleep(0.3)  # let the SUB subscriptions reach the publishers
        say(f"phase: driving {len(requests)} requests (seed {options.seed}, faults: "
            f"{','.join(sorted(options.faults)) or 'none'}); spans go out as requests finish")
        tail, narrator = SpanFileTail(out / ENRICHED), StreamNarrator(host.streams, say)
        faults = FaultRunner(plan, sims, say)
        progress = _Progress(report, tail, narrator, len(requests), say)
        _drive(requests, sims, faults, emitter, speculation, progress, options)
        say("phase: workload done; flushing spans and reading back the last enriched ones")
        emitter.flush()
        deadline = time.monotonic() + HISTORY_WAIT_S + ASSEMBLE_WAIT_S + READ_BACK_S
        while len(report.rows) < len(requests) and time.monotonic() < deadline:
            progress.poll()
            time.sleep(0.05)
        metrics_total = _scrape_requests_total(service.metrics_port)
    finally:
        if emitter is not None:
            emitter.close()
        if host is not None:
            host.stop()
        for sim in sims.values():
            sim.shutdown()
        ctx.destroy(linger=0)
    progress.poll()
    speculation.expire(time.time() + speculation.entries.ttl_s)  # what never came is expired
    stats = service.pipeline.stats
    rows = load_spans(out / ENRICHED)
    raw = any(marker in (out / ENRICHED).read_text() for marker in RAW_MARKERS)
    records_text = (out / REQUEST_RECORDS).read_text() if (out / REQUEST_RECORDS).exists() else ""
    raw_records = any(marker in records_text for marker in RAW_MARKERS + ('"token_ids"', '"extra_keys"'))
    extra = {
        "seed": options.seed, "workers": len(ids), "faults": sorted(options.faults),
        "fault_events": [f"tick {e.tick} {e.worker}: {e.action}: {e.note}" for e in plan],
        "runtime_s": round(time.monotonic() - started, 2), "out": str(out),
        "spans_emitted": emitter.spans, "spans_exported": stats.spans_out,
        "spans_unenriched": dict(stats.unenriched), "metrics_requests_total": metrics_total,
        "enriched_spans_file": str(out / ENRICHED), "raw_material_in_export": raw,
        "route_to_stored": speculation.summary(), "history_wait_s": HISTORY_WAIT_S,
        "assemble_wait_s": ASSEMBLE_WAIT_S,
        "whatif": whatif_summary(stats),
        "request_records_file": str(out / REQUEST_RECORDS), "events_recording": str(out / EVENTS),
        "request_records": len(records_text.splitlines()), "raw_material_in_request_records": raw_records,
        "whatif_command": f"kvmiss whatif --events {out / EVENTS} --requests {out / REQUEST_RECORDS} "
                          f"--pool-blocks {NUM_BLOCKS}",
    }
    summary = report.as_json(service.fleet.streams, extra)
    context = report_context(summary, host.streams, faults, speculation, UNKNOWN_BUDGET)
    (out / "report_context.json").write_bytes(msgspec.json.encode(context))
    summary["report_path"] = str(write_report(rows, context, out))
    summary["runtime_s"] = round(time.monotonic() - started, 2)
    (out / "summary.json").write_bytes(msgspec.json.format(msgspec.json.encode(summary)))
    return summary, report


class _Progress:
    """Reads enriched spans back as they are written, scores them, narrates."""

    def __init__(self, report: DemoReport, tail: SpanFileTail, narrator: StreamNarrator,
                 total: int, say):
        self.report, self.tail, self.narrator, self.total, self.say = report, tail, narrator, total, say

    def poll(self) -> None:
        self.narrator.narrate()
        before = len(self.report.rows)
        for row in self.tail.read_new():
            wrong = self.report.add(row)
            if wrong is not None:
                self.say(f"!!! {wrong.line()}")
        done = len(self.report.rows)
        if done // PROGRESS_EVERY > before // PROGRESS_EVERY or (done == self.total > before):
            counts = self.report.counts()
            self.say(f"progress: {done}/{self.total} enriched requests read back "
                     f"({counts[Agreement.AGREE]} agree, {counts[Agreement.UNKNOWN]} unknown, "
                     f"{counts[Agreement.WRONG]} wrong)")


def _drive(requests: list[SimRequest], sims: dict[str, SimWorker], faults: FaultRunner,
           emitter: SpanEmitter, speculation: Speculation, progress: _Progress,
           options: DemoOptions) -> None:
    """The simulation loop: faults, arrivals and routing, one step of every live worker,
    spans for what finished."""
    clock = StrictClock()
    router = Router(list(sims), seed=options.seed + 1, block_size=BLOCK_SIZE,
                    disaggregate="transfer" in options.faults)
    arrivals = collections.deque(requests)
    retry: list[SimRequest] = []
    tick = 0
    while arrivals or retry or any(s.engine is not None and s.engine.load for s in sims.values()):
        began = time.monotonic()
        lost, crashed = faults.run(tick)
        for worker in crashed:
            router.forget(worker)
        for request in lost:  # the router retries what a dead process dropped
            request.worker = request.route_policy = request.transfer = None
        retry += lost
        incoming, retry = retry, []
        while arrivals and arrivals[0].arrival_tick <= tick:
            incoming.append(arrivals.popleft())
        loads = {w: s.engine.load for w, s in sims.items() if s.engine is not None}
        for request in incoming:
            if not loads:
                retry.append(request)
                continue
            worker = router.route(request, loads)
            request.routed_at = time.time()
            speculation.route(worker, request.expected_blocks, request.routed_at)
            sims[worker].engine.submit(request)
            loads[worker] += 1
        for worker, sim in sims.items():
            if sim.engine is None:
                continue
            finished, batch = sim.engine.step(clock, _probe(sims, worker))
            if batch is not None:
                sim.publish(batch)
            for request in finished:
                emitter.emit(request, time.time())
        speculation.expire(time.time())
        progress.poll()
        tick += 1
        time.sleep(max(0.0, TICK_S - (time.monotonic() - began)))


def _probe(sims: dict[str, SimWorker], me: str):
    def probe(block_hash: int) -> tuple[str, ...]:
        return tuple(w for w, s in sims.items()
                     if w != me and s.engine is not None and s.engine.pool.holds(block_hash))
    return probe


def _diagnoser(by_id: dict[str, SimRequest], diagnoses: dict[str, list[str]]):
    """On the service's loop thread, as kvmiss judges: for a verdict the simulator knows to
    be wrong, what the index held about the true holders at the lookup time."""
    def diagnose(service: Service, facts: RequestFacts, verdict: Verdict) -> None:
        request = by_id.get(facts.request_id or "")
        if request is None or request.truth is None or facts.lookup_time is None:
            return
        truth = truth_label(facts.prompt_tokens, facts.cached_tokens, BLOCK_SIZE, request.truth)
        if judge(truth, verdict.label) is not Agreement.WRONG or truth is not Label.ROUTING_MISS:
            return
        first_miss = request.chain[facts.cached_tokens // BLOCK_SIZE]
        diagnoses[request.id] = [holder_as_seen(service.index, w, first_miss, facts.lookup_time)
                                 for w in request.truth.other_holders]
    return diagnose


def whatif_summary(stats) -> dict[str, Any]:
    """Of the evicted misses' tokens (those with an estimate), the share each ladder pool
    size would have kept cached, over the fleet; and the smallest size that keeps most."""
    evicted = sum(stats.whatif_evicted_tokens.values())
    kept = {label: sum(n for (_, scale), n in stats.whatif_kept_tokens.items() if scale == label)
            for label in (ladder_label(s) for s in LADDER)}
    share = {label: round(n / evicted, 4) if evicted else 0.0 for label, n in kept.items()}
    most = next((label for label, x in share.items() if x >= 0.5), None)
    return {"evicted_tokens": evicted, "kept_share_by_scale": share, "scale_keeping_most": most}


def _scrape_requests_total(port: int | None) -> int | None:
    """kvmiss's own /metrics: the sum of kvmiss_requests_total (a cross-check of the count)."""
    if port is None:
        return None
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return None
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("kvmiss_requests_total{")))
