"""Ingest ceiling: how many workers one `kvmiss serve` replica follows, over real ZeroMQ.

    publisher processes (--publishers, default 2)        kvmiss serve (real subprocess)
      worker i: XPUB tcp://127.0.0.1:p_i  ---live--->    SUB per worker, collector thread
                ROUTER tcp://127.0.0.1:r_i <--replay-->  DEALER per replay / tail probe
                                                         /metrics  <--- scraped 1/s by this script

Every point starts fresh: N workers spread round-robin over the publisher processes, one
XPUB (SNDHWM 100,000, vLLM's default) and, unless ``--no-replay``, one replay ROUTER per
worker with a ring of the last ``--ring-s`` seconds of batches (answers vLLM >= 0.26 style:
``[id, b"", topic, seq, payload]`` ... end marker). kvmiss gets a config in a temp dir
(``grpc = ""``, an OTLP/HTTP port that nobody posts to, a metrics port, the N workers with
their replay endpoints, no ``[export]``). Once kvmiss has subscribed to every XPUB, each
worker publishes from seq 0 at the profile's rate, phases staggered evenly over the period,
vLLM 0.33-format batches built with kvmiss's own msgspec Structs (`kvmiss.schemas.events`):

  removals first (one BlockRemoved per hash, as vLLM emits them, of the blocks this worker
  stored ``resident/blocks`` batches ago: a bounded resident set), then one BlockStored of
  ``blocks`` new hashes with parent link, 16-token blocks and their token ids, medium GPU,
  group 0, ``full_attention``, ``extra_keys`` -- so in steady state a batch touches
  2 x ``blocks`` block hashes in 1 + ``blocks`` events.

Before the rated run each worker first publishes ``--populate`` resident blocks (default
16,384, about a GPU's worth for an 8B model; 64-block BlockStored batches, never removed) as
fast as the publishers go, so the residency table has a realistic size; how long kvmiss took
to apply that burst is reported too (``population_*``: a burst ingest rate, bounded by the
publishers as well as by kvmiss).

Profiles (``--profile``):
  prefill  2 batches/s/worker, 64 blocks stored + 64 removed per batch (few, big batches)
  step     50 batches/s/worker, 2 blocks stored + 2 removed per batch (many small batches)
``--rate`` / ``--blocks`` override the chosen profile's numbers.

Measured per point, after ``--warmup-s`` (the removals reach steady state), over
``--window-s`` with a scrape every second:
  * published batches/s (the publishers' shared counters) vs applied batches/s
    (``kvmiss_stream_batches_applied_total``, summed over workers), and the backlog
    (published - applied) at the window's start and end;
  * ``kvmiss_stream_gaps_total`` growth (publisher HWM drops or lost frames);
  * ``kvmiss_stream_receive_lag_seconds``: median and max over workers each second; its
    growth over the window (least-squares slope of the median);
  * CPU (cores busy) of kvmiss serve, of the publishers and of the machine (busy, steal);
    kvmiss RSS at the window's start and end;
  * then the publishers stop and kvmiss gets ``--drain-s`` to apply everything published.
A point KEEPS UP when applied >= 99 % of published over the window (or the backlog grew by
no more than one batch per worker: batches in flight), no gap opened, the median lag grew by
< 10 ms/s, the largest lag at the end is < 1 s, and everything published was applied in the
drain. The ceiling is the largest N that kept up. A kvmiss that stops applying (its
collector thread died: past ~224 workers with replay endpoints, pyzmq's default of 1,023
sockets per context runs out; docs/SCALING.md) fails the point, within 20 s if it happens
while the population is applied, with serve.log's last line. Note: the applied counter is
advanced on kvmiss's collector thread; the index itself applies the batches on the event
loop every 20 ms (no metric shows that hand-over's depth: RSS growth would).

Usage (from the repository root):
    .venv/bin/python benchmarks/bench_ceiling.py                     # both profiles, 8..128 workers
    .venv/bin/python benchmarks/bench_ceiling.py --profile step --workers 8,16,32,64,128,256
    .venv/bin/python benchmarks/bench_ceiling.py --extend --bisect 2  # double N past 128 until a
                                                                       # point fails, then bisect
    .venv/bin/python benchmarks/bench_ceiling.py --profile step --workers 128 --rates 50,100,200,400 --stop-at-fail
                                                    # N fixed at 128, the per-worker rate stepped
    .venv/bin/python benchmarks/bench_ceiling.py --workers 4 --window-s 3 --warmup-s 1   # smoke
Prints one JSON line per point (prefix ``POINT ``) as it goes, then a table per profile.
"""

