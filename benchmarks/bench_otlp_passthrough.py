"""OTLP pass-through: what the receiver -> ExportQueue -> exporter path costs, with no enrichment.

This process runs kvmiss's side: `Receivers` (OTLP/HTTP protobuf only) -> a pass-through
consumer -> `ExportQueue` -> `HttpExporter` (gzip). A second process (spawned) runs the load
generator and the downstream sink, both on loopback:

    loadgen --POST gzip protobuf--> kvmiss :http --POST gzip protobuf--> sink (loadgen process)

Batches are 512 spans with 15 attributes each, pre-serialized and gzip'd before timing. Each
batch carries its number as a resource attribute, so the sink can tell when *that* batch came
out. Phases (all bounded by a batch count and a deadline):

1. direct, 1 in flight: loadgen -> sink with no kvmiss in between (baseline latency);
2. kvmiss, 1 in flight: latency through kvmiss at light load; added = (2) - (1);
3. kvmiss, N in flight: throughput at saturation, kvmiss CPU per span (from /proc, Linux),
   latency under load.

Usage: .venv/bin/python benchmarks/bench_otlp_passthrough.py [--batches 400] [--concurrency 4]
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import multiprocessing
import os
import platform
import random
import statistics
import sys
import time

from benchlib import percentile, process_cpu_s, start_sink

SPANS_PER_BATCH = 512


# --- the load generator and sink (child process) ----------------------------------------


def make_batch(batch_id: int, n_spans: int, rng: random.Random):
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    request = ExportTraceServiceRequest()
    resource_spans = request.resource_spans.add()
    for key, value in (("bench.batch", batch_id), ("service.name", "router"), ("service.instance.id", "router-7f9c"),
                       ("host.name", "gpu-node-12"), ("deployment.environment", "prod")):  # fmt: skip
        attr = resource_spans.resource.attributes.add(key=key)
        if isinstance(value, int):
            attr.value.int_value = value
        else:
            attr.value.string_value = value
    scope_spans = resource_spans.scope_spans.add()
    scope_spans.scope.name = "kvmiss.bench"
    t0 = 1_764_000_000_000_000_000
    for i in range(n_spans):
        span = scope_spans.spans.add(
            trace_id=rng.randbytes(16), span_id=rng.randbytes(8), parent_span_id=rng.randbytes(8),
            name="llm_request", kind=2, start_time_unix_nano=t0 + i * 1000, end_time_unix_nano=t0 + i * 1000 + 850_000_000,
        )  # fmt: skip
        span.status.code = 1
        attributes = {  # 15, the shape a router + engine span carries
            "gen_ai.request.id": f"cmpl-{batch_id:06d}-{i:04d}-{rng.getrandbits(48):012x}",
            "gen_ai.request.model": "meta-llama/Llama-3.1-8B-Instruct",
            "gen_ai.system": "vllm",
            "gen_ai.usage.prompt_tokens": rng.randrange(200, 8000),
            "gen_ai.usage.completion_tokens": rng.randrange(10, 800),
            "gen_ai.usage.cache_read.input_tokens": rng.randrange(0, 4000),
            "gen_ai.latency.time_in_queue": rng.random() / 10,
            "gen_ai.latency.time_to_first_token": rng.random(),
            "kvmiss.route.worker": f"worker-{rng.randrange(16)}",
            "kvmiss.route.dp_rank": rng.randrange(4),
            "kvmiss.route.policy": "prefix_aware",
            "kvmiss.route.predicted_cached_tokens": rng.randrange(0, 4000),
            "kvmiss.tenant_policy": "standard",
            "http.response.status_code": 200,
            "kvmiss.block_hashes": [rng.getrandbits(63) for _ in range(8)],
        }
        for key, value in attributes.items():
            v = span.attributes.add(key=key).value
            if isinstance(value, bool) or isinstance(value, str):
                v.string_value = str(value)
            elif isinstance(value, int):
                v.int_value = value
            elif isinstance(value, float):
                v.double_value = value
            else:
                v.array_value.values.extend([type(v)(int_value=x) for x in value])
    return request






async def loadgen(conn, args) -> None:
    import aiohttp
    from aiohttp import web
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
        ExportTraceServiceResponse,
    )

    arrived: dict[int, float] = {}
    waiting: dict[int, asyncio.Future] = {}  # paced phases: batch -> "it reached the sink"
    ok_body = ExportTraceServiceResponse().SerializeToString()

    async def sink(request: web.Request) -> web.Response:
        body = await request.read()  # aiohttp gunzips
        now = time.perf_counter()
        batch = ExportTraceServiceRequest.FromString(body).resource_spans[0].resource.attributes[0].value.int_value
        arrived[batch] = now
        if batch in waiting:
            waiting.pop(batch).set_result(None)
        return web.Response(body=ok_body, content_type="application/x-protobuf")

    runner, sink_port = await start_sink(sink)
    conn.send(("sink", sink_port))
    _, receiver_port = await asyncio.get_running_loop().run_in_executor(None, conn.recv)

    rng = random.Random(42)
    total = args.warmup + args.light + args.batches
    template = [make_batch(0, SPANS_PER_BATCH, rng) for _ in range(8)]  # 8 distinct span sets
    payloads, raw_bytes = {}, 0
    for b in range(total + args.light):
        request = template[b % len(template)]
        request.resource_spans[0].resource.attributes[0].value.int_value = b
        raw = request.SerializeToString()
        raw_bytes += len(raw)
        payloads[b] = gzip.compress(raw)
    gz_bytes = sum(len(p) for p in payloads.values())

    async def phase(url: str, ids: list[int], concurrency: int, paced: bool = False) -> dict:
        """Send ``ids`` with ``concurrency`` POSTs in flight; ``paced``: one batch in the whole
        system at a time (the next is sent once the previous reached the sink)."""
        sent, acked, statuses = {}, {}, {}
        queue = list(reversed(ids))
        deadline = time.perf_counter() + args.deadline_s
        headers = {"Content-Type": "application/x-protobuf", "Content-Encoding": "gzip"}

        async def worker(session):
            while queue and time.perf_counter() < deadline:
                b = queue.pop()
                if paced:
                    reached = waiting[b] = asyncio.get_running_loop().create_future()
                sent[b] = time.perf_counter()
                async with session.post(url, data=payloads[b], headers=headers) as response:
                    await response.read()
                    acked[b] = time.perf_counter()
                    statuses[response.status] = statuses.get(response.status, 0) + 1
                if paced:
                    await asyncio.wait_for(reached, args.deadline_s)

        cpu0, t0 = process_cpu_s(os.getppid()), time.perf_counter()
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
            await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        while not all(b in arrived for b in sent) and time.perf_counter() < deadline:
            await asyncio.sleep(0.001)
        elapsed = max(arrived.get(b, 0.0) for b in sent) - t0
        return {
            "batches": len(sent), "delivered": sum(b in arrived for b in sent), "statuses": statuses,
            "elapsed_s": elapsed, "kvmiss_cpu_s": process_cpu_s(os.getppid()) - cpu0,
            "e2e_ms": [(arrived[b] - sent[b]) * 1e3 for b in sent if b in arrived],
            "ack_ms": [(acked[b] - sent[b]) * 1e3 for b in acked],
        }  # fmt: skip

    direct = f"http://127.0.0.1:{sink_port}/v1/traces"
    via = f"http://127.0.0.1:{receiver_port}/v1/traces"
    ids = iter(range(total + args.light))
    take = lambda n: [next(ids) for _ in range(n)]  # noqa: E731
    results = {"raw_bytes_per_batch": raw_bytes / len(payloads), "gz_bytes_per_batch": gz_bytes / len(payloads)}
    results["direct_light"] = await phase(direct, take(args.light), 1, paced=True)
    await phase(via, take(args.warmup), args.concurrency)  # warm caches, connections, allocator
    results["via_light"] = await phase(via, take(args.light), 1, paced=True)
    results["via_saturated"] = await phase(via, take(args.batches), args.concurrency)
    conn.send(("results", results))
    await runner.cleanup()


def loadgen_main(conn, args) -> None:
    asyncio.run(loadgen(conn, args))


# --- kvmiss's side (this process) -------------------------------------------------------


def receive(conn, child):
    """The child's next message; exits if the child died (no silent hang)."""
    while not conn.poll(0.5):
        if not child.is_alive():
            sys.exit(f"load generator died (exit code {child.exitcode}); see its traceback above")
    return conn.recv()


