"""Verdict latency: evidence gathering + verdict for one request, once its history is there.

    .venv/bin/python benchmarks/bench_verdict.py [--workers 8] [--blocks 100000] [--requests 20000]
        [--joined 0] [--departed 0 [--in-band]] [--hybrid]

A fleet of ``--workers`` epochs, each holding ``--blocks`` resident blocks with churn
(evictions), a batch log of 50,000 steps; requests pick a worker and a first-miss block
that is resident, evicted, elsewhere in the fleet or never stored. Times
`Attributor.attribute` per request (evidence + verdict + keyed digest) and prints
p50/p95/p99 in microseconds.

A fleet that changes (docs/HISTORY.md, "Fleets that change"): ``--joined N`` of the workers
are announced by a membership source (joined before every lookup: members with a span, so
every fleet check asks their standing), and ``--departed N`` more workers, built the same
way, left the fleet before every lookup (their views kept until retention; consulted for
nothing). Requests choose among the members only, so the labels are the static fleet's.
``--in-band``: the departures are seen at the middle lookup time and every lookup is within a
second of it, inside the uncertainty band: each departed worker counts for every request
(ruled out by its history, or unsettled) -- a rolling deploy's worst moment.

``--hybrid``: every worker is a hybrid model's (group 1 full attention, group 0 a sliding
window of 33 tokens, 2 blocks, keeping every other chunk), so each miss the full-attention
group held is judged in the window group too (enricher/core/group_evidence.py).
"""

from __future__ import annotations

import argparse
import random
import time

import msgspec

from kvmiss.enricher.core.attribution import Attributor
from kvmiss.enricher.core.index import ResidencyIndex
from kvmiss.enricher.core.privacy import DigestKey
from kvmiss.schemas.attribution import RequestFacts
from kvmiss.schemas.config import WorkerSpec
from kvmiss.schemas.events import BlockRemoved, BlockStored
from kvmiss.schemas.fleet import FleetChange
from kvmiss.schemas.stream import AppliedBatch, RunStart

STEPS = 50_000