from __future__ import annotations

import argparse
import collections
import heapq
import json
import multiprocessing
import os
import platform
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import free_port, machine_cpu_s, process_cpu_s, rss_mb  # noqa: E402

PROFILES = {
    "prefill": {"rate": 2.0, "blocks": 64, "what": "decode/prefill-heavy: few batches, many blocks"},
    "step": {"rate": 50.0, "blocks": 2, "what": "step-heavy: many small batches"},
}
BLOCK = 16
RESIDENT_BLOCKS = 256  # per worker: beyond it every stored batch's blocks are removed later
SNDHWM = 100_000  # vLLM's ZmqEventPublisher default send high-water mark
ROUTER_CHECK_S = 0.005  # how often a publisher process answers replay requests
END_SEQ = b"\xff" * 8

# --- publishers (child processes) ----------------------------------------------------------


def publishers_main(conn, workers: list[tuple[int, str, str | None]], rate: float, blocks: int,
                    n_total: int, ring_s: float, counters, slot: int) -> None:
    """Host ``workers`` (global index, XPUB endpoint, ROUTER endpoint or None) in this process.
    ``counters[2*slot]`` / ``[2*slot+1]``: batches / block hashes published so far."""
    import msgspec
    import zmq

    from kvmiss.schemas.events import BlockRemoved, BlockStored, EventBatch

    encode = msgspec.msgpack.Encoder().encode
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, 4 * len(workers) + 64)
    rng = random.Random(1000 + slot)
    tokens = msgspec.Raw(msgspec.msgpack.encode([rng.randrange(150_000) for _ in range(BLOCK * blocks)]))
    extra = [None] * blocks
    pop_tokens = msgspec.Raw(msgspec.msgpack.encode([rng.randrange(150_000) for _ in range(BLOCK * 64)]))
    pop_extra = [None] * 64
    keep = max(1, RESIDENT_BLOCKS // blocks)  # batches whose blocks stay resident
    ring_len = max(64, int(rate * ring_s))
    pubs, routers, topics, seqs, stored, rings, parents = [], [], [], [], [], [], []
    for w, pub_ep, replay_ep in workers:
        s = ctx.socket(zmq.XPUB)
        s.setsockopt(zmq.SNDHWM, SNDHWM)
        s.setsockopt(zmq.XPUB_VERBOSE, 1)
        s.setsockopt(zmq.LINGER, 0)
        s.bind(pub_ep)
        pubs.append(s)
        r = None
        if replay_ep is not None:
            r = ctx.socket(zmq.ROUTER)
            r.setsockopt(zmq.LINGER, 0)
            r.bind(replay_ep)
        routers.append(r)
        topics.append(f"kv@w{w}@bench".encode())
        seqs.append(0)
        stored.append(collections.deque())
        rings.append(collections.deque(maxlen=ring_len))  # (seq, payload), seq ascending
        parents.append(None)
    live_routers = [(i, r) for i, r in enumerate(routers) if r is not None]
    poller = zmq.Poller()
    for _, r in live_routers:
        poller.register(r, zmq.POLLIN)
    router_index = {r: i for i, r in live_routers}

    def answer_replays(timeout_ms: float) -> None:
        if not live_routers:
            if timeout_ms > 0:
                time.sleep(timeout_ms / 1000)
            return
        for r, _ in poller.poll(timeout_ms):
            i = router_index[r]
            while True:
                try:
                    frames = r.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                    continue  # vLLM logs and ignores anything else
                ident, start = frames[0], int.from_bytes(frames[2], "big")
                ring = rings[i]
                if ring:
                    first = ring[0][0]
                    for k in range(max(0, start - first), len(ring)):
                        seq, payload = ring[k]
                        r.send_multipart([ident, b"", topics[i], seq.to_bytes(8, "big"), payload])
                r.send_multipart([ident, b"", b"", END_SEQ, b""])

    conn.send(("bound",))
    # Until kvmiss has subscribed to every XPUB (it may ask for replay meanwhile: answer).
    waiting = set(range(len(pubs)))
    deadline = time.monotonic() + 60
    while waiting:
        if time.monotonic() > deadline:
            conn.send(("error", f"kvmiss never subscribed to {len(waiting)} workers"))
            return
        for i in list(waiting):
            if pubs[i].poll(0):
                pubs[i].recv()
                waiting.discard(i)
        answer_replays(5)
    conn.send(("subscribed",))
    batches = hashes = 0
    msg = conn.recv()
    if msg[0] == "populate":  # a resident background per worker, never removed: a full-size table
        steps = msg[1] // 64
        for step in range(steps):
            for i in range(len(pubs)):
                new = [rng.getrandbits(64) for _ in range(64)]
                payload = encode(EventBatch(ts=time.time(), events=[BlockStored(
                    block_hashes=new, parent_block_hash=None, token_ids=pop_tokens, block_size=BLOCK, medium="GPU",
                    group_idx=0, kv_cache_spec_kind="full_attention", extra_keys=pop_extra)], dp_rank=0))
                pubs[i].send_multipart([topics[i], seqs[i].to_bytes(8, "big"), payload], copy=False)
                if routers[i] is not None:
                    rings[i].append((seqs[i], payload))
                seqs[i] += 1
                batches += 1
                hashes += 64
            if step % 8 == 7:
                answer_replays(1)  # an engine publishes per step; let the collector keep pace
            counters[2 * slot], counters[2 * slot + 1] = batches, hashes
        conn.send(("populated", batches))
        msg = conn.recv()
    if msg[0] != "go":
        return
    t0 = msg[1]
    period = 1.0 / rate
    heap = [(t0 + (w / n_total) * period, i) for i, (w, _, _) in enumerate(workers)]
    heapq.heapify(heap)
    late = 0
    next_router = time.time()
    while not conn.poll(0):
        now = time.time()
        while heap and heap[0][0] <= now:
            due, i = heapq.heappop(heap)
            events = []
            if len(stored[i]) >= keep:
                events += [BlockRemoved(block_hashes=[x], medium="GPU", group_idx=0) for x in stored[i].popleft()]
            new = [rng.getrandbits(64) for _ in range(blocks)]
            events.append(BlockStored(block_hashes=new, parent_block_hash=parents[i], token_ids=tokens,
                                      block_size=BLOCK, medium="GPU", group_idx=0,
                                      kv_cache_spec_kind="full_attention", extra_keys=extra))
            stored[i].append(new)
            parents[i] = new[-1]
            payload = encode(EventBatch(ts=time.time(), events=events, dp_rank=0))
            seq = seqs[i]
            pubs[i].send_multipart([topics[i], seq.to_bytes(8, "big"), payload], copy=False)
            if routers[i] is not None:
                rings[i].append((seq, payload))
            seqs[i] = seq + 1
            batches += 1
            hashes += len(new) + len(events) - 1
            counters[2 * slot], counters[2 * slot + 1] = batches, hashes
            due += period
            if due < now - 0.5:  # starved: drop the schedule rather than burst to catch up
                late += 1
                due = now
            heapq.heappush(heap, (due, i))
        now = time.time()
        if now >= next_router:
            answer_replays(0)
            next_router = now + ROUTER_CHECK_S
        sleep = min(heap[0][0] if heap else now + 0.01, next_router) - time.time()
        if sleep > 0:
            time.sleep(sleep)
    conn.recv()
    conn.send(("stopped", batches, hashes, late, list(seqs)))
    for s in pubs + [r for r in routers if r is not None]:
        s.close(linger=0)
    ctx.term()


# --- kvmiss's /metrics ---------------------------------------------------------------------

_LINE = re.compile(r'^(kvmiss_stream_(?:batches_applied_total|gaps_total|receive_lag_seconds|quarantined|replays_requested_total|tail_probes_total))\{worker="([^"]*)"\} (\S+)$', re.M)


def scrape(port: int) -> dict[str, dict[str, float]]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[str, dict[str, float]] = collections.defaultdict(dict)
    for name, worker, value in _LINE.findall(text):
        out[name][worker] = float(value)
    return out


def stream_totals(port: int) -> str:
    """Every nonzero kvmiss_stream_* counter summed over workers: why a point stalled."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    sums: dict[str, float] = collections.defaultdict(float)
    for name, value in re.findall(r'^(kvmiss_stream_\w+_total)\{[^}]*\} (\S+)$', text, re.M):
        sums[name] += float(value)
    return "; stream counters: " + ", ".join(f"{k[14:-6]}={v:.0f}" for k, v in sorted(sums.items()) if v)


def total(m: dict, name: str) -> float:
    return sum(m.get(name, {}).values())


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def slope(ts: list[float], ys: list[float]) -> float:
    pts = [(t, y) for t, y in zip(ts, ys) if y == y]
    if len(pts) < 2:
        return float("nan")
    mt = sum(t for t, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    den = sum((t - mt) ** 2 for t, _ in pts)
    return sum((t - mt) * (y - my) for t, y in pts) / den if den else float("nan")


# --- one point -----------------------------------------------------------------------------


def receive(conn, child, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while not conn.poll(0.2):
        if not child.is_alive():
            raise RuntimeError(f"{child.name} died (exit code {child.exitcode})")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{child.name} sent nothing for {timeout:.0f} s")
    return conn.recv()


def serve_log_tail(work: Path) -> str:
    """The last line of kvmiss serve's log when it holds a traceback (e.g. its collector
    thread died: ZeroMQ's default limit of 1023 sockets per context)."""
    try:
        text = (work / "serve.log").read_text(errors="replace")
    except OSError:
        return ""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return f"; serve.log: {lines[-1].strip()}" if lines and "Traceback" in text else ""


def run_point(profile: str, n: int, args, rate: float | None = None) -> dict:
    rate = rate or args.rate or PROFILES[profile]["rate"]
    blocks = args.blocks or PROFILES[profile]["blocks"]
    ctx = multiprocessing.get_context("spawn")
    work = Path(tempfile.mkdtemp(prefix="kvmiss-bench-ceiling-"))
    used: set[int] = set()

    def port() -> int:
        while True:
            p = free_port()
            if p not in used:
                used.add(p)
                return p

    specs = [(w, f"tcp://127.0.0.1:{port()}", None if args.no_replay else f"tcp://127.0.0.1:{port()}")
             for w in range(n)]
    nproc = max(1, min(args.publishers, n))
    counters = ctx.RawArray("q", 2 * nproc)
    pubs, conns, serve = [], [], None
    try:
        for k in range(nproc):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=publishers_main, name=f"publishers-{k}", daemon=True,
                            args=(child, specs[k::nproc], rate, blocks, n, args.ring_s, counters, k))
            p.start()
            pubs.append(p)
            conns.append(parent)
        for c, p in zip(conns, pubs):
            msg = receive(c, p)
            if msg[0] != "bound":
                raise RuntimeError(f"{p.name}: {msg}")
        metrics_port, http_port = port(), port()
        workers = "".join(f'[[workers]]\nid = "w{w}"\nendpoint = "{ep}"\n'
                          + (f'replay_endpoint = "{rep}"\n' if rep else "") for w, ep, rep in specs)
        config = work / "kvmiss.toml"
        config.write_text(f'[otlp]\ngrpc = ""\nhttp = "127.0.0.1:{http_port}"\n[engine]\nblock_size = {BLOCK}\n'
                          f'[privacy]\ndigest_key = "bench-ceiling-digest-key-0001"\n'
                          f'[metrics]\nlisten = "127.0.0.1:{metrics_port}"\n{workers}')
        log = open(work / "serve.log", "wb")
        serve = subprocess.Popen([sys.executable, "-m", "kvmiss.enricher.cli", "serve", "--config", str(config),
                                  "--log-level", "WARNING"], stderr=log, stdout=log)
        for c, p in zip(conns, pubs):
            deadline = time.monotonic() + 90
            while not c.poll(0.2):
                if serve.poll() is not None:
                    raise RuntimeError(f"kvmiss serve exited {serve.returncode}: "
                                       f"{(work / 'serve.log').read_text()[-600:].strip()}")
                if not p.is_alive() or time.monotonic() > deadline:
                    raise RuntimeError(f"{p.name} never saw kvmiss subscribe")
            msg = c.recv()
            if msg[0] != "subscribed":
                raise RuntimeError(f"{p.name}: {msg}")
        for _ in range(200):
            try:
                scrape(metrics_port)
                break
            except OSError:
                if serve.poll() is not None:
                    raise RuntimeError(f"kvmiss serve exited {serve.returncode}: {(work / 'serve.log').read_text()[-2000:]}")  # noqa: B904
                time.sleep(0.1)
        population = {}
        if args.populate >= 64:
            t_pop = time.monotonic()
            for c in conns:
                c.send(("populate", args.populate))
            pop_batches = sum(receive(c, p, timeout=300)[1] for c, p in zip(conns, pubs))
            t_sent = time.monotonic()
            seen, t_seen = -1.0, time.monotonic()
            while (applied := total(scrape(metrics_port), "kvmiss_stream_batches_applied_total")) < pop_batches:
                if applied > seen:
                    seen, t_seen = applied, time.monotonic()
                if time.monotonic() - t_seen > 20 or time.monotonic() - t_pop > 300 or serve.poll() is not None:
                    raise RuntimeError(f"kvmiss applied {applied:.0f} of {pop_batches} population batches and then "
                                       "no more for 20 s" + stream_totals(metrics_port) + serve_log_tail(work))
                time.sleep(0.05)
            t_applied = time.monotonic()
            population = {"population_blocks_per_worker": pop_batches * 64 // n, "population_batches": pop_batches,
                          "population_publish_s": round(t_sent - t_pop, 2),
                          "population_apply_s": round(t_applied - t_pop, 2),
                          "population_batches_s": round(pop_batches / (t_applied - t_pop), 0),
                          "population_blocks_s": round(pop_batches * 64 / (t_applied - t_pop), 0),
                          "kvmiss_rss_mb_populated": round(rss_mb(serve.pid), 1)}
        t_go = time.time() + 0.2
        for c in conns:
            c.send(("go", t_go))
        time.sleep(0.2 + args.warmup_s)

        pub_pids = [p.pid for p in pubs]

        def sample() -> dict:
            published = sum(counters[2 * k] for k in range(nproc))
            hashes = sum(counters[2 * k + 1] for k in range(nproc))
            t = time.monotonic()
            m = scrape(metrics_port)
            lags = list(m.get("kvmiss_stream_receive_lag_seconds", {}).values())
            return {"t": t, "published": published, "hashes": hashes,
                    "applied": total(m, "kvmiss_stream_batches_applied_total"),
                    "gaps": total(m, "kvmiss_stream_gaps_total"),
                    "quarantined": total(m, "kvmiss_stream_quarantined"),
                    "replays": total(m, "kvmiss_stream_replays_requested_total"),
                    "probes": total(m, "kvmiss_stream_tail_probes_total"),
                    "lag_med": median(lags), "lag_max": max(lags, default=float("nan")),
                    "lag_workers": len(lags)}

        cpu0 = {"kvmiss": process_cpu_s(serve.pid), "publishers": sum(process_cpu_s(p) for p in pub_pids),
                "bench": process_cpu_s(os.getpid())}
        mach0 = machine_cpu_s()
        rss0 = rss_mb(serve.pid)
        samples = [sample()]
        t_end = samples[0]["t"] + args.window_s
        while time.monotonic() < t_end:
            time.sleep(max(0.0, min(1.0, t_end - time.monotonic())))
            samples.append(sample())
        first, last = samples[0], samples[-1]
        dt = last["t"] - first["t"]
        cpu = {"kvmiss": process_cpu_s(serve.pid) - cpu0["kvmiss"],
               "publishers": sum(process_cpu_s(p) for p in pub_pids) - cpu0["publishers"],
               "bench": process_cpu_s(os.getpid()) - cpu0["bench"]}
        mach = {k: v - mach0[k] for k, v in machine_cpu_s().items()}
        rss1 = rss_mb(serve.pid)

        for c in conns:  # stop publishing; then let kvmiss apply what is in flight
            c.send(("stop",))
        finals = [receive(c, p, timeout=30) for c, p in zip(conns, pubs)]
        published_total = sum(f[1] for f in finals)
        late = sum(f[3] for f in finals)
        t_drain = time.monotonic()
        applied_total = total(scrape(metrics_port), "kvmiss_stream_batches_applied_total")
        while applied_total < published_total and time.monotonic() - t_drain < args.drain_s:
            time.sleep(0.25)
            applied_total = total(scrape(metrics_port), "kvmiss_stream_batches_applied_total")
        drain_s = time.monotonic() - t_drain
        print(f"  after the drain: {applied_total:.0f} of {published_total} applied"
              + stream_totals(metrics_port), file=sys.stderr, flush=True)
    finally:
        if serve is not None and serve.poll() is None:
            serve.terminate()
            try:
                serve.wait(20)
            except subprocess.TimeoutExpired:
                serve.kill()
        for p in pubs:
            p.join(5)
            if p.is_alive():
                p.kill()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    pub_b = last["published"] - first["published"]
    app_b = last["applied"] - first["applied"]
    pub_h = last["hashes"] - first["hashes"]
    backlog0 = first["published"] - first["applied"]
    backlog1 = last["published"] - last["applied"]
    ratio = app_b / pub_b if pub_b else float("nan")
    lag_slope = slope([s["t"] for s in samples], [s["lag_med"] for s in samples])
    target = n * rate
    result = {
        "profile": profile, "workers": n, "rate_per_worker": rate, "blocks_per_batch": blocks,
        "block_hashes_per_batch": 2 * blocks, "events_per_batch": 1 + blocks, "replay": not args.no_replay,
        "publishers": nproc, "window_s": round(dt, 2),
        "target_batches_s": target, "published_batches_s": round(pub_b / dt, 1),
        "applied_batches_s": round(app_b / dt, 1), "applied_ratio": round(ratio, 4),
        "published_block_events_s": round(pub_h / dt, 0),
        "applied_block_events_s": round(pub_h / dt * (ratio if ratio == ratio else 0), 0),
        "backlog_start": backlog0, "backlog_end": backlog1,
        "gaps": last["gaps"] - first["gaps"], "gaps_total": last["gaps"],
        "quarantined": last["quarantined"], "replays_requested": last["replays"] - first["replays"],
        "tail_probes": last["probes"] - first["probes"],
        "lag_med_start_ms": round(first["lag_med"] * 1e3, 2), "lag_med_end_ms": round(last["lag_med"] * 1e3, 2),
        "lag_max_start_ms": round(first["lag_max"] * 1e3, 2), "lag_max_end_ms": round(last["lag_max"] * 1e3, 2),
        "lag_max_peak_ms": round(max(s["lag_max"] for s in samples) * 1e3, 2),
        "lag_med_slope_ms_per_s": round(lag_slope * 1e3, 3), "lag_workers": last["lag_workers"],
        "kvmiss_cores": round(cpu["kvmiss"] / dt, 3), "publishers_cores": round(cpu["publishers"] / dt, 3),
        "bench_cores": round(cpu["bench"] / dt, 3),
        "kvmiss_us_per_batch": round(cpu["kvmiss"] / app_b * 1e6, 1) if app_b else None,
        "machine_busy_cores": round(mach["busy"] / dt, 3), "machine_steal_cores": round(mach["steal"] / dt, 3),
        "machine_idle_cores": round(mach["idle"] / dt, 3),
        "kvmiss_rss_mb_start": round(rss0, 1), "kvmiss_rss_mb_end": round(rss1, 1),
        "published_total": published_total, "applied_after_drain": applied_total, "drain_s": round(drain_s, 2),
        "publisher_late_resets": late, **population,
    }
    slack = max(0.01 * pub_b, n)  # 1 %, or one batch per worker in flight
    result["keeps_up"] = bool(
        pub_b > 0 and (app_b >= 0.99 * pub_b or backlog1 - backlog0 <= slack)
        and result["gaps"] == 0 and lag_slope < 0.010 and last["lag_max"] < 1.0
        and applied_total >= published_total
        and last["lag_workers"] == n)
    result["publishers_held_rate"] = bool(pub_b / dt >= 0.98 * target)
    return result