async def kvmiss_side(args) -> None:
    from google.protobuf.internal import api_implementation

    from kvmiss.enricher.otlp.exporter import ExportQueue, HttpExporter
    from kvmiss.enricher.otlp.interfaces import ACCEPTED, ConsumeResult, EncodedRequest, Outcome, span_count
    from kvmiss.enricher.otlp.receiver import Receivers
    from kvmiss.schemas.config import OtlpConfig

    class PassThrough:
        def __init__(self, queue: ExportQueue) -> None:
            self.queue = queue

        async def consume(self, request, body=None, gzipped=None):
            n = span_count(request)
            if not self.queue.has_capacity(n):
                return ConsumeResult(Outcome.RETRYABLE, message="export queue full", retry_after_s=1.0)
            # As received: the bytes when the receiver kept them (as the pipeline hands on a
            # rewritten request), else the message (serialized by the exporter).
            self.queue.put(EncodedRequest(body, n) if body is not None else request, n)
            return ACCEPTED

    context = multiprocessing.get_context("spawn")
    parent_conn, child_conn = context.Pipe()
    child = context.Process(target=loadgen_main, args=(child_conn, args), daemon=True)
    child.start()
    loop = asyncio.get_running_loop()
    try:
        _, sink_port = await loop.run_in_executor(None, receive, parent_conn, child)
        queue = ExportQueue(HttpExporter(f"http://127.0.0.1:{sink_port}"))
        await queue.start()
        receivers = Receivers(OtlpConfig(grpc=None, http="127.0.0.1:0"), PassThrough(queue))
        await receivers.start()
        parent_conn.send(("receiver", receivers.http_port))
        _, results = await loop.run_in_executor(None, receive, parent_conn, child)
        await receivers.shutdown(2.0)
        await queue.shutdown(5.0)
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()

    import aiohttp
    import google.protobuf

    print(f"python {platform.python_version()} on {platform.machine()}, {os.cpu_count()} CPUs; protobuf "
          f"{google.protobuf.__version__} ({api_implementation.Type()}), aiohttp {aiohttp.__version__}")  # fmt: skip
    print(f"workload: {SPANS_PER_BATCH}-span batches, 15 attributes/span, "
          f"{results['raw_bytes_per_batch'] / 1024:.0f} KiB/batch protobuf, "
          f"{results['gz_bytes_per_batch'] / 1024:.0f} KiB gzip'd")  # fmt: skip
    for name, label in (("direct_light", "direct to sink, paced   "), ("via_light", "via kvmiss,     paced   "),
                        ("via_saturated", f"via kvmiss, {args.concurrency} in flight")):  # fmt: skip
        r = results[name]
        spans = r["delivered"] * SPANS_PER_BATCH
        e2e = r["e2e_ms"]
        line = (f"{label}: {r['delivered']}/{r['batches']} batches, {spans / r['elapsed_s']:>9,.0f} spans/s, "
                f"POST->sink p50 {statistics.median(e2e):6.2f} ms p99 {percentile(e2e, 99):6.2f} ms")  # fmt: skip
        if name != "direct_light":
            line += f", ack p50 {statistics.median(r['ack_ms']):.2f} ms, statuses {r['statuses']}"
            line += f", kvmiss CPU {r['kvmiss_cpu_s'] / spans * 1e6:.1f} us/span"
        print(line)
    base, light = results["direct_light"]["e2e_ms"], results["via_light"]["e2e_ms"]
    print(f"added latency, paced (one batch in the system): p50 {statistics.median(light) - statistics.median(base):.2f} ms "
          f"(via {statistics.median(light):.2f} - direct {statistics.median(base):.2f}); "
          f"p99 via {percentile(light, 99):.2f} ms vs direct {percentile(base, 99):.2f} ms")  # fmt: skip
    print(f"export queue: sent {queue.sent_spans:,} spans, failed {dict(queue.failed_spans)}, "
          f"dropped {dict(queue.dropped_spans)}, retries {queue.retries}")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, default=400, help="batches in the saturated phase")
    parser.add_argument("--light", type=int, default=100, help="batches in each 1-in-flight phase")
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight when saturating")
    parser.add_argument("--deadline-s", type=float, default=120.0, help="bound on each phase")
    args = parser.parse_args(argv)
    if not sys.platform.startswith("linux"):
        sys.exit("needs Linux (/proc) for the CPU figures")
    asyncio.run(kvmiss_side(args))


if __name__ == "__main__":
    main()
