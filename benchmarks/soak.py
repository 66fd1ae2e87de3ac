"""Soak: a real ``kvmiss serve`` under sustained load for N minutes (issue #7, item 2).

Four processes, all on loopback, every loop bounded by a count and a deadline:

    fleet (this script, spawned)   W simulated engines: kvmiss's demo publisher (vLLM 0.33's
                                   wire protocol; real ZeroMQ PUB + ROUTER replay sockets),
                                   one step every 1/hz s per worker: store a chain of new
                                   blocks, remove the chain stored R steps earlier
    kvmiss serve (subprocess)      the service under test, [history] retention_s small so
                                   the run prunes the index all along
    sink (this script, spawned)    a real OTLP/HTTP sink: counts spans per batch, checks the
                                   verdict on every router span against the label expected
    generator (this process)       OTLP/HTTP gzip'd protobuf, 512-span batches at a fixed rate;
                                   1 span in ``--router-every`` is a router span whose kvmiss
                                   inputs name blocks the fleet really published (resident on
                                   the chosen worker, on another, evicted from it, never
                                   stored, or a hit) and carry the expected label

Lookup times are taken just before a fleet step (between two steps, at most 10 ms before the
second, as an engine looks up when it schedules a step) at least ``--lookback-steps`` old, so no
request has to wait for its history: the latency measured is kvmiss's own (receive, judge,
forward), not a deliberate history wait (kvmiss's wait histogram is reported to show it).
503s are honoured (Retry-After) and counted; latency is taken from the accepted attempt.

Reports: throughput (spans/s in and out, block events/s published, batches/s applied),
p50/p99 latency POST -> sink through kvmiss and, for reference, straight to the sink;
kvmiss's RSS sampled over time, judged by its growth over the second half of the run after
warm-up (a limit real growth cannot pass: a structure that grows with running time shows as
a staircase that a per-minute slope slips under); kvmiss CPU per span; spans sent vs
received per batch (must be equal: zero lost, zero duplicated); verdicts: exact / honest
unknown / wrong (must be 0 wrong), per minute.

What grows with running time is driven hard rather than waited for: the fleet evicts
workers x step_hz x blocks_per_step blocks a second (12,800/s with 16 workers), and kvmiss's
time-bounded structures are given short horizons (retention 30 s, `[history]
aged_out_horizon_s` 600 s), so a 1-hour run passes through their steady state many times.
Warm-up defaults to retention + 1.25 x the aged-out horizon + 60 s.

An engine host's clock set back (or forward) once: ``--fleet-clock-step-s -0.5
--fleet-clock-step-at-s 300`` (its batches, lookup times and the truth follow it; kvmiss's
clock does not). A starved host can be played too: ``--stall-every-s 40 --stall-s 5 --stall-target both``
freezes the fleet, kvmiss or both (SIGSTOP / SIGCONT) that often. The host's wall clock is
watched against its monotonic clock all along (engines, truth and kvmiss stamp with it): any
jump is reported, beside how often kvmiss saw an engine clock go back. Wrong verdicts are
printed with every kvmiss attribute and where the truth came from (lookup step, store step,
owner).

Usage: .venv/bin/python benchmarks/soak.py [--minutes 3] [--rate 20000] [--workers 4]
       [--aged-out-horizon-s 600] [--rss-growth-limit-mb 2] [--json results.json]
       [--stall-every-s 0 --stall-s 3 --stall-target fleet|kvmiss|both]
       [--fleet-clock-step-s 0 --fleet-clock-step-at-s 300]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime
import gzip
import json
import multiprocessing
import os
import platform
import queue
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import zlib
from pathlib import Path

from benchlib import free_port, percentile, process_cpu_s, rss_mb, set_attr, start_sink

BLOCK = 16
UNKNOWN = ("unknown_history", "unknown_epoch")
LABEL_MIX = (("resident_miss", 30), ("routing_miss", 25), ("evicted", 20), ("no_match", 20), ("hit", 5))










# --- the fleet (child process) -----------------------------------------------------------------


def fleet_main(args: dict, conn, info_q, stop) -> None:
    """W demo publishers stepping at ``hz``; every step's stored chains go to ``info_q``."""
    import zmq

    from kvmiss.enricher.demo.publisher import BlockRemoved, BlockStored, EventBatch, Publisher

    ctx = zmq.Context()
    n, hz, blocks, keep = args["workers"], args["step_hz"], args["blocks_per_step"], args["resident_steps"]
    pubs = []
    for w in range(n):
        pub = Publisher(ctx, topic=f"kv@w{w}@soak", buffer_steps=20_000)
        pub.start()
        pubs.append(pub)
    conn.send([(p.pub_endpoint, p.replay_endpoint) for p in pubs])
    rng = random.Random(args["seed"])
    chains: list[collections.deque] = [collections.deque(maxlen=keep) for _ in range(n)]
    token_ids = list(range(BLOCK * blocks))
    start = time.time()
    steps = events = overruns = 0
    deadline = start + args["fleet_seconds"]
    step_at, step_s = start + args["clock_step_at_s"], args["clock_step_s"]

    def clock() -> float:  # the engines' host clock: set by ``clock_step_s`` once, at ``step_at``
        now = time.time()
        return now + step_s if step_s and now >= step_at else now

    while not stop.is_set() and time.time() < deadline:
        s = clock()
        stored_now = []
        for w, pub in enumerate(pubs):
            chain = [rng.getrandbits(63) for _ in range(blocks)]
            batch_events = [BlockStored(block_hashes=chain, parent_block_hash=None, token_ids=token_ids,
                                        block_size=BLOCK, lora_id=None, medium=None, lora_name=None)]
            events += blocks
            if len(chains[w]) == keep:  # the chain stored `keep` steps ago leaves now
                batch_events.append(BlockRemoved(block_hashes=chains[w][0], medium=None))
                events += blocks
            chains[w].append(chain)
            pub.publish(EventBatch(ts=clock(), events=batch_events, data_parallel_rank=None))
            stored_now.append(chain)
        e = clock()
        info_q.put((steps, s, e, stored_now))
        steps += 1
        due = start + steps / hz
        pause = due - time.time()
        if pause > 0:
            time.sleep(pause)
        else:
            overruns += 1
    for pub in pubs:
        pub.shutdown()
    ctx.term()
    conn.send({"steps": steps, "seconds": time.time() - start, "block_events": events,
               "batches": steps * n, "overruns": overruns})


