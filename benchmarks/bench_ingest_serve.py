"""Whole-process ingest: how fast a real `kvmiss serve` applies one worker's KV events that
arrive over real ZeroMQ, and what that costs in CPU.

    publisher process                                   kvmiss serve (real subprocess)
      XPUB tcp://127.0.0.1:p (SNDHWM 0: nothing dropped) ---> SUB, collector thread -> index

The publisher builds ``--batches`` vLLM 0.33-format batches with bench_ingest.py's builder
(12 block events each: 4 BlockStored of 2 blocks with token ids, 8 BlockRemoved), waits
until kvmiss has subscribed, then sends them all as fast as it can; ZeroMQ queues what
kvmiss has not taken yet, so kvmiss runs flat out. Measured from kvmiss's own
``kvmiss_index_batches_applied_total`` (the index took the batch, not just the collector),
scraped every ``1/--sample-hz`` s: the applied rate between 10 % and 90 % of the batches, and
kvmiss's CPU over the same span (``/proc``: all its threads), as ms per 1,000 block events.
``--scrape-hz`` adds a Prometheus-like scraper of /metrics at that rate, to show what a
scrape costs while events flow. ``--repeat`` runs fresh processes each time.

``--target dynamo`` feeds the same publisher into NVIDIA Dynamo's standalone indexer instead
(benchmarks/dynamo_indexer.py: ``python -m dynamo.indexer`` from its own venv, ``--dynamo-python``),
timed by its own ``kv_cache_events_applied`` counter (events its radix tree took, by outcome)
and its process's CPU; ``--target both`` alternates fresh kvmiss and Dynamo runs, ``--repeat``
rounds of each. Every RUN line names its target; the CPU fields are prefixed by it. Dynamo's
tree refuses a store whose parent block it does not hold, so those targets default to
``--stream rooted``: bench_ingest's batch shape with every store a chain from the root and
evictions tail-first (as vLLM's free queue evicts); ``--stream bench`` is bench_ingest's own
stream (random parents, random victims), the default for kvmiss alone.

    .venv/bin/python benchmarks/bench_ingest_serve.py [--batches 200000] [--repeat 3] [--scrape-hz 0]
    .venv/bin/python benchmarks/bench_ingest_serve.py --target both [--dynamo-threads N]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import msgspec
from bench_ingest import REMOVALS_PER_BATCH, STORES_PER_BATCH, BlockRemoved, EventBatch, build_frames, stored_event
from benchlib import free_port, percentile, process_cpu_s, rss_mb
from dynamo_indexer import DynamoIndexer, default_python

_APPLIED = re.compile(rb"^kvmiss_index_batches_applied_total ([0-9.e+]+)$", re.M)
# kvmiss before f260867 has no index counter: the stream's (advanced on the collector thread)
_STREAM_APPLIED = re.compile(rb'^kvmiss_stream_batches_applied_total\{[^}]*\} ([0-9.e+]+)$', re.M)


def build_rooted_frames(n_batches: int, seed: int = 7, ts_step: float = 0.01) -> tuple[list[list[bytes]], int]:
    """bench_ingest.build_frames' batches (4 BlockStored of 2 blocks with token ids, 8 one-hash
    BlockRemoved, 64 blocks resident), but each store is a chain from the root (no parent) and an
    eviction takes a random chain's last block, so no block is removed before its child: every
    event applies to a radix tree that checks parents (Dynamo's)."""
    rng = random.Random(seed)
    chains: list[list[int]] = []
    resident, frames, events = 0, [], 0
    for seq in range(n_batches):
        batch_events = []
        for _ in range(STORES_PER_BATCH):
            batch_events.append(stored_event(rng, with_parent=False))
            hashes = batch_events[-1].block_hashes
            chains.append(list(hashes))  # popped below; the event keeps its own list
            resident += len(hashes)
        for _ in range(min(REMOVALS_PER_BATCH, resident - 64)):
            i = rng.randrange(len(chains))
            victim = chains[i].pop()
            if not chains[i]:
                chains[i] = chains[-1]
                chains.pop()
            resident -= 1
            batch_events.append(BlockRemoved(block_hashes=[victim], medium="GPU", group_idx=0))
        events += len(batch_events)
        payload = msgspec.msgpack.encode(EventBatch(ts=1e9 + seq * ts_step, events=batch_events, dp_rank=0))
        frames.append([b"kv@pod@model", seq.to_bytes(8, "big"), payload])
    return frames, events


def publisher_main(conn, endpoint: str, n_batches: int, stream: str = "bench", engine_rate: float = 100.0) -> None:
    import zmq

    frames, events = (build_rooted_frames if stream == "rooted" else build_frames)(n_batches, ts_step=1 / engine_rate)
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(endpoint)
    conn.send(("bound", events))
    if not pub.poll(60_000):
        conn.send(("error", "nobody subscribed"))
        return
    pub.recv()  # the subscription
    conn.recv()  # go
    t0 = time.monotonic()
    send = pub.send_multipart
    for f in frames:
        send(f, copy=False)
    conn.send(("sent", time.monotonic() - t0))
    conn.recv()  # done: close only once kvmiss has everything
    pub.close()
    ctx.term()


def scrape_applied(port: int) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    m = _APPLIED.search(body)
    if m:
        return float(m.group(1))
    return sum(float(v) for v in _STREAM_APPLIED.findall(body))


def scraper(port: int, hz: float, stop: threading.Event, count: list[int], path: str = "/metrics",
            latencies: list[float] | None = None) -> None:
    """GET ``path`` every 1/hz s (sequentially: a slow answer delays the next)."""
    while not stop.wait(1 / hz):
        try:
            t0 = time.monotonic()
            urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10).read()
            count[0] += 1
            if latencies is not None:
                latencies.append(time.monotonic() - t0)

        except OSError:
            pass


