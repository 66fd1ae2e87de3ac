"""Whole process: `kvmiss serve` as a real process, fed by real ZeroMQ publishers, enriching
512-span OTLP/HTTP batches from a load generator on their way to a sink.

Four processes besides this orchestrator (which only waits on pipes while measuring):

    publishers --ZMQ PUB (XPUB)--> kvmiss serve --OTLP/HTTP gzip--> sink
                                        ^                            |
    loadgen --OTLP/HTTP gzip------------+                            |
       |  (baseline phase: straight to the sink)                     |
       ^------------------ UDP "batch n arrived at t" ---------------+

* publishers: one XPUB socket per worker (8 by default) speaking the engines' wire format
  with kvmiss's own msgspec Structs; each waits until kvmiss has subscribed, then publishes
  from seq 0 (so history starts at a known-empty point) a population of 24,576 resident and
  8,192 evicted blocks per worker (64-block BlockStored events, then one BlockRemoved per
  evicted block, as vLLM emits them), then keeps publishing churn (4 stores + 4 removals
  every 10 ms per worker, ``--churn-interval-ms``) for as long as the measurement runs.
  Before the load starts, kvmiss's CPU following that churn alone and its RSS are read.
* loadgen: 512-span batches, 128 requests x 4 spans each (an HTTP server span, the router's
  ``route`` span with kvmiss inputs -- 64-block chain, cached tokens, worker, lookup time --,
  vLLM's ``llm_request`` span from another resource with prompt tokens and queue time, and a
  ``tokenize`` span), so 1 span in 4 is a router span and 1 in 4 an engine span. Request
  mix: 35 % hit, 25 % evicted, 25 % no_match, 15 % routing_miss; every lookup time is 1 ms
  before the ts of the last population batch, so the published history is already past it
  and the deliberate history wait is never triggered (checked: kvmiss_history_wait_seconds).
  Payloads are built, serialized and gzip'd before timing, each with unique trace ids.
* sink: OTLP/HTTP receiver; parses each batch, counts spans, tallies labels (every 8th
  batch) and checks no raw input arrives; reports each arrival over UDP.

Phases (each bounded by a batch count and a deadline):
  1. direct, paced: loadgen -> sink, one batch in the system at a time (baseline);
  2. via kvmiss, paced: added latency = (2) - (1) per percentile;
  3. via kvmiss at a fixed offered rate (``--rate``, default 40,000 spans/s), open loop;
  4. via kvmiss, saturated (``--concurrency`` POSTs in flight): spans/s, kvmiss CPU/span.
  5. with ``--collector-anchor``: the same saturated load through the OpenTelemetry Collector
     alone (tests/peers/otelcol running benchmarks/collector_anchor.yaml: OTLP/HTTP in ->
     ``transform`` setting one attribute on the router span -> OTLP/HTTP gzip out to the same
     sink), right after phase 4 in the same run: spans/s per core for each and their ratio.

``--pipeline-only`` instead measures `Pipeline.consume` alone in this process on the same
population and payloads (CPU time, best of ``--repeat``): the enrichment cost without the
OTLP plumbing, and without the noise of other load on a shared machine.

Usage: .venv/bin/python benchmarks/bench_serve.py [--profile cprofile|py-spy] [--pipeline-only]
       [--collector-anchor]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import random
import re
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from benchlib import free_port, machine_cpu_s, percentile, process_cpu_s, rss_mb, set_attr, start_sink

SPANS_PER_BATCH = 512
REQUESTS_PER_BATCH = SPANS_PER_BATCH // 4
CHAIN_BLOCKS = 64
BLOCK = 16
RESIDENT_STEPS, EVICTED_STEPS = 384, 128  # 64-block stores per worker
MIX = (("hit", 0.35), ("evicted", 0.25), ("no_match", 0.25), ("routing_miss", 0.15))


def h(*parts: int) -> int:
    """A deterministic random-looking uint64 (splitmix64 over the parts): both the publisher
    and the load generator derive the same population from it, nothing is shipped across."""
    x = 0
    for p in parts:
        x = (x * 0x9E3779B97F4A7C15 + p + 1) & 0xFFFF_FFFF_FFFF_FFFF
        x ^= x >> 30
        x = (x * 0xBF58476D1CE4E5B9) & 0xFFFF_FFFF_FFFF_FFFF
        x ^= x >> 27
        x = (x * 0x94D049BB133111EB) & 0xFFFF_FFFF_FFFF_FFFF
        x ^= x >> 31
    return x


IDLE_S = 3.0  # kvmiss's CPU while it follows the churn alone, before the load starts
RES, EVI, CHURN = 1, 2, 3  # hash families (never-stored and tail blocks are random)








# --- publishers (child process) ------------------------------------------------------------


POPULATION_STEPS = RESIDENT_STEPS + 2 * EVICTED_STEPS


def population_events(w: int, step: int) -> list:
    """Worker ``w``'s events at population step ``step``: 64 resident blocks stored, then
    64 to-be-evicted blocks stored, then those removed one BlockRemoved each (as vLLM)."""
    from kvmiss.schemas.events import BlockRemoved, BlockStored

    if step < RESIDENT_STEPS:
        return [BlockStored(block_hashes=[h(RES, w, step * 64 + j) for j in range(64)], block_size=BLOCK)]
    k = step - RESIDENT_STEPS
    if k < EVICTED_STEPS:
        return [BlockStored(block_hashes=[h(EVI, w, k * 64 + j) for j in range(64)], block_size=BLOCK)]
    k -= EVICTED_STEPS
    return [BlockRemoved(block_hashes=[h(EVI, w, k * 64 + j)]) for j in range(64)]


def publishers_main(conn, endpoints: list[str], subscribers: int = 1, churn_interval_s: float = 0.01) -> None:
    import msgspec
    import zmq

    from kvmiss.schemas.events import BlockRemoved, BlockStored, EventBatch

    encode = msgspec.msgpack.Encoder().encode
    ctx = zmq.Context()
    socks = []
    for ep in endpoints:
        s = ctx.socket(zmq.XPUB)
        s.setsockopt(zmq.SNDHWM, 0)  # never drop: the population burst is finite
        s.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscriber's subscription, not only the first
        s.bind(ep)
        socks.append(s)
    seqs = [0] * len(socks)

    def publish(w: int, events: list) -> float:
        ts = time.time()
        payload = encode(EventBatch(ts=ts, events=events, dp_rank=None))
        socks[w].send_multipart([f"kv@w{w}@bench".encode(), seqs[w].to_bytes(8, "big"), payload])
        seqs[w] += 1
        return ts

    conn.send("bound")
    for s in socks:  # an XPUB hears each SUB's subscription: from here on nothing is lost
        for _ in range(subscribers):  # every kvmiss process follows every worker
            if not s.poll(30_000):
                conn.send(("error", "kvmiss never subscribed"))
                return
            s.recv()
    last_ts = 0.0
    for step in range(POPULATION_STEPS):
        for w in range(len(socks)):
            last_ts = publish(w, population_events(w, step))
        if step % 16 == 15:
            time.sleep(0.005)  # an engine publishes per step; let the collector keep pace
    conn.send(("populated", last_ts, list(seqs)))
    churned = 0
    next_at = time.monotonic()
    while not conn.poll(0):
        for w in range(len(socks)):
            stored = [h(CHURN, w, churned + j) for j in range(4)]
            events = [BlockStored(block_hashes=stored, parent_block_hash=None, block_size=BLOCK)]
            if churned >= 64:
                events += [BlockRemoved(block_hashes=[h(CHURN, w, churned - 64 + j)]) for j in range(4)]
            publish(w, events)
        churned += 4
        next_at += churn_interval_s
        time.sleep(max(0.0, next_at - time.monotonic()))
    conn.send(("stopped", list(seqs)))
    for s in socks:
        s.close(linger=0)


# --- sink (child process) --------------------------------------------------------------------


def sink_main(conn, report_port: int) -> None:
    asyncio.run(_sink(conn, report_port))


async def _sink(conn, report_port: int) -> None:
    from aiohttp import web
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
        ExportTraceServiceResponse,
    )

    ok = ExportTraceServiceResponse().SerializeToString()
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tally = {"spans": 0, "batches": 0, "sampled": {}}  # sampled: batch -> [labels, raw inputs seen]
    raw = {"kvmiss.token_ids", "kvmiss.extra_keys", "kvmiss.block_hashes"}

    async def receive(request: web.Request) -> web.Response:
        body = await request.read()  # aiohttp gunzips
        now = time.monotonic()
        req = ExportTraceServiceRequest.FromString(body)
        batch = req.resource_spans[0].resource.attributes[0].value.int_value
        udp.sendto(struct.pack("!qd", batch, now), ("127.0.0.1", report_port))
        tally["batches"] += 1
        tally["spans"] += sum(len(ss.spans) for rs in req.resource_spans for ss in rs.scope_spans)
        if batch % 8 == 0:
            labels, raw_seen = {}, 0
            for rs in req.resource_spans:
                for ss in rs.scope_spans:
                    for span in ss.spans:
                        for kv in span.attributes:
                            if kv.key == "kvmiss.label":
                                labels[kv.value.string_value] = labels.get(kv.value.string_value, 0) + 1
                            elif kv.key in raw:
                                raw_seen += 1
            tally["sampled"][batch] = [labels, raw_seen]
        return web.Response(body=ok, content_type="application/x-protobuf")

    runner, port = await start_sink(receive)
    conn.send(("sink", port))
    await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # "stop"
    conn.send(("tally", tally))
    await runner.cleanup()


# --- load generator (child process) ----------------------------------------------------------


def build_payloads(n: int, workers: int, lookup_ts: float, seed: int) -> tuple[list[bytes], int]:
    """``n`` gzip'd 512-span export requests, batch id in the first resource's first attribute."""
    import gzip

    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    rng = random.Random(seed)
    resident = [[h(RES, w, k) for k in range(RESIDENT_STEPS * 64)] for w in range(workers)]
    evicted = [[h(EVI, w, k) for k in range(EVICTED_STEPS * 64)] for w in range(workers)]
    lookup_ns = int(lookup_ts * 1e9)
    labels, weights = zip(*MIX)
    payloads, raw_total = [], 0
    for b in range(n):
        req = ExportTraceServiceRequest()
        router_rs, engine_rs = req.resource_spans.add(), req.resource_spans.add()
        for rs, attrs in ((router_rs, {"bench.batch": b, "service.name": "router", "service.instance.id": "router-0"}),
                          (engine_rs, {"service.name": "vllm", "service.instance.id": f"vllm-{b % workers}"})):
            for k, v in attrs.items():
                set_attr(rs.resource.attributes, k, v)
        router, engine = router_rs.scope_spans.add(), engine_rs.scope_spans.add()
        router.scope.name, engine.scope.name = "router", "vllm.tracing"
        for i in range(REQUESTS_PER_BATCH):
            rid = f"cmpl-{b:06d}-{i:03d}-{rng.getrandbits(40):010x}"
            trace_id = rng.randbytes(16)
            w = rng.randrange(workers)
            label = rng.choices(labels, weights)[0]
            cached = rng.randrange(1, 48)
            start = rng.randrange(RESIDENT_STEPS * 64 - CHAIN_BLOCKS)
            if label == "hit":  # every full block reused (the partial last one never is)
                chain, cached = resident[w][start:start + CHAIN_BLOCKS], CHAIN_BLOCKS
            else:
                # An evicted block among the first removed: the last removals are stamped
                # within the lookup's millisecond, when those blocks were still resident.
                miss = {"evicted": lambda: evicted[w][rng.randrange((EVICTED_STEPS - 16) * 64)],
                        "no_match": lambda: rng.getrandbits(64),
                        "routing_miss": lambda: rng.choice(resident[(w + 1) % workers])}[label]()
                chain = resident[w][start:start + cached] + [miss]
                chain += [rng.getrandbits(64) for _ in range(CHAIN_BLOCKS - cached - 1)]
            prompt = CHAIN_BLOCKS * BLOCK + 1
            t0 = lookup_ns - 50_000_000
            server_id, route_id = rng.randbytes(8), rng.randbytes(8)
            spans = (
                (router, server_id, b"", "POST /v1/chat/completions", 2, 0, 900_000_000, {
                    "http.request.method": "POST", "url.path": "/v1/chat/completions", "server.address": "router",
                    "http.response.status_code": 200, "user_agent.original": "python-httpx/0.27"}),
                (router, route_id, server_id, "route", 1, 1_000_000, 2_000_000, {
                    "gen_ai.request.id": rid, "gen_ai.request.model": "meta-llama/Llama-3.1-8B-Instruct",
                    "kvmiss.route.worker": f"w{w}", "kvmiss.route.policy": "prefix_aware",
                    "kvmiss.route.predicted_cached_tokens": cached * BLOCK, "kvmiss.tenant_policy": "standard",
                    "gen_ai.usage.cache_read.input_tokens": cached * BLOCK, "kvmiss.lookup_time_unix_nano": lookup_ns,
                    "kvmiss.block_hashes": [x - (1 << 64) if x >= 1 << 63 else x for x in chain]}),
                (router, rng.randbytes(8), server_id, "tokenize", 1, 500_000, 800_000, {
                    "gen_ai.request.model": "meta-llama/Llama-3.1-8B-Instruct", "tokenizer.tokens": prompt}),
                (engine, rng.randbytes(8), route_id, "llm_request", 2, 3_000_000, 850_000_000, {
                    "gen_ai.request.id": rid, "gen_ai.request.model": "meta-llama/Llama-3.1-8B-Instruct",
                    "gen_ai.usage.prompt_tokens": prompt, "gen_ai.usage.completion_tokens": rng.randrange(10, 800),
                    "gen_ai.latency.time_in_queue": 0.012, "gen_ai.latency.time_to_first_token": 0.2,
                    "gen_ai.request.max_tokens": 1024, "gen_ai.request.temperature": 0.7}),
            )
            for scope, span_id, parent, name, kind, start, end, attrs in spans:
                span = scope.spans.add(trace_id=trace_id, span_id=span_id, parent_span_id=parent, name=name, kind=kind,
                                       start_time_unix_nano=t0 + start, end_time_unix_nano=t0 + end)
                for k, v in attrs.items():
                    set_attr(span.attributes, k, v)
        body = req.SerializeToString()
        raw_total += len(body)
        payloads.append(gzip.compress(body, 6))
    return payloads, raw_total // n


def loadgen_main(conn, args, sink_port: int, kvmiss_port: int, kvmiss_pids: list[int], lookup_ts: float,
                 report_sock: socket.socket, neighbours: dict[str, int]) -> None:
    asyncio.run(_loadgen(conn, args, sink_port, kvmiss_port, kvmiss_pids, lookup_ts, report_sock, neighbours))


async def _loadgen(conn, args, sink_port, kvmiss_port, kvmiss_pids, lookup_ts, report_sock, neighbours) -> None:
    # Every process of the benchmark shares the two cores: their CPU is reported per phase too.
    neighbours = {**neighbours, "loadgen": os.getpid()}
    import aiohttp

    total = args.light * 2 + args.warmup + args.rated + args.batches * (2 if args.collector_port else 1)
    payloads, raw_bytes = build_payloads(total, args.workers, lookup_ts, seed=42)
    gz_bytes = sum(map(len, payloads)) // len(payloads)
    loop = asyncio.get_running_loop()
    arrived: dict[int, float] = {}
    waiting: dict[int, asyncio.Future] = {}

    class Reports(asyncio.DatagramProtocol):
        def datagram_received(self, data, addr):
            batch, t = struct.unpack("!qd", data)
            arrived[batch] = t
            if batch in waiting:
                waiting.pop(batch).set_result(None)

    report_sock.setblocking(False)
    await loop.create_datagram_endpoint(Reports, sock=report_sock)
    headers = {"Content-Type": "application/x-protobuf", "Content-Encoding": "gzip"}

    def kvmiss_cpu_s() -> float:
        return sum(process_cpu_s(pid) for pid in kvmiss_pids)

    async def phase(urls: list[str], ids: list[int], *, concurrency: int = 1, paced: bool = False,
                    rate_batches_s: float | None = None) -> dict:
        sent, acked, statuses = {}, {}, {}
        queue = list(reversed(ids))
        deadline = time.monotonic() + args.deadline_s
        start = time.monotonic()

        async def post(session, b):
            sent[b] = time.monotonic()
            # A batch holds whole traces: spread by batch, as a trace-id load balancer would.
            async with session.post(urls[b % len(urls)], data=payloads[b], headers=headers) as response:
                await response.read()
                acked[b] = time.monotonic()
                statuses[response.status] = statuses.get(response.status, 0) + 1

        async def worker(session):
            while queue and time.monotonic() < deadline:
                b = queue.pop()
                if paced:
                    reached = waiting[b] = loop.create_future()
                await post(session, b)
                if paced:
                    await asyncio.wait_for(reached, args.deadline_s)

        cpu0 = kvmiss_cpu_s()
        others0 = {name: process_cpu_s(pid) for name, pid in neighbours.items()}
        machine0 = machine_cpu_s()
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=max(concurrency, 64))) as session:
            if rate_batches_s:  # open loop: a POST every 1/rate s whatever the previous did
                tasks = []
                for k, b in enumerate(ids):
                    delay = start + k / rate_batches_s - time.monotonic()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    if time.monotonic() > deadline:
                        break
                    tasks.append(asyncio.ensure_future(post(session, b)))
                await asyncio.gather(*tasks)
            else:
                await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        while not all(b in arrived for b in sent) and time.monotonic() < deadline:
            await asyncio.sleep(0.002)
        end = max((arrived[b] for b in sent if b in arrived), default=time.monotonic())
        return {"batches": len(sent), "delivered": sum(b in arrived for b in sent), "statuses": statuses,
                "elapsed_s": end - start, "kvmiss_cpu_s": kvmiss_cpu_s() - cpu0,
                "others_cpu_s": {name: process_cpu_s(pid) - others0[name] for name, pid in neighbours.items()},
                "machine_cpu_s": {k: v - machine0[k] for k, v in machine_cpu_s().items()},
                "e2e_ms": [(arrived[b] - sent[b]) * 1e3 for b in sent if b in arrived],
                "ack_ms": [(acked[b] - sent[b]) * 1e3 for b in acked]}

    ids = iter(range(total))
    take = lambda n: [next(ids) for _ in range(n)]  # noqa: E731
    direct = [f"http://127.0.0.1:{sink_port}/v1/traces"]
    via = [f"http://127.0.0.1:{kvmiss_port + i}/v1/traces" for i in range(args.processes)]
    results = {"raw_bytes": raw_bytes, "gz_bytes": gz_bytes}
    results["direct_paced"] = await phase(direct, take(args.light), paced=True)
    await phase(via, take(args.warmup), concurrency=2)
    results["via_paced"] = await phase(via, take(args.light), paced=True)
    results["via_rated"] = await phase(via, take(args.rated), rate_batches_s=args.rate / SPANS_PER_BATCH)
    results["via_saturated"] = await phase(via, take(args.batches), concurrency=args.concurrency)
    if args.collector_port:  # the same load through the Collector alone, right after
        anchor = [f"http://127.0.0.1:{args.collector_port}/v1/traces"]
        results["collector_saturated"] = await phase(anchor, take(args.batches), concurrency=args.concurrency)
    conn.send(("results", results))


# --- the pipeline alone, in this process (--pipeline-only) -----------------------------------


def pipeline_only(args) -> None:
    """CPU per span of `Pipeline.consume` (judge_on_arrival, as `kvmiss serve` runs it) on the
    same population and payloads, no sockets: insensitive to other load on the machine."""
    import gc
    import gzip

    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from kvmiss.enricher.core.attribution import Attributor
    from kvmiss.enricher.core.index import ResidencyIndex
    from kvmiss.enricher.core.privacy import DigestKey
    from kvmiss.enricher.service.pipeline import Pipeline
    from kvmiss.schemas.stream import AppliedBatch, RunStart

    index = ResidencyIndex([f"w{w}" for w in range(args.workers)])
    ts = 1_764_000_000.0
    for step in range(POPULATION_STEPS):
        ts += 0.001
        for w in range(args.workers):
            index.apply(AppliedBatch(worker=f"w{w}", epoch=0, seq=step, ts=ts, recv_ts=ts, events=population_events(w, step),
                                     run_start_seq=0, run_start=RunStart.EPOCH_START))
    payloads, _ = build_payloads(args.batches, args.workers, ts - 0.001, seed=42)
    bodies = [gzip.decompress(p) for p in payloads]

    class Discard:
        def has_capacity(self, spans: int) -> bool:
            return True

        def put(self, request, tag=None) -> bool:
            return True

    async def consume_all(requests, pipeline):
        for request, body in zip(requests, bodies):  # with its bytes, as the receiver hands it over
            await pipeline.consume(request, body)
        pipeline.poll()

    best = float("inf")
    written = 0
    for _ in range(args.repeat):
        records = None
        if args.request_records:  # its writer thread's CPU counts too: process_time is the process's
            from kvmiss.enricher.service.request_records import RequestRecords

            records = RequestRecords(os.path.join(tempfile.mkdtemp(prefix="kvmiss-bench-records-"), "requests.jsonl"))
            records.start()
        pipeline = Pipeline(Attributor(index, DigestKey("bench-serve-digest-key-0001")), Discard(),
                            clock=time.monotonic, judge_on_arrival=True,
                            pool_blocks={f"w{w}": args.pool_blocks for w in range(args.workers)},
                            on_verdict=records.on_verdict if records else None)
        requests = [ExportTraceServiceRequest.FromString(b) for b in bodies]
        gc.collect()
        t0 = time.process_time()
        asyncio.run(consume_all(requests, pipeline))
        if records is not None:
            records.shutdown()  # every record written, within the time measured
            written = records.written
        best = min(best, time.process_time() - t0)
        assert pipeline.pending_spans == 0, "every request should have been judged on arrival"
    spans = args.batches * SPANS_PER_BATCH
    estimated = sum(pipeline.stats.whatif_evicted_tokens.values())
    whatif = f", what-if at pool_blocks {args.pool_blocks}: {estimated:,} evicted tokens estimated" if args.pool_blocks else ""
    whatif += f", {written:,} request records written" if args.request_records else ""
    print(f"Pipeline.consume alone (judge_on_arrival, {args.workers} workers' population, {args.batches} batches, "
          f"best of {args.repeat}{whatif}): {best / spans * 1e6:.1f} us CPU/span, {best / args.batches * 1e3:.1f} ms/batch")


# --- orchestration ---------------------------------------------------------------------------


def receive(conn, child, timeout: float = 600.0):
    """The child's next message; exits if the child died or went silent (no silent hang)."""
    deadline = time.monotonic() + timeout
    while not conn.poll(0.5):
        if not child.is_alive():
            sys.exit(f"{child.name} died (exit code {child.exitcode}); see its traceback above")
        if time.monotonic() > deadline:
            sys.exit(f"{child.name} sent nothing for {timeout:.0f} s")
    return conn.recv()


