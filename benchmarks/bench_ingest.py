"""Ingest throughput: live frames -> decode -> stream state machine -> residency index.

Realistic batches: an engine step stores a few requests' new blocks (BlockStored with
16-token blocks and their token ids, parent links, medium and group set as vLLM 0.33 does)
and evicts as many single blocks (one BlockRemoved per hash, as vLLM emits them). Frames are
built once with the real encoder, then replayed in-process on one core.

    .venv/bin/python benchmarks/bench_ingest.py [--batches 20000] [--repeat 3]

Reports block events/s (one event = one BlockStored or BlockRemoved) and batches/s for each
stage cumulatively: decode only (the reference decoder, and the compiled reader
collectors/_kvwire.c that the stream uses when it is built), + stream continuity, + index apply,
and the whole path as the collector runs it: the fleet routing each message to its worker's
stream (frames parsed by the worker's engine adapter), actions to a sink applying the index.
"""

from __future__ import annotations

import argparse
import random
import time

import msgspec

from kvmiss.collectors.continuity import Apply
from kvmiss.collectors.fleet import SUB, Fleet
from kvmiss.collectors.frames import parse_live
from kvmiss.collectors.stream import WorkerStream
from kvmiss.enricher.core.index import ResidencyIndex
from kvmiss.schemas.config import WorkerSpec
from kvmiss.schemas.events import BlockRemoved, BlockStored, EventBatch, decode_batch

STORES_PER_BATCH = 4
BLOCKS_PER_STORE = 2
REMOVALS_PER_BATCH = 8


def stored_event(rng: random.Random, with_parent: bool = True) -> BlockStored:
    """One BlockStored of BLOCKS_PER_STORE new 16-token blocks as vLLM 0.33 sends it (a random
    parent link, or none: a chain from the root)."""
    hashes = [rng.getrandbits(64) for _ in range(BLOCKS_PER_STORE)]
    tokens = [rng.randrange(150_000) for _ in range(16 * BLOCKS_PER_STORE)]
    return BlockStored(
        block_hashes=hashes, parent_block_hash=rng.getrandbits(64) if with_parent else None,
        token_ids=msgspec.Raw(msgspec.msgpack.encode(tokens)), block_size=16,
        medium="GPU", group_idx=0, kv_cache_spec_kind="full_attention",
        extra_keys=[None] * BLOCKS_PER_STORE)


def build_frames(n_batches: int, seed: int = 7, ts_step: float = 0.01) -> tuple[list[list[bytes]], int]:
    rng = random.Random(seed)
    resident: list[int] = []
    frames, events = [], 0
    for seq in range(n_batches):
        batch_events = []
        for _ in range(STORES_PER_BATCH):
            batch_events.append(stored_event(rng))
            resident.extend(batch_events[-1].block_hashes)
        for _ in range(min(REMOVALS_PER_BATCH, len(resident) - 64)):
            victim = resident.pop(rng.randrange(len(resident)))
            batch_events.append(BlockRemoved(block_hashes=[victim], medium="GPU", group_idx=0))
        events += len(batch_events)
        payload = msgspec.msgpack.encode(EventBatch(ts=1e9 + seq * ts_step, events=batch_events, dp_rank=0))
        frames.append([b"kv@pod@model", seq.to_bytes(8, "big"), payload])
    return frames, events


def stage_decode(frames):
    for f in frames:
        decode_batch(f[2])


def stage_read(frames):
    from kvmiss.collectors.frames import scan_batch
    for f in frames:
        scan_batch(f[2])


def stage_stream(frames):
    stream = WorkerStream("w0", replay=True)
    for i, f in enumerate(frames):
        stream.on_live(parse_live(f), i * 0.01)


def stage_index(frames):
    stream = WorkerStream("w0", replay=True)
    index = ResidencyIndex(["w0"])
    for i, f in enumerate(frames):
        for action in stream.on_live(parse_live(f), i * 0.01):
            if action.__class__ is Apply:
                index.apply(action.batch)


def stage_fleet(frames):
    index = ResidencyIndex(["w0"])

    def sink(worker, action):
        if action.__class__ is Apply:
            index.apply(action.batch)

    fleet = Fleet([WorkerSpec(id="w0", endpoint="tcp://127.0.0.1:5557", replay_endpoint="tcp://127.0.0.1:5558")], sink)
    for i, f in enumerate(frames):
        fleet.on_message("w0", SUB, f, i * 0.01)


def best_of(fn, frames, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn(frames)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--stages", default="", help="comma-separated stage name prefixes to run (default: all)")
    args = parser.parse_args()
    frames, events = build_frames(args.batches)
    print(f"{args.batches} batches, {events} block events "
          f"({events / args.batches:.1f} per batch, {STORES_PER_BATCH} stores x {BLOCKS_PER_STORE} blocks + removals)")
    from kvmiss.collectors.frames import READER_COMPILED
    stages = [("decode only", stage_decode)] + ([("read only (compiled)", stage_read)] if READER_COMPILED else [])
    wanted = [w.strip() for w in args.stages.split(",") if w.strip()]
    for name, fn in (*stages, ("+ stream continuity", stage_stream),
                     ("+ index apply", stage_index), ("fleet + index", stage_fleet)):
        if wanted and not any(name.lstrip("+ ").startswith(w) for w in wanted):
            continue
        s = best_of(fn, frames, args.repeat)
        print(f"{name:<22} {events / s:>12,.0f} block events/s {args.batches / s:>10,.0f} batches/s")


if __name__ == "__main__":
    main()