# --- the sweep -----------------------------------------------------------------------------


def header() -> str:
    return (f"{'N':>5} {'b/s/w':>6} {'target b/s':>10} {'publ b/s':>9} {'appl b/s':>9} {'ratio':>6} {'blk ev/s':>9} "
            f"{'backlog':>11} {'gaps':>5} {'lag med ms':>13} {'lag max ms':>13} {'slope':>7} "
            f"{'kvmiss':>6} {'pubs':>5} {'busy':>5} {'steal':>5} {'RSS MB':>12} {'drain':>6}  ok")


def row(r: dict) -> str:
    return (f"{r['workers']:>5} {r['rate_per_worker']:>6g} {r['target_batches_s']:>10,.0f} {r['published_batches_s']:>9,.0f} "
            f"{r['applied_batches_s']:>9,.0f} {r['applied_ratio']:>6.3f} {r['applied_block_events_s']:>9,.0f} "
            f"{r['backlog_start']:>5.0f}>{r['backlog_end']:<5.0f} {r['gaps']:>5.0f} "
            f"{r['lag_med_start_ms']:>6.1f}>{r['lag_med_end_ms']:<6.1f} {r['lag_max_start_ms']:>6.0f}>{r['lag_max_end_ms']:<6.0f} "
            f"{r['lag_med_slope_ms_per_s']:>7.2f} {r['kvmiss_cores']:>6.2f} {r['publishers_cores']:>5.2f} "
            f"{r['machine_busy_cores']:>5.2f} {r['machine_steal_cores']:>5.2f} "
            f"{r['kvmiss_rss_mb_start']:>5.0f}>{r['kvmiss_rss_mb_end']:<6.0f} {r['drain_s']:>6.1f}  "
            f"{'yes' if r['keeps_up'] else 'NO'}{'' if r['publishers_held_rate'] else ' (publishers below target)'}")


