"""The cost of a fleet that keeps changing: one membership change per second for ten minutes,
64 workers, under a running kvmiss service -- does memory stay within what retention keeps,
and does the event loop keep its pace?

Layout (two processes, all real parts):
  * the engines: a driver process with 64 of kvmiss's demo publishers (vLLM 0.33's wire
    protocol: ZeroMQ PUB + replay ROUTER), each publishing ``--batches-per-s`` batches of
    stores and evictions. Every ``--change-every-s`` it stops the oldest engine and starts a
    new one under a new id on new ports (a rolling replacement that never ends), and rewrites
    the ``[fleet] file`` by rename, as a ConfigMap or a deploy tool does.
  * kvmiss: the service in this process (`Service`, as ``kvmiss serve`` runs it, with serve's
    process settings: GC thresholds, GIL switch interval, start-up objects frozen), following
    the file, with ``[history] retention_s = --retention-s``. Its metrics endpoint is
    scraped every 5 s from a thread, as Prometheus would.

Measured here:
  * the event loop's lag: a task asks to sleep 5 ms, again and again; the lag is how much
    later than asked it woke (a stall of the loop shows as one long lag). Max, p99, p99.9,
    and how many wakes were late by more than 20 ms;
  * RSS (VmRSS) every 10 s. After the first ``2 * retention_s`` (departed workers are released
    ``retention_s`` after they leave), memory must stay flat: the growth from then to the
    end, and the slope of a line fitted through those samples, are reported;
  * joins and departures applied (from the service's own counters).

Usage (from the repository root):
    nice -n 10 .venv/bin/python benchmarks/bench_fleet_churn.py                   # 600 s, 64 workers
    .venv/bin/python benchmarks/bench_fleet_churn.py --duration-s 60 --retention-s 10   # a quick look
    ... --trace-stalls    # also: every loop callback of 8 ms or more, what it ran, beside the late wakes
Prints one JSON object; exit status 1 if a bound was broken (lag > 20 ms, or memory grew
after retention by more than --max-growth-mb).
"""

from __future__ import annotations

import argparse
import array
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
import urllib.request
from pathlib import Path

from benchlib import free_port, percentile, rss_mb

LAG_TICK_S = 0.005
LAG_BOUND_S = 0.020
SLOW_CALLBACK_S = 0.008  # --trace-stalls: loop callbacks at least this long are recorded


def trace_slow_callbacks(slow: list) -> None:
    """--trace-stalls: time every callback the event loop runs and keep (wall time, seconds,
    what it was: the task's coroutine and where it stopped) for those of `SLOW_CALLBACK_S` or
    more -- what held the loop when a wake came late. (Wraps asyncio's `Handle._run`: a
    diagnostic, adding ~1 us per callback.)"""
    run = asyncio.events.Handle._run

    def timed(handle) -> None:
        t = time.perf_counter()
        run(handle)
        took = time.perf_counter() - t
        if took >= SLOW_CALLBACK_S:
            slow.append((time.time(), took, what_ran(handle)))

    asyncio.events.Handle._run = timed


def what_ran(handle) -> str:
    task = getattr(handle._callback, "__self__", None)
    if isinstance(task, asyncio.Task):
        coro = task.get_coro()
        frame = getattr(coro, "cr_frame", None)
        where = f" (then at {Path(frame.f_code.co_filename).name}:{frame.f_lineno})" if frame else ""
        return f"task {getattr(coro, '__qualname__', coro)}{where}"
    return repr(handle)[:160]