def build(workers: range, blocks: int, rng: random.Random, index: ResidencyIndex | None = None,
          hybrid: bool = False):
    index = index or ResidencyIndex([f"w{i}" for i in workers], retention_s=1e9)
    held: dict[str, list[int]] = {}
    evicted: dict[str, list[int]] = {}
    per_step = max(1, blocks // STEPS + 1)
    for w in workers:
        worker = f"w{w}"
        hashes = [rng.getrandbits(64) for _ in range(blocks)]
        held[worker], evicted[worker] = hashes, []
        cursor = 0
        for seq in range(STEPS):
            events = []
            chunk = hashes[cursor:cursor + per_step]
            cursor += per_step
            if chunk and not hybrid:
                events.append(BlockStored(block_hashes=chunk, block_size=16))
            elif chunk:
                events.append(BlockStored(block_hashes=chunk, block_size=16, group_idx=1,
                                          kv_cache_spec_kind="full_attention"))
                if seq % 2:
                    events.append(BlockStored(block_hashes=chunk, block_size=16, group_idx=0,
                                              kv_cache_spec_kind="sliding_window",
                                              kv_cache_spec_sliding_window=33))
            if seq % 10 == 9 and cursor > 100:
                victim = hashes[rng.randrange(min(cursor, len(hashes)) - 100)]
                events.append(BlockRemoved(block_hashes=[victim], group_idx=1 if hybrid else None))
                evicted[worker].append(victim)
            index.apply(AppliedBatch(worker=worker, epoch=0, seq=seq, ts=1000.0 + seq * 0.01,
                                     recv_ts=1000.0 + seq * 0.01, events=events,
                                     run_start_seq=0, run_start=RunStart.EPOCH_START))
    return index, held, evicted


def requests(workers: int, n: int, held, evicted, rng: random.Random) -> list[RequestFacts]:
    out = []
    for _ in range(n):
        worker = f"w{rng.randrange(workers)}"
        kind = rng.randrange(4)
        if kind == 0:
            h = rng.choice(held[worker])
        elif kind == 1 and evicted[worker]:
            h = rng.choice(evicted[worker])
        elif kind == 2:
            h = rng.choice(held[f"w{(int(worker[1:]) + 1) % workers}"])
        else:
            h = rng.getrandbits(64)
        t = 1000.0 + rng.uniform(STEPS * 0.5, STEPS - 1) * 0.01
        out.append(RequestFacts(prompt_tokens=80, cached_tokens=32, block_size=16, worker=worker,
                                lookup_time=t, block_hashes=[1, 2, h, 4, 5]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=100_000)
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=3, help="passes over the requests; the quietest is kept")
    parser.add_argument("--joined", type=int, default=0, help="of --workers, how many a source announced")
    parser.add_argument("--departed", type=int, default=0, help="workers besides --workers that left the fleet")
    parser.add_argument("--in-band", action="store_true", help="departures seen within a second of every lookup")
    parser.add_argument("--hybrid", action="store_true", help="hybrid models: a full-attention and a window group")
    args = parser.parse_args()
    rng = random.Random(11)
    total = args.workers + args.departed
    static = args.workers - args.joined
    index = ResidencyIndex([f"w{i}" for i in range(static)], retention_s=1e9)
    before = 1000.0 + STEPS * 0.5 * 0.01 - 10.0  # 10 s before the first lookup
    if args.joined:  # announced before their first batch, as a source does
        index.apply_fleet_change(FleetChange(at=before, source="file", joined=tuple(
            WorkerSpec(id=f"w{i}", endpoint=f"tcp://10.0.0.1:{6000 + i}") for i in range(static, args.workers))))
    index, held, evicted = build(range(args.workers), args.blocks, rng, index, args.hybrid)
    middle = 1000.0 + STEPS * 0.75 * 0.01
    if args.departed:  # (the requests are drawn as without them: the labels stay the static fleet's)
        build(range(args.workers, total), args.blocks, random.Random(12), index)
        index.apply_fleet_change(FleetChange(
            at=middle if args.in_band else before, source="file",
            departed=tuple(f"w{i}" for i in range(args.workers, total))))
    attributor = Attributor(index, DigestKey("bench-verdict-secret-0001"))
    reqs = requests(args.workers, args.requests, held, evicted, rng)
    if args.in_band:
        spread = random.Random(13)
        reqs = [msgspec.structs.replace(f, lookup_time=middle + spread.uniform(-1.0, 1.0)) for f in reqs]
    passes = []
    for _ in range(args.repeat):
        wall, cpu = [], []
        labels: dict[str, int] = {}
        for facts in reqs:
            c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
            verdict = attributor.attribute(facts)
            wall.append(time.perf_counter_ns() - t0)
            cpu.append(time.thread_time_ns() - c0)
            labels[verdict.label.value] = labels.get(verdict.label.value, 0) + 1
        passes.append((percentiles(wall), percentiles(cpu), labels))
    wall_pct, cpu_pct, labels = min(passes, key=lambda p: p[0][0.99])
    print(f"{args.workers} workers x {args.blocks:,} blocks{' (hybrid)' if args.hybrid else ''}, {STEPS:,} steps each; {args.requests:,} requests, "
          f"best of {args.repeat} passes by wall-clock p99"
          + (f"; {args.joined} joined, {args.departed} departed" if args.joined or args.departed else "")
          + (" within the band of every lookup" if args.in_band else ""))
    print("labels: " + ", ".join(f"{k} {v}" for k, v in sorted(labels.items())))
    for name, pct in (("wall-clock", wall_pct), ("thread CPU", cpu_pct)):
        print(f"verdict latency ({name}): p50 {pct[0.5]:.1f} us, p95 {pct[0.95]:.1f} us, p99 {pct[0.99]:.1f} us")


def percentiles(ns: list[int]) -> dict[float, float]:
    ns = sorted(ns)
    return {q: ns[min(len(ns) - 1, int(q * len(ns)))] / 1e3 for q in (0.5, 0.95, 0.99)}


if __name__ == "__main__":
    main()