def sweep(profile: str, args) -> list[dict]:
    results: dict[int, dict] = {}

    def point(n: int, rate: float | None = None) -> dict:
        key = rate if rate else n
        if key not in results:
            try:
                results[key] = run_point(profile, n, args, rate)
            except RuntimeError as exc:  # e.g. kvmiss cannot open that many sockets
                results[key] = {"profile": profile, "workers": n, "rate_per_worker": rate, "keeps_up": False,
                                "error": str(exc)[-600:]}
            print("POINT " + json.dumps(results[key]), flush=True)
        return results[key]

    if args.rates:  # N fixed, the per-worker rate stepped: the batches/s ceiling past the socket cap
        n = int(args.workers.split(",")[0])
        for rate in (float(x) for x in args.rates.split(",")):
            if not point(n, rate)["keeps_up"] and args.stop_at_fail:
                break
        return [results[k] for k in sorted(results)]

    steps = [int(x) for x in args.workers.split(",")]
    for n in steps:
        if not point(n)["keeps_up"] and args.stop_at_fail:
            break
    if args.extend and all(r["keeps_up"] for r in results.values()):
        n = max(steps)
        while n < args.max_workers and point(n * 2)["keeps_up"]:
            n *= 2
    passing = [n for n, r in results.items() if r["keeps_up"]]
    failing = [n for n, r in results.items() if not r["keeps_up"]]
    if passing and failing:
        lo = max(passing)
        hi = min([f for f in failing if f > lo], default=None)
        for _ in range(args.bisect):
            if hi is None or hi - lo <= max(2, lo // 16):
                break
            mid = (lo + hi) // 2
            if point(mid)["keeps_up"]:
                lo = mid
            else:
                hi = mid
    return [results[n] for n in sorted(results)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", choices=(*PROFILES, "both"), default="both")
    parser.add_argument("--workers", default="8,16,32,64,128", help="comma list of worker counts")
    parser.add_argument("--rate", type=float, help="batches/s per worker (overrides the profile)")
    parser.add_argument("--rates", help="comma list of per-worker rates to step at the first --workers value "
                                        "instead of stepping N")
    parser.add_argument("--blocks", type=int, help="blocks stored (and removed) per batch (overrides the profile)")
    parser.add_argument("--publishers", type=int, default=2, help="publisher processes (workers spread over them)")
    parser.add_argument("--window-s", type=float, default=12.0)
    parser.add_argument("--warmup-s", type=float, default=4.0)
    parser.add_argument("--drain-s", type=float, default=10.0)
    parser.add_argument("--populate", type=int, default=16384,
                        help="resident blocks per worker published (64 per batch, never removed) before the run: "
                             "the index at a realistic size; 0: none")
    parser.add_argument("--ring-s", type=float, default=10.0, help="replay ring per worker, seconds of batches")
    parser.add_argument("--no-replay", action="store_true", help="no replay ROUTER (and so no tail probes)")
    parser.add_argument("--extend", action="store_true", help="keep doubling N past the list while points keep up")
    parser.add_argument("--max-workers", type=int, default=1024)
    parser.add_argument("--bisect", type=int, default=0, help="points spent narrowing the last pass / first fail")
    parser.add_argument("--stop-at-fail", action="store_true", help="skip the rest of the list after a failure")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (config, serve.log)")
    args = parser.parse_args(argv)
    if not sys.platform.startswith("linux"):
        sys.exit("needs Linux (/proc) for the CPU figures")
    profiles = list(PROFILES) if args.profile == "both" else [args.profile]
    print(f"python {platform.python_version()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start; "
          f"{args.publishers} publisher processes, window {args.window_s:.0f} s after {args.warmup_s:.0f} s warm-up, "
          f"replay {'off' if args.no_replay else f'on (ring {args.ring_s:.0f} s)'}", flush=True)
    tables = {}
    for profile in profiles:
        tables[profile] = sweep(profile, args)
    for profile, rows in tables.items():
        rate = args.rate or PROFILES[profile]["rate"]
        blocks = args.blocks or PROFILES[profile]["blocks"]
        shown = f"{args.rates} batches/s/worker stepped at {args.workers.split(',')[0]} workers" if args.rates \
            else f"{rate:g} batches/s/worker"
        print(f"\nprofile {profile} ({PROFILES[profile]['what']}): {shown}, {blocks} blocks stored + "
              f"{blocks} removed per batch ({1 + blocks} events, {2 * blocks} block events)")
        print(header())
        for r in rows:
            print(row(r) if "error" not in r else f"{r['workers']:>5}  ERROR {r['error']}")
        ok = [r for r in rows if r["keeps_up"]]
        size = (lambda r: r.get("target_batches_s", 0)) if args.rates else (lambda r: r["workers"])
        below = [(f"{r['rate_per_worker']:g}/s" if args.rates else r["workers"]) for r in rows if not r["keeps_up"]]
        if ok:
            best = max(ok, key=size)
            clean = all(r["keeps_up"] for r in rows if size(r) < size(best))
            print(f"ceiling: {best['workers']} workers at {best['rate_per_worker']:g} batches/s each kept up = {best['applied_batches_s']:,.0f} batches/s, "
                  f"{best['applied_block_events_s']:,.0f} block events/s (kvmiss {best['kvmiss_cores']:.2f} cores, "
                  f"publishers {best['publishers_cores']:.2f}); failed at: {below or 'none'}"
                  + ("" if clean else " (a smaller N failed too: noisy box)"))
        else:
            print(f"ceiling: no point kept up (failed at {below})")


if __name__ == "__main__":
    main()
