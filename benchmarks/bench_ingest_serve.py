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

    .venv/bin/python benchmarks/bench_ingest_serve.py [--batches 200000] [--repeat 3] [--scrape-hz 0]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from bench_ingest import build_frames
from benchlib import free_port, process_cpu_s, rss_mb

_APPLIED = re.compile(rb"^kvmiss_index_batches_applied_total ([0-9.e+]+)$", re.M)
# kvmiss before f260867 has no index counter: the stream's (advanced on the collector thread)
_STREAM_APPLIED = re.compile(rb'^kvmiss_stream_batches_applied_total\{[^}]*\} ([0-9.e+]+)$', re.M)


def publisher_main(conn, endpoint: str, n_batches: int) -> None:
    import zmq

    frames, events = build_frames(n_batches)
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(endpoint)
    conn.send(("bound", events))
    if not pub.poll(60_000):
        conn.send(("error", "kvmiss never subscribed"))
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


def scraper(port: int, hz: float, stop: threading.Event, count: list[int]) -> None:
    while not stop.wait(1 / hz):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
            count[0] += 1
        except OSError:
            pass


def run_once(args) -> dict:
    ctx = multiprocessing.get_context("spawn")
    work = Path(tempfile.mkdtemp(prefix="kvmiss-bench-ingest-"))
    pub_port, http_port, metrics_port = free_port(), free_port(), free_port()
    parent, child = ctx.Pipe()
    pub = ctx.Process(target=publisher_main, args=(child, f"tcp://127.0.0.1:{pub_port}", args.batches), daemon=True)
    pub.start()
    kind, events = parent.recv()
    assert kind == "bound", events
    config = work / "kvmiss.toml"
    config.write_text(f'[otlp]\ngrpc = ""\nhttp = "127.0.0.1:{http_port}"\n[engine]\nblock_size = 16\n'
                      f'[privacy]\ndigest_key = "bench-ingest-serve-key-0001"\n'
                      f'[metrics]\nlisten = "127.0.0.1:{metrics_port}"\n'
                      f'[[workers]]\nid = "w0"\nendpoint = "tcp://127.0.0.1:{pub_port}"\n')
    log = open(work / "serve.log", "wb")
    serve = subprocess.Popen([args.kvmiss_python, "-m", "kvmiss.enricher.cli", "serve", "--config", str(config),
                              "--log-level", "WARNING"], stdout=log, stderr=log)
    stop, scrapes = threading.Event(), [0]
    try:
        for _ in range(300):
            try:
                scrape_applied(metrics_port)
                break
            except OSError:
                if serve.poll() is not None:
                    raise RuntimeError(f"kvmiss serve exited: {(work / 'serve.log').read_text()[-800:]}")
                time.sleep(0.1)
        time.sleep(0.5)  # the SUB connects and subscribes
        if args.scrape_hz:
            threading.Thread(target=scraper, args=(metrics_port, args.scrape_hz, stop, scrapes), daemon=True).start()
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
    return {"batches": args.batches, "events": events, "publisher_send_s": round(sent_s, 2),
            "applied_batches_s": round(batches_s), "applied_events_s": round(batches_s * per_batch),
            "kvmiss_cores": round((hi[2] - lo[2]) / (hi[0] - lo[0]), 2),
            "kvmiss_cpu_ms_per_1k_events": round(cpu_per_1k_events_ms, 3),
            "kvmiss_capacity_events_per_core_s": round(1e6 / cpu_per_1k_events_ms) if cpu_per_1k_events_ms else None,
            "kvmiss_python": args.kvmiss_python, "scrape_hz": args.scrape_hz, "scrapes": scrapes[0], "kvmiss_rss_mb": round(rss, 1)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--scrape-hz", type=float, default=0.0, help="scrape /metrics this often meanwhile")
    parser.add_argument("--sample-hz", type=float, default=10.0, help="how often the applied count is read")
    parser.add_argument("--timeout-s", type=float, default=120.0)
    parser.add_argument("--kvmiss-python", default=sys.executable,
                        help="run kvmiss serve with this interpreter (another venv: an A/B of two builds)")
    parser.add_argument("--py-spy", metavar="PATH", help="record kvmiss serve with this py-spy (collapsed stacks)")
    args = parser.parse_args(argv)
    print(f"kvmiss commit {_commit()}, {os.cpu_count()} cores", flush=True)
    for _ in range(args.repeat):
        print("RUN " + json.dumps(run_once(args)), flush=True)


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip() or "?"
    except OSError:
        return "?"


if __name__ == "__main__":
    main()