# --- the sink (child process) ------------------------------------------------------------------


def sink_main(conn) -> None:
    asyncio.run(_sink(conn))


async def _sink(conn) -> None:
    from aiohttp import web
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
        ExportTraceServiceResponse,
    )

    ok = ExportTraceServiceResponse().SerializeToString()
    batches: dict[int, list] = {}  # batch id -> [first arrival, spans, deliveries]
    outcomes: collections.Counter = collections.Counter()  # (expected, got, history)
    by_minute: collections.Counter = collections.Counter()  # (minute, exact|unknown|wrong)
    wrong_examples: list = []
    totals = {"spans": 0, "requests": 0, "unattributed_spans": 0}
    start = [None]

    def value(kv):
        kind = kv.value.WhichOneof("value")
        return getattr(kv.value, kind) if kind else None

    async def traces(request: web.Request) -> web.Response:
        body = await request.read()  # aiohttp gunzips
        now = time.time()
        message = ExportTraceServiceRequest.FromString(body)
        batch_id, n = None, 0
        for rs in message.resource_spans:
            for kv in rs.resource.attributes:
                if kv.key == "soak.batch":
                    batch_id = kv.value.int_value
            for ss in rs.scope_spans:
                n += len(ss.spans)
                if batch_id is None or batch_id < 0 or not any(kv.key == "soak.batch" for kv in rs.resource.attributes):
                    continue  # plain spans, or a baseline batch that never went through kvmiss
                for span in ss.spans:  # router spans: their own resource, small
                    attrs = {kv.key: value(kv) for kv in span.attributes}
                    expected, got = attrs.get("soak.expect"), attrs.get("kvmiss.label")
                    if expected is None:
                        continue
                    history = ""
                    if got in UNKNOWN:  # which history, and the reason's lead ("clock step", "aged out", ...)
                        reason = attrs.get("kvmiss.reason", "")
                        lead = reason.split(":")[0] if ":" in reason[:40] else ""
                        history = attrs.get("kvmiss.history", "") + (f"; {lead}" if lead else "")
                    outcomes[(expected, got, history)] += 1
                    verdict = "exact" if got == expected else "unknown" if got in UNKNOWN else "wrong"
                    if start[0] is None:
                        start[0] = now
                    by_minute[(int((now - start[0]) // 60), verdict)] += 1
                    if verdict == "wrong" and len(wrong_examples) < 40:
                        wrong_examples.append({k: v for k, v in attrs.items()
                                               if k.startswith(("kvmiss.", "soak.", "gen_ai.request.id"))
                                               and k != "kvmiss.block_hashes"} | {"judged_at": now})
        totals["spans"] += n
        totals["requests"] += 1
        if batch_id is None:
            totals["unattributed_spans"] += n
        else:
            entry = batches.setdefault(batch_id, [now, 0, 0])
            entry[1] += n
            entry[2] += 1
        return web.Response(body=ok, content_type="application/x-protobuf")

    runner, port = await start_sink(traces)
    conn.send(port)
    loop = asyncio.get_running_loop()
    while True:
        command = await loop.run_in_executor(None, conn.recv)
        if command == "totals":
            conn.send(dict(totals))
        elif command == "dump":
            conn.send({"batches": batches, "outcomes": dict(outcomes), "by_minute": dict(by_minute),
                       "wrong_examples": wrong_examples, "totals": dict(totals)})
        elif command == "stop":
            break
    await runner.cleanup()


# --- the load generator (this process) ---------------------------------------------------------




def plain_template(n: int, rng: random.Random) -> bytes:
    """``n`` spans of a router/engine service that carry no kvmiss input, serialized once."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    request = ExportTraceServiceRequest()
    rs = request.resource_spans.add()
    for key, val in (("service.name", "llm-gateway"), ("service.instance.id", "gw-7f9c"),
                     ("host.name", "gpu-node-12"), ("deployment.environment", "prod")):
        set_attr(rs.resource.attributes, key, val)
    ss = rs.scope_spans.add()
    ss.scope.name = "gateway"
    t0 = time.time_ns()
    for i in range(n):
        span = ss.spans.add(trace_id=rng.randbytes(16), span_id=rng.randbytes(8), parent_span_id=rng.randbytes(8),
                            name="http.request", kind=2, start_time_unix_nano=t0 + i * 1000,
                            end_time_unix_nano=t0 + i * 1000 + 850_000_000)
        for key, val in (("http.request.method", "POST"), ("http.route", "/v1/chat/completions"),
                         ("http.response.status_code", 200), ("url.scheme", "https"),
                         ("server.address", "gateway.internal"), ("server.port", 443),
                         ("network.protocol.version", "1.1"), ("user_agent.original", "openai-python/1.54"),
                         ("gen_ai.request.model", "meta-llama/Llama-3.1-8B-Instruct"),
                         ("gen_ai.system", "vllm"), ("app.tenant_tier", "standard"),
                         ("app.latency_ms", rng.random() * 900)):
            set_attr(span.attributes, key, val)
    return request.SerializeToString()


class Truth:
    """What the fleet published, step by step (fed from the fleet's queue on a thread)."""

    def __init__(self, workers: int, resident_steps: int, keep_steps: int):
        self.workers, self.keep = workers, resident_steps
        self.steps: collections.OrderedDict[int, tuple] = collections.OrderedDict()
        self.lock = threading.Lock()
        self.max_steps = keep_steps
        self.latest = -1

    def add(self, info) -> None:
        k, s, e, chains = info
        with self.lock:
            self.steps[k] = (s, e, chains)
            self.latest = k
            while len(self.steps) > self.max_steps:
                self.steps.popitem(last=False)

    def pick(self, rng: random.Random, lookback: tuple[int, int], evicted_within: int):
        """(lookup t, chosen worker, first-miss hash, cached tokens, expected label) or None."""
        label = rng.choices([l for l, _ in LABEL_MIX], [w for _, w in LABEL_MIX])[0]
        with self.lock:
            lo, hi = self.latest - lookback[1], self.latest - lookback[0]
            k = rng.randint(lo, hi)
            if k not in self.steps or k + 1 not in self.steps:
                return None
            # Between steps k and k+1, at most 10 ms before k+1 starts: a lookup belongs to the
            # step that follows it, and an engine makes none while it idles or stalls (a
            # midpoint in a 3 s stall would be a lookup whose step reaches the replay ring
            # over a second later, past [history] publish_delay_s).
            t = max((self.steps[k][1] + self.steps[k + 1][0]) / 2, self.steps[k + 1][0] - 0.01)
            w = rng.randrange(self.workers)
            # The step containing t is k+1: its removal (the chain of step k+1-R) came before t.
            if label in ("resident_miss", "routing_miss", "hit"):
                j = rng.randint(k + 2 - self.keep, k)  # resident through step k+1 on its worker
                owner = w if label != "routing_miss" else (w + rng.randrange(1, self.workers)) % self.workers
            elif label == "evicted":
                j = rng.randint(k + 1 - self.keep - evicted_within, k + 1 - self.keep)
                owner = w
            else:
                j, owner = None, None
            if j is not None:
                if j not in self.steps:
                    return None
                h = rng.choice(self.steps[j][2][owner])
            else:
                h = rng.getrandbits(63)  # never published (2^-63 odds otherwise)
        cached = 3 * BLOCK if label == "hit" else BLOCK
        return t, w, h, cached, label, (k, j, owner)


def router_request(batch_id: int, n: int, truth: Truth, rng: random.Random, args) -> tuple[bytes, int]:
    """A ResourceSpans of ``n`` router spans (with the batch id) serialized as a request."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    request = ExportTraceServiceRequest()
    rs = request.resource_spans.add()
    set_attr(rs.resource.attributes, "service.name", "router")
    set_attr(rs.resource.attributes, "soak.batch", batch_id)
    ss = rs.scope_spans.add()
    ss.scope.name = "router"
    now = time.time_ns()
    made = 0
    for i in range(n):
        pick = None
        for _ in range(5):
            pick = truth.pick(rng, (args.lookback_steps, args.lookback_steps + 100), args.evicted_within_steps)
            if pick is not None:
                break
        t, w, h, cached, label, where = pick if pick is not None else (
            time.time() - 1, 0, rng.getrandbits(63), 3 * BLOCK, "hit", (-1, None, None))
        span = ss.spans.add(trace_id=rng.randbytes(16), span_id=rng.randbytes(8), name="route", kind=1,
                            start_time_unix_nano=now, end_time_unix_nano=now + 2_000_000)
        for key, val in (("gen_ai.request.id", f"soak-{batch_id}-{i}"), ("kvmiss.route.worker", f"w{w}"),
                         ("kvmiss.route.policy", "prefix"), ("gen_ai.usage.input_tokens", 3 * BLOCK + 1),
                         ("gen_ai.usage.cache_read.input_tokens", cached),
                         ("kvmiss.block_hashes", [7, h, 9]),
                         ("kvmiss.lookup_time_unix_nano", int(t * 1e9)), ("soak.expect", label),
                         ("soak.step", where[0]), ("soak.stored_step", -1 if where[1] is None else where[1]),
                         ("soak.owner", -1 if where[2] is None else where[2])):
            set_attr(span.attributes, key, val)
        made += 1
    return request.SerializeToString(), made


class Generator:
    def __init__(self, args, truth: Truth, port: int, template_gz: bytes, template_spans: int):
        self.args, self.truth, self.port = args, truth, port
        self.template_gz, self.template_spans = template_gz, template_spans
        self.rng = random.Random(args.seed + 1)
        self.sent: dict[int, int] = {}  # batch id -> spans, once accepted
        self.attempt_start: dict[int, float] = {}  # batch id -> start of the accepted POST
        self.first_start: dict[int, float] = {}
        self.refused_spans = 0
        self.refusals = 0
        self.errors = 0
        self.behind = 0  # batches that left later than their slot (open loop could not keep up)
        self.in_flight = 0

    def body(self, batch_id: int) -> tuple[bytes, int]:
        raw, routers = router_request(batch_id, self.args.batch // self.args.router_every, self.truth, self.rng, self.args)
        return self.template_gz + zlib.compress(raw, 1, 31), self.template_spans + routers

    async def run(self, seconds: float, first_id: int = 0) -> None:
        import aiohttp

        interval = self.args.batch / self.args.rate
        gate = asyncio.Semaphore(self.args.concurrency)
        headers = {"Content-Type": "application/x-protobuf", "Content-Encoding": "gzip"}
        url = f"http://127.0.0.1:{self.port}/v1/traces"
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=self.args.concurrency),
                                         timeout=aiohttp.ClientTimeout(total=60)) as session:
            tasks = set()
            start = time.monotonic()
            i = 0
            while time.monotonic() - start < seconds:
                slot = start + i * interval
                delay = slot - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                await gate.acquire()
                if time.monotonic() - slot > interval:
                    self.behind += 1
                batch_id = first_id + i
                body, n = self.body(batch_id)
                task = asyncio.ensure_future(self._post(session, url, headers, batch_id, body, n, gate))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                i += 1
            if tasks:
                await asyncio.wait(tasks, timeout=120)

    async def _post(self, session, url, headers, batch_id, body, n, gate) -> None:
        import aiohttp

        try:
            self.first_start[batch_id] = time.time()
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                began = time.time()
                try:
                    async with session.post(url, data=body, headers=headers) as response:
                        await response.read()
                        status, retry_after = response.status, response.headers.get("Retry-After")
                except (TimeoutError, aiohttp.ClientError, OSError):
                    self.errors += 1
                    await asyncio.sleep(1.0)
                    continue
                if status == 200:
                    self.sent[batch_id] = n
                    self.attempt_start[batch_id] = began
                    return
                if status == 503:
                    self.refusals += 1
                    self.refused_spans += n
                    await asyncio.sleep(float(retry_after or 1))
                    continue
                self.errors += 1
                return  # a permanent error: not acknowledged, not counted as sent
        finally:
            gate.release()


def post_direct(port: int, body: bytes) -> int:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/traces", data=body, method="POST",
                                     headers={"Content-Type": "application/x-protobuf", "Content-Encoding": "gzip"})
    with urllib.request.urlopen(request, timeout=30) as response:
        response.read()
        return response.status


def scrape(port: int) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    out: dict[str, float] = collections.Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items())) + "}"
                                 if sample.labels else "")
            out[key] += sample.value
    return dict(out)


def metric_sum(metrics: dict, prefix: str) -> float:
    return sum(v for k, v in metrics.items() if k == prefix or k.startswith(prefix + "{"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--rate", type=float, default=15_000, help="target spans/s")
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--router-every", type=int, default=16, help="1 router span per this many spans")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--step-hz", type=float, default=50)
    parser.add_argument("--blocks-per-step", type=int, default=16)
    parser.add_argument("--resident-steps", type=int, default=200)
    parser.add_argument("--evicted-within-steps", type=int, default=200)
    parser.add_argument("--lookback-steps", type=int, default=15, help="lookups at least this many steps old")
    parser.add_argument("--retention-s", type=float, default=30.0)
    parser.add_argument("--aged-out-horizon-s", type=float, default=600.0,
                        help="[history] aged_out_horizon_s (inf: remember every aged-out block, the old rule)")
    parser.add_argument("--warmup-s", type=float, default=None,
                        help="RSS is judged after this (default: retention + 1.25 x aged-out horizon + 60 s)")
    parser.add_argument("--sample-s", type=float, default=5.0)
    parser.add_argument("--rss-growth-limit-mb", type=float, default=2.0,
                        help="MB: RSS growth over the second half of the run after warm-up beyond this fails it")
    parser.add_argument("--baseline-batches", type=int, default=100)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--stall-every-s", type=float, default=0.0,
                        help="freeze --stall-target (SIGSTOP) this often, as a starved host does (0: never)")
    parser.add_argument("--stall-s", type=float, default=3.0, help="how long each freeze lasts")
    parser.add_argument("--stall-target", choices=("fleet", "kvmiss", "both"), default="fleet")
    parser.add_argument("--fleet-clock-step-s", type=float, default=0.0,
                        help="set the engines' clock by this much once (negative: back), as a time sync does; "
                             "their batches, their lookup times and the truth all follow it")
    parser.add_argument("--fleet-clock-step-at-s", type=float, default=300.0,
                        help="when, in seconds after the fleet starts")
    parser.add_argument("--json", help="write every sample and count here")
    args = parser.parse_args()
    seconds = args.minutes * 60
    if args.warmup_s is None:
        horizon = args.aged_out_horizon_s if args.aged_out_horizon_s != float("inf") else 0.0
        args.warmup_s = args.retention_s + 1.25 * horizon + 60
    started = datetime.datetime.now().astimezone()
    ctx = multiprocessing.get_context("spawn")
    workdir = Path(tempfile.mkdtemp(prefix="kvmiss-soak-"))
    log_path = workdir / "kvmiss.log"
    procs: list = []
    kvmiss = None
    print(f"kvmiss soak: {' '.join(sys.argv)}", flush=True)
    print(f"started {started.isoformat(timespec='seconds')} on {platform.node()}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    try:
        sink_conn, child = ctx.Pipe()
        sink = ctx.Process(target=sink_main, args=(child,), daemon=True)
        sink.start()
        procs.append(sink)
        sink_port = sink_conn.recv()

        fleet_conn, child = ctx.Pipe()
        info_q = ctx.Queue()
        stop_fleet = ctx.Event()
        fleet_args = {"workers": args.workers, "step_hz": args.step_hz, "blocks_per_step": args.blocks_per_step,
                      "resident_steps": args.resident_steps, "seed": args.seed,
                      "fleet_seconds": seconds + 600,  # bounded; stopped right after the load
                      "clock_step_s": args.fleet_clock_step_s, "clock_step_at_s": args.fleet_clock_step_at_s}
        fleet = ctx.Process(target=fleet_main, args=(fleet_args, child, info_q, stop_fleet), daemon=True)
        fleet.start()
        procs.append(fleet)
        endpoints = fleet_conn.recv()
        truth = Truth(args.workers, args.resident_steps,
                      keep_steps=args.resident_steps + args.evicted_within_steps + args.lookback_steps + 200)
        stop_reader = threading.Event()

        def read_steps():
            while not stop_reader.is_set():
                try:
                    truth.add(info_q.get(timeout=0.2))
                except queue.Empty:
                    continue

        threading.Thread(target=read_steps, daemon=True).start()

        http_port, metrics_port = free_port(), free_port()
        workers = "".join(f'[[workers]]\nid = "w{w}"\nendpoint = "{pub}"\nreplay_endpoint = "{rep}"\n'
                          for w, (pub, rep) in enumerate(endpoints))
        config = workdir / "kvmiss.toml"
        config.write_text(f"""
[otlp]
grpc = ""
http = "127.0.0.1:{http_port}"
[export]
endpoint = "http://127.0.0.1:{sink_port}"
[engine]
block_size = {BLOCK}
[privacy]
digest_key = "soak-digest-key-000000001"
[metrics]
listen = "127.0.0.1:{metrics_port}"
[history]
retention_s = {args.retention_s}
aged_out_horizon_s = {args.aged_out_horizon_s if args.aged_out_horizon_s != float("inf") else "inf"}
wait_s = 5.0
assemble_wait_s = 10.0
{workers}""")
        log = open(log_path, "w")
        kvmiss = subprocess.Popen([sys.executable, "-m", "kvmiss.enricher.cli", "serve", "--config", str(config)],
                                  stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd=str(workdir))
        deadline = time.monotonic() + 60
        while True:  # ready: every worker's stream live
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/readyz", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if kvmiss.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("kvmiss serve did not become ready; log: " + str(log_path))
            time.sleep(0.2)
        while truth.latest < args.resident_steps + args.evicted_within_steps + args.lookback_steps + 110:
            time.sleep(0.2)  # enough history for every label (bounded by the fleet's own clock)
            if time.monotonic() > deadline + 60:
                raise RuntimeError("the fleet is not stepping")

        rng = random.Random(args.seed)
        n_plain = args.batch - args.batch // args.router_every
        template_gz = gzip.compress(plain_template(n_plain, rng), 1)
        gen = Generator(args, truth, http_port, template_gz, n_plain)

        # Baseline: the same bodies straight to the sink, one at a time.
        direct = []
        for b in range(args.baseline_batches):
            body, _ = gen.body(-1 - b)
            t0 = time.time()
            post_direct(sink_port, body)
            direct.append(time.time() - t0)

        samples = []  # (elapsed s, RSS MB, kvmiss CPU s, metrics, spans at the sink)
        stop_sampler = threading.Event()
        t_start = time.time()
        sink_lock = threading.Lock()

        def sink_totals() -> dict:
            with sink_lock:
                sink_conn.send("totals")
                return sink_conn.recv()

        def sample():
            while True:
                try:
                    samples.append((time.time() - t_start, rss_mb(kvmiss.pid), process_cpu_s(kvmiss.pid),
                                    scrape(metrics_port), sink_totals()["spans"]))
                except OSError:
                    pass
                if stop_sampler.wait(args.sample_s):
                    return

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        clock_jumps = []  # (elapsed s, jump s): this host's wall clock against its monotonic one

        def watch_clock():  # engines, truth and kvmiss all stamp with the wall clock
            offset = time.time() - time.monotonic()
            while not stop_sampler.wait(0.05):
                now_offset = time.time() - time.monotonic()
                if abs(now_offset - offset) > 0.005:
                    clock_jumps.append((round(time.time() - t_start, 1), round(now_offset - offset, 4)))
                offset = now_offset

        threading.Thread(target=watch_clock, daemon=True).start()
        stop_stalls = threading.Event()
        stalls = []

        stalled = {"fleet": [fleet.pid], "kvmiss": [kvmiss.pid], "both": [fleet.pid, kvmiss.pid]}[args.stall_target]

        def stall():  # a starved host: every thread of the process stops at once
            while not stop_stalls.wait(args.stall_every_s):
                for pid in stalled:
                    os.kill(pid, signal.SIGSTOP)
                stalls.append(time.time() - t_start)
                try:
                    stop_stalls.wait(args.stall_s)
                finally:
                    for pid in stalled:
                        os.kill(pid, signal.SIGCONT)

        if args.stall_every_s > 0:
            threading.Thread(target=stall, daemon=True).start()
        cpu0 = process_cpu_s(kvmiss.pid)
        try:
            asyncio.run(gen.run(seconds))
        finally:
            stop_stalls.set()
            time.sleep(0.1)
            for pid in stalled:
                os.kill(pid, signal.SIGCONT)
        load_s = time.time() - t_start
        acked = sum(gen.sent.values())
        drain_deadline = time.monotonic() + 60
        while time.monotonic() < drain_deadline:  # kvmiss still holds what it judges/exports
            received = sink_totals()["spans"]
            if received >= acked + args.baseline_batches * args.batch:
                break
            time.sleep(0.2)
        stop_sampler.set()
        sampler.join(15)
        cpu_s = process_cpu_s(kvmiss.pid) - cpu0
        final = scrape(metrics_port)
        stop_fleet.set()
        fleet_stats = fleet_conn.recv()
        stop_reader.set()
        kvmiss.send_signal(signal.SIGTERM)
        exit_code = kvmiss.wait(60)
        sink_conn.send("dump")
        dump = sink_conn.recv()
        sink_conn.send("stop")
    finally:
        if kvmiss is not None and kvmiss.poll() is None:
            kvmiss.kill()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()

    # --- the report ---------------------------------------------------------------------------
    batches = dump["batches"]
    via = {b: v for b, v in batches.items() if b >= 0}
    lost = [b for b in gen.sent if b not in via]
    short = [b for b, n in gen.sent.items() if b in via and via[b][1] != n * via[b][2]]
    duplicated = [b for b, v in via.items() if v[2] > 1]
    unexpected = [b for b in via if b not in gen.sent]
    delivered = sum(v[1] for v in via.values())
    latency = [(via[b][0] - gen.attempt_start[b]) for b in gen.sent if b in via]
    warm = [(via[b][0] - gen.attempt_start[b]) for b in gen.sent
            if b in via and gen.attempt_start[b] - t_start >= args.warmup_s]
    rss = [(round(t, 1), round(r, 1)) for t, r, _, _, _ in samples]
    baseline_spans = args.baseline_batches * args.batch
    # spans kvmiss had acknowledged and the sink not yet received, at each sample
    backlog = [(round(t, 1), int(m.get("kvmiss_spans_received_total", 0) - (at_sink - baseline_spans)))
               for t, _, _, m, at_sink in samples]
    after = [(t, r) for t, r in rss if t >= args.warmup_s]
    slope = float("nan")
    if len(after) >= 3:
        mt = sum(t for t, _ in after) / len(after)
        mr = sum(r for _, r in after) / len(after)
        slope = sum((t - mt) * (r - mr) for t, r in after) / sum((t - mt) ** 2 for t, _ in after) * 60
    # Growth over the second half: the RSS at the end (median of the last 10 % of samples, so
    # one transient queue does not decide) minus the RSS at the half (median of the samples
    # within 5 % either side of it). A step anywhere in the second half stays to the end.
    growth = float("nan")
    judged_rss = len(after) >= 20 and after[-1][0] - after[0][0] >= 300
    if judged_rss:
        t0, t1 = after[0][0], after[-1][0]
        mid, span = (t0 + t1) / 2, t1 - t0
        at_mid = sorted(r for t, r in after if abs(t - mid) <= 0.05 * span)
        at_end = sorted(r for t, r in after if t >= t1 - 0.1 * span)
        growth = at_end[len(at_end) // 2] - at_mid[len(at_mid) // 2]
        second_half_max = max(r for t, r in after if t >= mid) - at_mid[len(at_mid) // 2]
    rss_flat = not judged_rss or growth <= args.rss_growth_limit_mb
    filter_mb = [(round(t, 1), round(m.get("kvmiss_index_aged_out_bytes", 0) / 1e6, 2)) for t, _, _, m, _ in samples]
    outcomes = collections.Counter()
    for (expected, got, history), n in dump["outcomes"].items():
        outcomes["exact" if got == expected else "unknown" if got in UNKNOWN else "wrong"] += n
    judged = sum(outcomes.values())
    waits = {k: v for k, v in final.items() if k.startswith("kvmiss_history_wait_seconds_bucket")}
    waited = final.get("kvmiss_history_wait_seconds_count", 0) - waits.get("kvmiss_history_wait_seconds_bucket{le=0.0}", 0)
    applied = metric_sum(final, "kvmiss_stream_batches_applied_total")

    print(f"config: {args.workers} workers x {args.step_hz:g} steps/s x {args.blocks_per_step} blocks stored "
          f"(+ as many removed after {args.resident_steps} steps); retention_s {args.retention_s:g}; "
          f"{args.batch}-span batches, 1 router span in {args.router_every}; target {args.rate:,.0f} spans/s, "
          f"{args.concurrency} in flight")
    print(f"load: {load_s:.0f} s; sent (acknowledged) {acked:,} spans in {len(gen.sent):,} batches = "
          f"{acked / load_s:,.0f} spans/s; 503s {gen.refusals} ({gen.refused_spans:,} spans, retried), "
          f"errors {gen.errors}, batches behind schedule {gen.behind}")
    print(f"sink: received {delivered:,} spans in {len(via):,} batches; lost batches {len(lost)}, short "
          f"{len(short)}, duplicated {len(duplicated)}, unexpected {len(unexpected)} -> "
          f"{'spans in = spans out' if not (lost or short or duplicated or unexpected) and delivered == acked else 'MISMATCH'}")
    print(f"fleet: {fleet_stats['block_events'] / fleet_stats['seconds']:,.0f} block events/s, "
          f"{fleet_stats['batches'] / fleet_stats['seconds']:,.0f} batches/s published "
          f"({fleet_stats['overruns']} late steps); kvmiss applied {applied:,.0f} batches "
          f"({applied / fleet_stats['seconds']:,.0f}/s)")
    print(f"latency POST -> sink via kvmiss: p50 {percentile(latency, 50) * 1e3:.1f} ms, p99 "
          f"{percentile(latency, 99) * 1e3:.1f} ms, max {max(latency) * 1e3:.0f} ms (after warm-up: p50 "
          f"{percentile(warm, 50) * 1e3:.1f}, p99 {percentile(warm, 99) * 1e3:.1f} ms)")
    print(f"latency POST -> sink direct (baseline, paced): p50 {percentile(direct, 50) * 1e3:.1f} ms, p99 "
          f"{percentile(direct, 99) * 1e3:.1f} ms; added p50 {(percentile(latency, 50) - percentile(direct, 50)) * 1e3:.1f} ms")
    print(f"history waits: {final.get('kvmiss_history_wait_seconds_count', 0):,.0f} requests judged, "
          f"{waited:,.0f} waited at all (lookups are >= {args.lookback_steps} steps old by design)")
    print(f"kvmiss CPU: {cpu_s:.1f} s = {cpu_s / max(1, acked) * 1e6:.1f} us/span")
    print(f"kvmiss RSS MB (t s, MB): {rss}")
    print(f"spans held in kvmiss (t s, spans): {backlog}")
    if after:
        print(f"RSS after warm-up ({args.warmup_s:g} s): min {min(r for _, r in after):.1f}, max "
              f"{max(r for _, r in after):.1f} MB, slope {slope:+.3f} MB/min (for reference)")
        if judged_rss:
            print(f"RSS growth over the second half after warm-up ({mid:.0f} -> {t1:.0f} s): {growth:+.2f} MB "
                  f"(highest sample {second_half_max:+.2f} MB over the half) -> "
                  f"{'flat' if rss_flat else 'GROWING'} (limit {args.rss_growth_limit_mb:g} MB)")
        else:
            print("RSS growth: too short to judge (needs >= 300 s and 20 samples after warm-up)")
    print(f"aged-out filter MB (t s, MB), every 12th sample: {filter_mb[::12]}")
    print(f"verdicts on {judged:,} router spans: exact {outcomes['exact']:,}, honest unknown "
          f"{outcomes['unknown']:,}, WRONG {outcomes['wrong']:,}")
    detail = collections.Counter()
    for (expected, got, history), n in dump["outcomes"].items():
        detail[f"{expected} -> {got}{' (' + history + ')' if history else ''}"] += n
    for key, n in sorted(detail.items()):
        print(f"  {key}: {n:,}")
    minutes = sorted({m for m, _ in dump["by_minute"]})
    for m in minutes:
        row = {v: dump["by_minute"].get((m, v), 0) for v in ("exact", "unknown", "wrong")}
        total = sum(row.values()) or 1
        print(f"  minute {m}: exact {row['exact']:,}, unknown {row['unknown']:,} ({row['unknown'] / total:.1%}), "
              f"wrong {row['wrong']}")
    print(f"wall clock jumps against the monotonic clock (> 5 ms; t s, jump s): {clock_jumps or 'none'}; "
          f"kvmiss saw engine clocks go back {metric_sum(final, 'kvmiss_index_clock_steps_back_total'):,.0f} times")
    if args.stall_every_s > 0:
        print(f"{args.stall_target} frozen {len(stalls)} times for {args.stall_s:g} s, at (s): {[round(x) for x in stalls]}")
    if dump["wrong_examples"]:
        print("wrong examples:")
        for example in dump["wrong_examples"]:
            print("  ", json.dumps(example, default=str))
    print(f"kvmiss: spans received {final.get('kvmiss_spans_received_total', 0):,.0f}, exported "
          f"{final.get('kvmiss_spans_handed_to_export_total', 0):,.0f}, refused {final.get('kvmiss_spans_refused_total', 0):,.0f}; "
          f"stream gaps {metric_sum(final, 'kvmiss_stream_gaps_total'):,.0f}, quarantined "
          f"{metric_sum(final, 'kvmiss_stream_quarantined'):,.0f}; exit code {exit_code} after SIGTERM")
    ok = (not (lost or short or duplicated or unexpected) and delivered == acked and outcomes["wrong"] == 0
          and exit_code == 0 and rss_flat)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "argv": sys.argv, "started": started.isoformat(), "rss": rss, "latency_ms": {
                "p50": percentile(latency, 50) * 1e3, "p99": percentile(latency, 99) * 1e3},
            "outcomes": {k: v for k, v in detail.items()}, "fleet": fleet_stats, "clock_jumps": clock_jumps,
            "wrong_examples": dump["wrong_examples"],
            "backlog": backlog, "samples": samples}, indent=1, default=str))
    print("RESULT:", "PASS" if ok else "FAIL", f"(kvmiss log: {log_path})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