def start_publisher(args, port: int):
    """The publisher process, bound on ``port`` with its batches built: (process, its end of
    the pipe, block events it will send)."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    pub = ctx.Process(target=publisher_main, args=(child, f"tcp://127.0.0.1:{port}", args.batches, args.stream,
                                                   args.engine_rate), daemon=True)
    pub.start()
    kind, events = parent.recv()
    assert kind == "bound", events
    return pub, parent, events


def run_once(args, target: str = "kvmiss") -> dict:
    if target == "dynamo":
        return run_once_dynamo(args)
    work = Path(tempfile.mkdtemp(prefix="kvmiss-bench-ingest-"))
    pub_port, http_port, metrics_port = free_port(), free_port(), free_port()
    pub, parent, events = start_publisher(args, pub_port)
    config = work / "kvmiss.toml"
    config.write_text(f'[otlp]\ngrpc = ""\nhttp = "127.0.0.1:{http_port}"\n[engine]\nblock_size = 16\n'
                      f'[privacy]\ndigest_key = "bench-ingest-serve-key-0001"\n'
                      f'[metrics]\nlisten = "127.0.0.1:{metrics_port}"\n'
                      f'[history]\nretention_s = {args.retention_s}\n'
                      f'[[workers]]\nid = "w0"\nendpoint = "tcp://127.0.0.1:{pub_port}"\n')
    log = open(work / "serve.log", "wb")
    serve = subprocess.Popen([args.kvmiss_python, "-m", "kvmiss.enricher.cli", "serve", "--config", str(config),
                              "--log-level", "WARNING"], stdout=log, stderr=log)
    stop, scrapes, scrape_s = threading.Event(), [0], []
    try:
        for _ in range(300):
            try:
                scrape_applied(metrics_port)
                break
            except OSError:
                if serve.poll() is not None:
                    raise RuntimeError(f"kvmiss serve exited: {(work / 'serve.log').read_text()[-800:]}")  # noqa: B904
                time.sleep(0.1)
        time.sleep(0.5)  # the SUB connects and subscribes
        if args.scrape_hz:
            threading.Thread(target=scraper, args=(metrics_port, args.scrape_hz, stop, scrapes, args.scrape_path,
                                                   scrape_s), daemon=True).start()
        spy = None
        if args.py_spy:
            spy = subprocess.Popen([args.py_spy, "record", "--pid", str(serve.pid), "--format", "raw", "--threads",
                                    "--rate", "250", "--nonblocking", "-o", str(work / "serve.collapsed")],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1)
        samples = []  # (monotonic, applied, kvmiss cpu s)
        parent.send("go")
        deadline = time.monotonic() + args.timeout_s
        while True:
            t, cpu = time.monotonic(), process_cpu_s(serve.pid)
            applied = scrape_applied(metrics_port)
            samples.append((t, applied, cpu))
            if applied >= args.batches or time.monotonic() > deadline or serve.poll() is not None:
                break
            time.sleep(1 / args.sample_hz)
        sent_s = parent.recv()[1] if parent.poll(5) else float("nan")
        parent.send("done")
        rss = rss_mb(serve.pid)
        if spy is not None:
            spy.send_signal(2)
            spy.wait(30)
            print(f"py-spy collapsed stacks: {work / 'serve.collapsed'}", flush=True)
    finally:
        stop.set()
        serve.terminate()
        try:
            serve.wait(10)
        except subprocess.TimeoutExpired:
            serve.kill()
        pub.join(5)
        if pub.is_alive():
            pub.kill()
    if samples[-1][1] < args.batches:
        raise RuntimeError(f"kvmiss applied {samples[-1][1]:.0f} of {args.batches} batches "
                           f"in {args.timeout_s} s; {(work / 'serve.log').read_text()[-800:]}")
    lo = next(s for s in samples if s[1] >= 0.1 * args.batches)
    hi = next(s for s in samples if s[1] >= 0.9 * args.batches)
    per_batch = events / args.batches
    batches_s = (hi[1] - lo[1]) / (hi[0] - lo[0])
    cpu_per_1k_events_ms = (hi[2] - lo[2]) / ((hi[1] - lo[1]) * per_batch) * 1e6
    return {"target": "kvmiss", "stream": args.stream, "engine_rate": args.engine_rate, "retention_s": args.retention_s, "batches": args.batches, "events": events,
            "publisher_send_s": round(sent_s, 2),
            "applied_batches_s": round(batches_s), "applied_events_s": round(batches_s * per_batch),
            "kvmiss_cores": round((hi[2] - lo[2]) / (hi[0] - lo[0]), 2),
            "kvmiss_cpu_ms_per_1k_events": round(cpu_per_1k_events_ms, 3),
            "kvmiss_capacity_events_per_core_s": round(1e6 / cpu_per_1k_events_ms) if cpu_per_1k_events_ms else None,
            "kvmiss_python": args.kvmiss_python, "scrape_hz": args.scrape_hz, "scrape_path": args.scrape_path,
            "scrapes": scrapes[0], "scrape_ms_p50": round(percentile(scrape_s, 50) * 1e3, 2) if scrape_s else None,
            "scrape_ms_max": round(max(scrape_s) * 1e3, 2) if scrape_s else None, "kvmiss_rss_mb": round(rss, 1)}


def run_once_dynamo(args) -> dict:
    """run_once's publisher and measurement, with Dynamo's standalone indexer as the consumer.
    Its counter is in events (not batches): the span is 10 % to 90 % of the events."""
    work = Path(tempfile.mkdtemp(prefix="kvmiss-bench-ingest-dynamo-"))
    pub_port = free_port()
    pub, parent, events = start_publisher(args, pub_port)
    dyn = DynamoIndexer(f"tcp://127.0.0.1:{pub_port}", python=args.dynamo_python, block_size=16,
                        threads=args.dynamo_threads, log_path=work / "dynamo.log")
    stop, scrapes = threading.Event(), [0]
    try:
        dyn.wait_ready()
        time.sleep(0.5)  # as for kvmiss
        if args.scrape_hz:
            threading.Thread(target=scraper, args=(dyn.port, args.scrape_hz, stop, scrapes), daemon=True).start()
        samples = []  # (monotonic, events applied, dynamo cpu s)
        parent.send("go")
        deadline = time.monotonic() + args.timeout_s
        while True:
            t, cpu = time.monotonic(), process_cpu_s(dyn.pid)
            applied = dyn.applied()
            samples.append((t, applied, cpu))
            if applied >= events or time.monotonic() > deadline or dyn.proc.poll() is not None:
                break
            time.sleep(1 / args.sample_hz)
        sent_s = parent.recv()[1] if parent.poll(5) else float("nan")
        parent.send("done")
        rss = rss_mb(dyn.pid)
        counts, threads = dyn.counts(), dyn.threads()
    finally:
        stop.set()
        dyn.stop()
        pub.join(5)
        if pub.is_alive():
            pub.kill()
    if samples[-1][1] < events:
        raise RuntimeError(f"dynamo.indexer took {samples[-1][1]} of {events} events in {args.timeout_s} s; "
                           f"{dyn.log_tail()}")
    lo = next(s for s in samples if s[1] >= 0.1 * events)
    hi = next(s for s in samples if s[1] >= 0.9 * events)
    per_batch = events / args.batches
    events_s = (hi[1] - lo[1]) / (hi[0] - lo[0])
    cpu_per_1k_events_ms = (hi[2] - lo[2]) / (hi[1] - lo[1]) * 1e6
    ok = sum(n for (_, status), n in counts.items() if status == "ok")
    return {"target": "dynamo", "stream": args.stream, "batches": args.batches, "events": events,
            "publisher_send_s": round(sent_s, 2),
            "applied_batches_s": round(events_s / per_batch), "applied_events_s": round(events_s),
            "dynamo_cores": round((hi[2] - lo[2]) / (hi[0] - lo[0]), 2),
            "dynamo_cpu_ms_per_1k_events": round(cpu_per_1k_events_ms, 3),
            "dynamo_capacity_events_per_core_s": round(1e6 / cpu_per_1k_events_ms) if cpu_per_1k_events_ms else None,
            "dynamo_events_ok": ok, "dynamo_events_refused": sum(counts.values()) - ok,
            "dynamo_threads": threads, "dynamo_python": dyn.python,
            "scrape_hz": args.scrape_hz, "scrapes": scrapes[0], "dynamo_rss_mb": round(rss, 1)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--engine-rate", type=float, default=100.0,
                        help="batches per second of engine time in the batches' ts (default 100). Set it near "
                             "the send rate, with a short --retention-s, for the steady state: retention prunes "
                             "what closed a retention ago, as on a live engine")
    parser.add_argument("--retention-s", type=float, default=600.0, help="kvmiss [history] retention_s")
    parser.add_argument("--scrape-path", default="/metrics", help="what the scraper GETs (/healthz: a cheap answer)")
    parser.add_argument("--scrape-hz", type=float, default=0.0, help="scrape /metrics this often meanwhile")
    parser.add_argument("--sample-hz", type=float, default=10.0, help="how often the applied count is read")
    parser.add_argument("--timeout-s", type=float, default=120.0)
    parser.add_argument("--kvmiss-python", default=sys.executable,
                        help="run kvmiss serve with this interpreter (another venv: an A/B of two builds)")
    parser.add_argument("--py-spy", metavar="PATH", help="record kvmiss serve with this py-spy (collapsed stacks)")
    parser.add_argument("--target", choices=("kvmiss", "dynamo", "both"), default="kvmiss",
                        help="the consumer: kvmiss serve, Dynamo's standalone indexer, or both alternately")
    parser.add_argument("--stream", choices=("bench", "rooted"),
                        help="bench_ingest's stream, or one whose every event Dynamo's tree applies "
                             "(default: bench for --target kvmiss, else rooted)")
    parser.add_argument("--dynamo-python", default=default_python(),
                        help="the interpreter of the venv with ai-dynamo-runtime (default: $DYNAMO_PYTHON, "
                             "else dynamo-venv/bin/python beside the repository)")
    parser.add_argument("--dynamo-threads", type=int, help="dynamo.indexer --threads (default: its own, 4)")
    args = parser.parse_args(argv)
    args.stream = args.stream or ("bench" if args.target == "kvmiss" else "rooted")
    targets = ["kvmiss", "dynamo"] if args.target == "both" else [args.target]
    dynamo = f", dynamo {_dynamo_version(args.dynamo_python)}" if "dynamo" in targets else ""
    print(f"kvmiss commit {_commit()}, {os.cpu_count()} cores{dynamo}", flush=True)
    for _ in range(args.repeat):
        for target in targets:
            print("RUN " + json.dumps(run_once(args, target)), flush=True)


def _dynamo_version(python: str) -> str:
    try:
        return subprocess.run([python, "-c", "import importlib.metadata as m; print('ai-dynamo-runtime', "
                               "m.version('ai-dynamo-runtime'))"], capture_output=True, text=True,
                              timeout=60).stdout.strip() or "?"
    except OSError:
        return "?"


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip() or "?"
    except OSError:
        return "?"


if __name__ == "__main__":
    main()