def churning(t: float, phase_s: float) -> bool:
    """Phases alternate, quiet first: the same run measures the loop with and without churn,
    side by side, on a machine whose load changes by the minute."""
    return phase_s <= 0 or int(t // phase_s) % 2 == 1


# --- the engines (driver process) -----------------------------------------------------------


def driver(args: argparse.Namespace) -> int:

    import zmq

    from kvmiss.enricher.demo.publisher import BlockRemoved, BlockStored, EventBatch, Publisher

    ctx = zmq.Context()
    engines: dict[str, Publisher] = {}
    resident: dict[str, list[int]] = {}
    serial = 0

    def start() -> None:
        nonlocal serial
        worker = f"e{serial:05d}"
        serial += 1
        pub = Publisher(ctx, topic=f"kv@{worker}@bench", buffer_steps=2_000)
        pub.start()
        engines[worker], resident[worker] = pub, []

    def write_fleet() -> None:
        text = "".join(f'[[workers]]\nid = "{w}"\nendpoint = "{p.pub_endpoint}"\n'
                       f'replay_endpoint = "{p.replay_endpoint}"\n' for w, p in engines.items())
        tmp = f"{args.fleet_file}.tmp"
        Path(tmp).write_text(text)
        os.replace(tmp, args.fleet_file)

    for _ in range(args.workers):
        start()
    write_fleet()
    t0 = time.monotonic()
    print(json.dumps({"ready": True, "t0": time.time() + args.warmup_s}), flush=True)
    next_change = t0 + args.warmup_s
    interval = 1.0 / args.batches_per_s
    next_round = t0
    changes = published = 0
    block = 1
    while time.monotonic() - t0 < args.duration_s + args.warmup_s:
        now = time.monotonic()
        if now >= next_change and not churning(now - t0 - args.warmup_s, args.phase_s):
            next_change += args.change_every_s  # a quiet phase: the baseline beside the churn
        elif now >= next_change:
            oldest = next(iter(engines))
            engines.pop(oldest).shutdown()
            resident.pop(oldest)
            start()
            write_fleet()
            changes += 1
            next_change += args.change_every_s
        if now >= next_round:
            for worker, pub in engines.items():  # one engine step each: a few stores, evictions
                held = resident[worker]  # a pool of 64 blocks per engine: full, each step evicts 4
                removed = held[:4] if len(held) >= 64 else []
                del held[:len(removed)]
                stored = list(range(block, block + 4))
                block += 4
                held += stored
                events = [BlockStored(block_hashes=stored, parent_block_hash=None,
                                      token_ids=list(range(16 * len(stored))), block_size=16,
                                      lora_id=None, medium=None, lora_name=None)]
                if removed:
                    events.append(BlockRemoved(block_hashes=removed, medium=None))
                pub.publish(EventBatch(ts=time.time(), events=events, data_parallel_rank=None))
                published += 1
            next_round += interval
        time.sleep(max(0.0, min(next_round, next_change) - time.monotonic()))
    for pub in engines.values():
        pub.shutdown()
    ctx.term()
    print(json.dumps({"changes": changes, "batches": published}), flush=True)
    return 0


# --- kvmiss (this process) -------------------------------------------------------------------


async def follow(args: argparse.Namespace, fleet_file: str, metrics_port: int) -> dict:
    from kvmiss.enricher.cli.serve_cmd import freeze_startup_objects
    from kvmiss.enricher.service.serve import Service
    from kvmiss.schemas.config import parse_config

    config = parse_config(f"""
[otlp]
grpc = ""
http = "127.0.0.1:{free_port()}"
[privacy]
digest_key = "bench-fleet-churn-secret-0001"
[metrics]
listen = "127.0.0.1:{metrics_port}"
[history]
retention_s = {args.retention_s}
[fleet]
file = "{fleet_file}"
poll_interval_s = 0.25
""")
    loop = asyncio.get_running_loop()
    proc = subprocess.Popen([sys.executable, __file__, "--driver", "--fleet-file", fleet_file,
                             "--workers", str(args.workers), "--duration-s", str(args.duration_s),
                             "--warmup-s", str(args.warmup_s), "--change-every-s", str(args.change_every_s),
                             "--batches-per-s", str(args.batches_per_s), "--phase-s", str(args.phase_s)],
                            stdout=subprocess.PIPE, text=True)
    ready = json.loads(await loop.run_in_executor(None, proc.stdout.readline))
    service = Service(config)  # (after the driver wrote the first fleet file)
    await service.start()
    freeze_startup_objects()  # as `kvmiss serve` does
    # (wall time woken, lag) per wake, in arrays sized for the whole run before it starts: a
    # list of tuples grew by ~1.3 MB a minute, which the RSS samples then counted as kvmiss's.
    capacity = int(args.duration_s / LAG_TICK_S) + 1000
    woken, lagged = array.array("d", bytes(8 * capacity)), array.array("d", bytes(8 * capacity))
    wakes = 0
    applies: list[float] = []  # seconds each apply_fleet_change took (on the loop)
    apply = service.apply_fleet_change

    def timed_apply(change) -> None:
        t = time.perf_counter()
        apply(change)
        applies.append(time.perf_counter() - t)

    service.fleet_watch.apply = timed_apply
    rss: list[tuple[float, float]] = []
    stop = asyncio.Event()

    async def lag_probe() -> None:
        nonlocal wakes
        while not stop.is_set():
            t = time.perf_counter()
            await asyncio.sleep(LAG_TICK_S)
            if wakes < capacity:
                woken[wakes], lagged[wakes] = time.time(), time.perf_counter() - t - LAG_TICK_S
                wakes += 1

    snapshots = []

    async def rss_probe(t0: float) -> None:
        while not stop.is_set():
            rss.append((time.monotonic() - t0, rss_mb(os.getpid())))
            if args.tracemalloc and len(snapshots) < 1 and rss[-1][0] >= 2 * args.retention_s:
                snapshots.append(tracemalloc.take_snapshot())
            try:
                await asyncio.wait_for(stop.wait(), 10.0)
            except TimeoutError:
                pass

    def scrape() -> None:
        while not stop.is_set():
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read()
            except OSError:
                pass
            time.sleep(5)

    await asyncio.sleep(args.warmup_s)  # the first fleet followed, streams caught up
    t0 = time.monotonic()
    tasks = [loop.create_task(lag_probe()), loop.create_task(rss_probe(t0))]
    threading.Thread(target=scrape, daemon=True).start()
    driver_out = json.loads(await loop.run_in_executor(None, proc.stdout.readline))
    stop.set()
    await asyncio.gather(*tasks)
    if snapshots:  # what grew after retention, by line (--tracemalloc)
        for stat in tracemalloc.take_snapshot().compare_to(snapshots[0], "lineno")[:15]:
            print(stat, file=sys.stderr)
    proc.wait()
    stats = service.fleet_stats
    result = {"joins": stats.joins, "departures": stats.departures, "members": len(service.fleet.streams),
              "departed_kept": len(service._departed), **driver_out}
    await service.shutdown()
    lags = list(zip(woken[:wakes], lagged[:wakes]))
    return {**result, "lags": lags, "rss": rss, "applies": applies, "t0": ready["t0"]}


def lag_summary(lags: list[float]) -> dict:
    return {"max": round(1000 * max(lags), 2), "p99": round(1000 * percentile(lags, 99), 2),
            "p999": round(1000 * percentile(lags, 99.9), 2), "wakes": len(lags),
            "over_20ms": sum(lag > LAG_BOUND_S for lag in lags)}


def slope_mb_per_min(points: list[tuple[float, float]]) -> float:
    n = len(points)
    if n < 2:
        return float("nan")
    mx = sum(t for t, _ in points) / n
    my = sum(r for _, r in points) / n
    var = sum((t - mx) ** 2 for t, _ in points)
    return 60 * sum((t - mx) * (r - my) for t, r in points) / var if var else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--change-every-s", type=float, default=1.0)
    parser.add_argument("--retention-s", type=float, default=60.0)
    parser.add_argument("--batches-per-s", type=float, default=10.0, help="per worker")
    parser.add_argument("--warmup-s", type=float, default=5.0)
    parser.add_argument("--phase-s", type=float, default=30.0,
                        help="quiet and churning phases alternate (0: churn throughout)")
    parser.add_argument("--max-growth-mb", type=float, default=20.0)
    parser.add_argument("--tracemalloc", action="store_true",
                        help="print what grew after 2 * retention, by line (slow)")
    parser.add_argument("--trace-stalls", action="store_true",
                        help="record the loop callbacks of 8 ms or more, and what they ran")
    parser.add_argument("--driver", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--fleet-file", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.driver:
        return driver(args)
    if args.tracemalloc:
        tracemalloc.start()
    slow: list[tuple[float, float, str]] = []
    if args.trace_stalls:
        trace_slow_callbacks(slow)
    from kvmiss.enricher.cli.serve_cmd import apply_process_policies

    apply_process_policies()  # GC thresholds, GIL switch interval: the process `kvmiss serve` is
    with tempfile.TemporaryDirectory() as tmp:
        out = asyncio.run(follow(args, str(Path(tmp) / "fleet.toml"), free_port()))
    lags, rss, applies, t0 = out.pop("lags"), out.pop("rss"), out.pop("applies"), out.pop("t0")
    by_phase = {"quiet": [], "churning": []}
    for at, lag in lags:
        if at >= t0:
            by_phase["churning" if churning(at - t0, args.phase_s) else "quiet"].append(lag)
    settled = [(t, r) for t, r in rss if t >= 2 * args.retention_s]
    growth = settled[-1][1] - settled[0][1] if len(settled) >= 2 else float("nan")
    report = {
        "command": " ".join(sys.argv),
        **out,
        "loop_lag_ms": {phase: lag_summary(values) for phase, values in by_phase.items() if values},
        "apply_fleet_change_ms": {"count": len(applies), "max": round(1000 * max(applies, default=0), 3),
                                  "p99": round(1000 * percentile(applies, 99), 3)},
        "rss_mb": {"first": round(rss[0][1], 1), "at_2x_retention": round(settled[0][1], 1) if settled else None,
                   "end": round(rss[-1][1], 1), "max": round(max(r for _, r in rss), 1),
                   "growth_after_2x_retention": round(growth, 1),
                   "each_minute": [round(r, 1) for t, r in rss if int(t) % 60 < 10],
                   "slope_after_2x_retention_mb_per_min": round(slope_mb_per_min(settled), 3)},
    }
    if args.trace_stalls:  # each late wake beside the slow callbacks around it
        report["slow_callbacks"] = [
            {"at_s": round(at - t0, 3), "ms": round(1000 * took, 1), "ran": ran} for at, took, ran in slow if at >= t0]
        report["late_wakes"] = [{"at_s": round(at - t0, 3), "ms": round(1000 * lag, 1)}
                                for at, lag in lags if at >= t0 and lag > LAG_BOUND_S]
    print(json.dumps(report, indent=1))
    churn_lags = by_phase["churning"]
    ok = bool(churn_lags) and max(churn_lags) <= LAG_BOUND_S and not growth > args.max_growth_mb
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
