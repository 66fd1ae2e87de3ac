"""Residency index memory: bytes per resident block and per retained eviction record.

    .venv/bin/python benchmarks/bench_index_memory.py [--workers 8] [--blocks 500000]

A fleet-sized population: every worker stores ``--blocks`` distinct blocks (16 per
BlockStored, 8 events per batch, as an engine step would), then evicts a tenth of them
(retained eviction records). Memory is measured with tracemalloc (which sees the compiled
table's allocations too) around each phase, with the events and the benchmark's own lists
of hashes gone: only what the index keeps is counted.
"""

from __future__ import annotations

import argparse
import gc
import random
import tracemalloc

from kvmiss.enricher.core.index import ResidencyIndex
from kvmiss.enricher.core.residency_table import ACCELERATED
from kvmiss.schemas.events import BlockRemoved, BlockStored
from kvmiss.schemas.stream import AppliedBatch, RunStart


def worker_hashes(worker: int, blocks: int) -> list[int]:
    """The worker's block hashes, reproducible so that no list of them outlives a phase."""
    rng = random.Random(1000 + worker)
    return [rng.getrandbits(64) for _ in range(blocks)]


def feed(index: ResidencyIndex, worker: str, hashes: list[int]) -> None:
    seq = 0
    for start in range(0, len(hashes), 128):
        chunk = hashes[start:start + 128]
        events = [BlockStored(block_hashes=chunk[i:i + 16], block_size=16) for i in range(0, len(chunk), 16)]
        index.apply(AppliedBatch(worker=worker, epoch=0, seq=seq, ts=float(seq), recv_ts=float(seq),
                                 events=events, run_start_seq=0, run_start=RunStart.EPOCH_START))
        seq += 1


def evict(index: ResidencyIndex, worker: str, victims: list[int], seq0: int) -> None:
    for i in range(0, len(victims), 64):
        events = [BlockRemoved(block_hashes=[h]) for h in victims[i:i + 64]]
        seq = seq0 + i // 64
        index.apply(AppliedBatch(worker=worker, epoch=0, seq=seq, ts=float(seq), recv_ts=float(seq),
                                 events=events, run_start_seq=0, run_start=RunStart.EPOCH_START))


def traced() -> int:
    gc.collect()
    return tracemalloc.get_traced_memory()[0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=500_000)
    args = parser.parse_args()
    workers = [f"w{i}" for i in range(args.workers)]
    tracemalloc.start()
    index = ResidencyIndex(workers)
    resident_bytes = 0
    for i, worker in enumerate(workers):
        # The hashes are built before the measured phase and freed after it: only what the
        # index itself keeps is counted.
        hashes = worker_hashes(i, args.blocks)
        before = traced()
        feed(index, worker, hashes)
        resident_bytes += traced() - before
        del hashes
    resident = args.workers * args.blocks
    per_block = resident_bytes / resident
    evicted = 0
    grew = 0
    for i, worker in enumerate(workers):
        victims = worker_hashes(i, args.blocks)[: args.blocks // 10]
        before = traced()
        evict(index, worker, victims, seq0=10_000_000)
        grew += traced() - before
        evicted += len(victims)
        del victims
    per_eviction = grew / evicted
    if ACCELERATED:  # (the reference model does not count its own bytes: tracemalloc below does)
        table_bytes = sum(t.nbytes for v in index.current.values() for t in v.all_tables())
        print(f"{args.workers} workers x {args.blocks:,} resident blocks; compiled table: "
              f"{table_bytes / resident:.1f} bytes per resident block after evictions")
    else:
        print(f"{args.workers} workers x {args.blocks:,} resident blocks (reference model)")
    print(f"resident block:           {per_block:6.1f} bytes (traced: table slots and the batch log)")
    print(f"retained eviction record: {per_eviction:6.1f} bytes more per evicted block")


if __name__ == "__main__":
    main()