def free_ports(n: int) -> int:
    """The first of ``n`` consecutive free ports (a --processes group listens on port + i)."""
    while True:
        first = free_port()
        try:
            for i in range(1, n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", first + i))
        except OSError:
            continue
        return first


def group_pids(pid: int, processes: int) -> list[int]:
    """The serving processes: ``pid`` itself, or with --processes its children."""
    if processes == 1:
        return [pid]
    for _ in range(100):
        children = open(f"/proc/{pid}/task/{pid}/children").read().split()
        if len(children) == processes:
            return [int(c) for c in children]
        time.sleep(0.1)
    sys.exit(f"kvmiss serve --processes {processes} started {len(children)} processes")


def scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()


def metric_sum(text: str, name: str, label_filter: str = "") -> float:
    pattern = re.compile(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", re.M)
    return sum(float(v) for labels, v in pattern.findall(text) if label_filter in (labels or ""))


def start_anchor_collector(work: Path, sink_port: int) -> subprocess.Popen:
    """The Collector of tests/peers/otelcol (built or found in its cache by build_stack.sh)
    running benchmarks/collector_anchor.yaml, sending to the sink; ``.port`` is its OTLP/HTTP."""
    root = Path(__file__).resolve().parents[1]
    built = subprocess.run(["bash", str(root / "tests" / "peers" / "build_stack.sh"), "otelcol"],
                           capture_output=True, text=True)
    if built.returncode != 0:
        sys.exit(f"--collector-anchor: tests/peers/build_stack.sh failed:\n{built.stderr}")
    port = free_port()
    env = {**os.environ, "ANCHOR_OTLP_HTTP": f"127.0.0.1:{port}", "ANCHOR_SINK": f"http://127.0.0.1:{sink_port}"}
    collector = subprocess.Popen([built.stdout.split()[-1], "--config", str(root / "benchmarks" / "collector_anchor.yaml")],
                                 env=env, stdout=subprocess.DEVNULL, stderr=open(work / "otelcol.log", "wb"))
    for _ in range(300):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        if collector.poll() is not None:
            sys.exit(f"--collector-anchor: the Collector exited:\n{(work / 'otelcol.log').read_text()[-2000:]}")
        time.sleep(0.1)
    collector.port = port
    return collector


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--journal", action="store_true",
                        help="run kvmiss serve with the write-ahead journal ([export] journal, in the temp dir)")
    parser.add_argument("--request-records", action="store_true",
                        help="write a request record per judged request ([export] request_records, in the temp dir)")
    parser.add_argument("--pool-blocks", type=int, default=0,
                        help="each worker's [[workers]] pool_blocks: what-if estimates on evicted misses (0: off)")
    parser.add_argument("--processes", type=int, default=1,
                        help="kvmiss serve --processes N (each follows every worker; batches spread over them)")
    parser.add_argument("--churn-interval-ms", type=float, default=10.0,
                        help="each worker publishes 4 stores + 4 removals this often during the run "
                             "(10: 100 batches/s per worker; 8 x 10 ms and 128 x 160 ms are the same fleet-wide rate)")
    parser.add_argument("--batches", type=int, default=400, help="batches in the saturated phase")
    parser.add_argument("--rated", type=int, default=400, help="batches in the fixed-rate phase")
    parser.add_argument("--rate", type=float, default=40_000, help="offered spans/s in the fixed-rate phase")
    parser.add_argument("--light", type=int, default=100, help="batches in each paced phase")
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--deadline-s", type=float, default=120.0)
    parser.add_argument("--profile", choices=("cprofile", "py-spy"), help="profile kvmiss serve meanwhile")
    parser.add_argument("--pipeline-only", action="store_true",
                        help="measure Pipeline.consume's CPU/span in this process instead (no sockets)")
    parser.add_argument("--repeat", type=int, default=5, help="--pipeline-only: best of this many runs")
    parser.add_argument("--collector-anchor", action="store_true",
                        help="also run the saturated load through the OpenTelemetry Collector alone (a transform "
                             "processor setting one attribute; built by tests/peers/build_stack.sh)")
    args = parser.parse_args(argv)
    args.collector_port = 0
    if args.pipeline_only:
        pipeline_only(args)
        return
    if not sys.platform.startswith("linux"):
        sys.exit("needs Linux (/proc) for the CPU figures")
    ctx = multiprocessing.get_context("spawn")
    work = Path(tempfile.mkdtemp(prefix="kvmiss-bench-serve-"))
    ports: set[int] = set()
    while len(ports) < args.workers:  # distinct: the OS may hand a just-closed port out again
        ports.add(free_port())
    endpoints = [f"tcp://127.0.0.1:{p}" for p in sorted(ports)]
    http_port, metrics_port = free_ports(args.processes), free_ports(args.processes)
    children, procs = [], []
    try:
        sink_conn, child_conn = ctx.Pipe()
        report_sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        report_sock.bind(("127.0.0.1", 0))
        sink = ctx.Process(target=sink_main, args=(child_conn, report_sock.getsockname()[1]), name="sink", daemon=True)
        sink.start()
        children.append(sink)
        _, sink_port = receive(sink_conn, sink)

        pub_conn, child_conn = ctx.Pipe()
        pubs = ctx.Process(target=publishers_main, args=(child_conn, endpoints, args.processes, args.churn_interval_ms / 1000), name="publishers", daemon=True)
        pubs.start()
        children.append(pubs)
        receive(pub_conn, pubs)  # bound

        pool = f"pool_blocks = {args.pool_blocks}\n" if args.pool_blocks else ""
        workers = "".join(f'[[workers]]\nid = "w{w}"\nendpoint = "{ep}"\n{pool}' for w, ep in enumerate(endpoints))
        config = work / "kvmiss.toml"
        journal = f'journal = "{work / "journal"}"\n' if args.journal else ""
        if args.request_records:
            journal += f'request_records = "{work / "requests.jsonl"}"\n'
        config.write_text(f'[otlp]\ngrpc = ""\nhttp = "127.0.0.1:{http_port}"\n[export]\n{journal}'
                          f'endpoint = "http://127.0.0.1:{sink_port}"\n[engine]\nblock_size = {BLOCK}\n'
                          f'[privacy]\ndigest_key = "bench-serve-digest-key-0001"\n'
                          f'[metrics]\nlisten = "127.0.0.1:{metrics_port}"\n{workers}')
        serve_args = ["-m", "kvmiss.enricher.cli", "serve", "--config", str(config), "--log-level", "WARNING",
                      "--processes", str(args.processes)]
        profile_out = work / ("serve.prof" if args.profile == "cprofile" else "serve.speedscope.json")
        if args.profile == "cprofile":
            serve_args = ["-m", "cProfile", "-o", str(profile_out)] + serve_args
        serve = subprocess.Popen([sys.executable, *serve_args], stderr=open(work / "serve.log", "wb"))
        procs.append(serve)
        for _ in range(100):
            try:
                for i in range(args.processes):
                    urllib.request.urlopen(f"http://127.0.0.1:{metrics_port + i}/healthz", timeout=1)
                break
            except OSError:
                time.sleep(0.1)
        msg = receive(pub_conn, pubs, timeout=120)
        if msg[0] != "populated":
            sys.exit(f"publishers: {msg}")
        _, lookup_ts, pop_seqs = msg
        t_pop = time.monotonic()
        scrape_all = lambda: "\n".join(scrape(metrics_port + i) for i in range(args.processes))  # noqa: E731
        serve_pids = group_pids(serve.pid, args.processes)
        while metric_sum(scrape_all(), "kvmiss_stream_batches_applied_total") < sum(pop_seqs) * args.processes:
            if time.monotonic() - t_pop > 120:
                sys.exit("kvmiss did not apply the population within 120 s")
            time.sleep(0.2)
        population_s = time.monotonic() - t_pop
        # Following the fleet's churn alone, before any span: what the event stream costs.
        time.sleep(1.0)
        cpu0, t0 = sum(process_cpu_s(p) for p in serve_pids), time.monotonic()
        time.sleep(IDLE_S)
        idle = {"cores": (sum(process_cpu_s(p) for p in serve_pids) - cpu0) / (time.monotonic() - t0),
                "rss_mb": sum(rss_mb(p) for p in serve_pids)}
        spy = None
        if args.profile == "py-spy":
            spy = subprocess.Popen([shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(serve.pid), "--format", "speedscope",
                                    "-o", str(profile_out), "--rate", "200", "--threads", "--nonblocking"], stdout=subprocess.DEVNULL)
            procs.append(spy)

        neighbours = {"sink": sink.pid, "publishers": pubs.pid}
        if args.collector_anchor:
            collector = start_anchor_collector(work, sink_port)
            procs.append(collector)
            args.collector_port = collector.port
            neighbours["otelcol"] = collector.pid
        gen_conn, child_conn = ctx.Pipe()
        gen = ctx.Process(target=loadgen_main, name="loadgen", daemon=True,
                          args=(child_conn, args, sink_port, http_port, serve_pids, lookup_ts - 0.001, report_sock,
                                neighbours))
        gen.start()
        children.append(gen)
        _, results = receive(gen_conn, gen, timeout=900)
        metrics = scrape_all()
        idle["rss_end_mb"] = sum(rss_mb(p) for p in serve_pids)
        pub_conn.send("stop")
        _, final_seqs = receive(pub_conn, pubs)
        sink_conn.send("stop")
        _, tally = receive(sink_conn, sink)
        if spy is not None:
            spy.send_signal(2)
            spy.wait(30)
        serve.terminate()
        serve.wait(60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for c in children:
            c.join(5)
            if c.is_alive():
                c.kill()
        if not args.profile:  # keep the config, serve.log and the profile only when profiling
            shutil.rmtree(work, ignore_errors=True)
    report(args, results, metrics, tally, population_s, sum(pop_seqs), sum(final_seqs), idle)
    if args.profile == "cprofile":
        import pstats

        print(f"\ncProfile of kvmiss serve's main thread (event loop), {profile_out}:")
        pstats.Stats(str(profile_out)).sort_stats("tottime").print_stats(25)
    elif args.profile == "py-spy":
        print(f"\npy-spy profile (speedscope, open in speedscope.app): {profile_out}")
        summarize_speedscope(profile_out)


# Where the event loop thread's time goes: inclusive share of its samples per stage.
STAGES = (
    ("idle (waiting in select)", ("EpollSelector.select",)),
    ("OTLP/HTTP receive: aiohttp, body, gunzip, parse", ("Receivers._answer_http",)),
    ("  of which pipeline.consume", ("Pipeline.consume",)),
    ("    read facts from spans (wire scanner + holding)", ("Pipeline._take_hits", "Pipeline._take_spans")),
    ("    assemble + judge (Pipeline._assess)", ("Pipeline._assess",)),
    ("      evidence + verdict (Attributor.attribute)", ("Attributor.attribute",)),
    ("      write outputs (Pipeline._write)", ("Pipeline._write", "upsert_attributes")),
    ("    release: strip raw inputs", ("Pipeline._release", "strip_raw_inputs")),
    ("export: serialize, gzip, POST (HttpExporter.export)", ("HttpExporter.export",)),
    ("service tick: drain applied batches into the index, poll", ("Service._tick_forever",)),
)


def summarize_speedscope(path: Path) -> None:
    data = json.loads(path.read_text())
    frames = data["shared"]["frames"]
    for profile in data["profiles"]:
        thread = profile.get("name", "")
        if "MainThread" not in thread and "kvmiss-collector" not in thread:
            continue
        total = sum(profile["weights"])
        hits = {label: 0.0 for label, _ in STAGES}
        for sample, weight in zip(profile["samples"], profile["weights"]):
            names = {frames[i]["name"] for i in sample}
            for label, wanted in STAGES:
                if names.intersection(wanted):
                    hits[label] += weight
        print(f"{thread}: {total:.1f} s of samples")
        if "MainThread" in thread:
            for label, _ in STAGES:
                print(f"  {hits[label] / total:6.1%}  {label}")


def report(args, results, metrics, tally, population_s, pop_batches, all_batches, idle) -> None:
    import google.protobuf
    from google.protobuf.internal import api_implementation

    print(f"python {platform.python_version()} on {platform.machine()}, {os.cpu_count()} CPUs; "
          f"protobuf {google.protobuf.__version__} ({api_implementation.Type()}); journal "
          f"{'on' if args.journal else 'off'}, request records {'on' if args.request_records else 'off'}, "
          f"processes {args.processes}")
    blocks = args.workers * (RESIDENT_STEPS + EVICTED_STEPS) * 64
    print(f"population: {args.workers} workers x {(RESIDENT_STEPS + EVICTED_STEPS) * 64:,} blocks stored "
          f"({EVICTED_STEPS * 64:,} then evicted), {pop_batches:,} batches, {blocks:,} blocks, applied in {population_s:.1f} s; "
          f"churn during the run: {all_batches - pop_batches:,} more batches (4 stores + 4 removals / "
          f"{args.churn_interval_ms:g} ms / worker)")
    print(f"before any span, following the churn alone: kvmiss {idle['cores']:.2f} cores; RSS {idle['rss_mb']:.0f} MB "
          f"({idle['rss_mb'] * 2**20 / blocks:.0f} B per stored block, everything included), "
          f"{idle['rss_end_mb']:.0f} MB at the end")
    print(f"workload: {SPANS_PER_BATCH}-span batches ({REQUESTS_PER_BATCH} requests x 4 spans; router spans carry a "
          f"{CHAIN_BLOCKS}-block chain), {results['raw_bytes'] / 1024:.0f} KiB protobuf, {results['gz_bytes'] / 1024:.0f} KiB gzip'd")
    rows = (("direct_paced", "direct to sink, paced    "), ("via_paced", "via kvmiss,     paced    "),
            ("via_rated", f"via kvmiss, {args.rate / 1000:.0f}k spans/s "), ("via_saturated", f"via kvmiss, {args.concurrency} in flight  "))
    for name, label in rows:
        r = results[name]
        spans = r["delivered"] * SPANS_PER_BATCH
        e2e = r["e2e_ms"] or [float("nan")]
        line = (f"{label}: {r['delivered']}/{r['batches']} batches, {spans / r['elapsed_s']:>8,.0f} spans/s, "
                f"POST->sink p50 {statistics.median(e2e):7.2f} ms p99 {percentile(e2e, 99):7.2f} ms")
        if name != "direct_paced":
            line += (f", ack p50 {statistics.median(r['ack_ms']):.2f} ms, statuses {r['statuses']}, "
                     f"kvmiss CPU {r['kvmiss_cpu_s'] / max(spans, 1) * 1e6:.1f} us/span")
        print(line)
        if name == "via_saturated":  # where the two cores went while kvmiss was saturated
            cores = {"kvmiss": r["kvmiss_cpu_s"], **r["others_cpu_s"]}
            machine = r["machine_cpu_s"]
            print("  cores busy, saturated: " + ", ".join(f"{n} {c / r['elapsed_s']:.2f}" for n, c in cores.items())
                  + f"; whole machine busy {machine['busy'] / r['elapsed_s']:.2f}, stolen by the hypervisor "
                  f"{machine['steal'] / r['elapsed_s']:.2f}, idle {machine['idle'] / r['elapsed_s']:.2f} (of {os.cpu_count()})")
    if "collector_saturated" in results:
        report_anchor(args, results)
    base, via = results["direct_paced"]["e2e_ms"], results["via_paced"]["e2e_ms"]
    rated = results["via_rated"]["e2e_ms"]
    print(f"added latency, paced: p50 {statistics.median(via) - statistics.median(base):.2f} ms, "
          f"p99 {percentile(via, 99) - percentile(base, 99):.2f} ms (via minus direct, per percentile)")
    print(f"added latency at {args.rate:,.0f} spans/s offered: p50 {statistics.median(rated) - statistics.median(base):.2f} ms, "
          f"p99 {percentile(rated, 99) - percentile(base, 99):.2f} ms")
    labels = {m: metric_sum(metrics, "kvmiss_requests_total", f'label="{m}"') for m, _ in MIX}
    others = metric_sum(metrics, "kvmiss_requests_total") - sum(labels.values())
    judged = metric_sum(metrics, "kvmiss_requests_total")
    print(f"kvmiss verdicts: {judged:,.0f} requests; " + ", ".join(f"{m} {v / judged:.1%}" for m, v in labels.items())
          + f", other {others:,.0f} (expected mix {', '.join(f'{m} {w:.0%}' for m, w in MIX)})")
    waits = metric_sum(metrics, "kvmiss_history_wait_seconds_sum")
    unenriched = metric_sum(metrics, "kvmiss_requests_unenriched_total")
    print(f"history wait: {waits:.3f} s summed over all requests (deliberate wait not triggered); "
          f"unenriched {unenriched:.0f}; refused {metric_sum(metrics, 'kvmiss_spans_refused_total'):.0f} spans")
    seen, raw_seen = {}, 0
    for batch, (labels, raw) in tally["sampled"].items():
        if batch >= args.light:  # the first `light` batches went straight to the sink (baseline)
            raw_seen += raw
            for label, n in labels.items():
                seen[label] = seen.get(label, 0) + n
    print(f"sink: {tally['spans']:,} spans in {tally['batches']} batches; labels on every 8th batch via kvmiss "
          f"{dict(sorted(seen.items()))}; raw inputs seen there: {raw_seen}")


def report_anchor(args, results) -> None:
    """kvmiss serve against the Collector alone on the same load, per core of CPU each used."""
    kv, col = results["via_saturated"], results["collector_saturated"]
    kv_spans, col_spans = kv["delivered"] * SPANS_PER_BATCH, col["delivered"] * SPANS_PER_BATCH
    kv_per_core = kv_spans / kv["kvmiss_cpu_s"]
    col_per_core = col_spans / col["others_cpu_s"]["otelcol"]
    e2e = col["e2e_ms"] or [float("nan")]
    print(f"Collector alone, {args.concurrency} in flight: {col['delivered']}/{col['batches']} batches, "
          f"{col_spans / col['elapsed_s']:>8,.0f} spans/s, POST->sink p50 {statistics.median(e2e):7.2f} ms "
          f"p99 {percentile(e2e, 99):7.2f} ms, statuses {col['statuses']}, "
          f"otelcol CPU {col['others_cpu_s']['otelcol'] / max(col_spans, 1) * 1e6:.1f} us/span")
    print(f"anchor, spans/s per core of CPU used: kvmiss serve {kv_per_core:,.0f} ({kv_spans:,} spans, "
          f"{kv['kvmiss_cpu_s']:.2f} CPU s), Collector + transform {col_per_core:,.0f} ({col_spans:,} spans, "
          f"{col['others_cpu_s']['otelcol']:.2f} CPU s); kvmiss / Collector = {kv_per_core / col_per_core:.2f}")


if __name__ == "__main__":
    main()
