"""Residency index memory: bytes per resident block and per retained eviction record.

    .venv/bin/python benchmarks/bench_index_memory.py [--workers 8] [--blocks 500000]

A fleet-sized population: every worker stores ``--blocks`` distinct blocks (16 per
BlockStored, 8 events per batch, as an engine step would), then evicts a tenth of them
(retained eviction records). Memory is measured with tracemalloc around the index alone,
after the events themselves are gone.
"""

from __future__ import annotations

import argparse
import gc
import random
import tracemalloc

from kvmiss.enricher.index import ResidencyIndex
from kvmiss.schemas.events import BlockRemoved, BlockStored
from kvmiss.schemas.stream import AppliedBatch, RunStart


def feed(index: ResidencyIndex, worker: str, blocks: int, rng: random.Random) -> list[int]:
    hashes = [rng.getrandbits(64) for _ in range(blocks)]
    seq = 0
    for start in range(0, blocks, 128):
        chunk = hashes[start:start + 128]
        events = [BlockStored(block_hashes=chunk[i:i + 16], block_size=16) for i in range(0, len(chunk), 16)]
        index.apply(AppliedBatch(worker=worker, epoch=0, seq=seq, ts=float(seq), recv_ts=float(seq),
                                 events=events, run_start_seq=0, run_start=RunStart.EPOCH_START))
        seq += 1
    return hashes


def evict(index: ResidencyIndex, worker: str, victims: list[int], seq0: int) -> None:
    for i in range(0, len(victims), 64):
        events = [BlockRemoved(block_hashes=[h]) for h in victims[i:i + 64]]
        seq = seq0 + i // 64
        index.apply(AppliedBatch(worker=worker, epoch=0, seq=seq, ts=float(seq), recv_ts=float(seq),
                                 events=events, run_start_seq=0, run_start=RunStart.EPOCH_START))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=500_000)
    args = parser.parse_args()
    rng = random.Random(3)
    tracemalloc.start()
    index = ResidencyIndex([f"w{i}" for i in range(args.workers)])
    kept: dict[str, list[int]] = {}
    gc.collect()
    base = tracemalloc.get_traced_memory()[0]
    for i in range(args.workers):
        kept[f"w{i}"] = feed(index, f"w{i}", args.blocks, rng)
    gc.collect()
    resident_bytes = tracemalloc.get_traced_memory()[0] - base
    held_by_test = sum(len(v) for v in kept.values())
    # The test's own list of hashes shares the int objects with the index: count them once.
    own_lists = sum(v.__sizeof__() for v in kept.values())
    per_block = (resident_bytes - own_lists) / held_by_test
    before = tracemalloc.get_traced_memory()[0]
    evicted = 0
    for worker, hashes in kept.items():
        victims = hashes[: len(hashes) // 10]
        evict(index, worker, victims, seq0=10_000_000)
        evicted += len(victims)
    gc.collect()
    per_eviction = (tracemalloc.get_traced_memory()[0] - before) / evicted
    print(f"{args.workers} workers x {args.blocks:,} resident blocks")
    print(f"resident block:          {per_block:6.1f} bytes (dict slot + the hash int + shared seq)")
    print(f"retained eviction record: {per_eviction:6.1f} bytes more per evicted block")


if __name__ == "__main__":
    main()
