"""Residency index memory at a steady state, over hours of engine time: flat, or a staircase?

    .venv/bin/python benchmarks/bench_steady_memory.py [--hours 2] [--hz 50] [--per-step 16]

One worker with a constant resident set (``--resident`` blocks): each engine step stores
``--per-step`` new blocks and removes as many old ones, ``--hz`` steps per engine second,
``retention_s`` 30, pruned once per engine second in shares as the service prunes
(enricher/service/handoff.py). Engine time is simulated, so hours pass in minutes. Run side
by side with the aged-out filter remembering every dropped block (``aged_out_horizon_s =
inf``, the rule before the horizon) and with the configured horizon (``--horizon``, default
the config default 3600 s). Prints tracemalloc's traced memory and the filter's size every
``--every-min`` minutes of engine time.
"""

from __future__ import annotations

import argparse
import collections
import random
import time
import tracemalloc

from kvmiss.enricher.core.index import ResidencyIndex
from kvmiss.enricher.core.residency_table import ACCELERATED
from kvmiss.schemas.events import BlockRemoved, BlockStored
from kvmiss.schemas.stream import AppliedBatch, RunStart

PRUNE_SHARE = 4096  # as enricher/service/handoff.py


def run(horizon: float, args) -> list[tuple[int, float, float, int]]:
    index = ResidencyIndex(["w0"], retention_s=30.0, aged_out_horizon_s=horizon)
    rng = random.Random(1)
    chains: collections.deque[list[int]] = collections.deque()
    rows = []
    every = int(args.every_min * 60 * args.hz)
    tracemalloc.start()
    try:
        for seq in range(int(args.hours * 3600 * args.hz) + 1):
            ts = seq / args.hz
            chain = [rng.getrandbits(64) for _ in range(args.per_step)]
            events: list = [BlockStored(block_hashes=chain, parent_block_hash=None, block_size=16)]
            chains.append(chain)
            if len(chains) * args.per_step > args.resident:
                events.append(BlockRemoved(block_hashes=chains.popleft()))
            index.apply(AppliedBatch(worker="w0", epoch=0, seq=seq, ts=ts, recv_ts=ts, events=events,
                                     run_start_seq=0, run_start=RunStart.EPOCH_START))
            if seq % args.hz == 0:
                index.prune(ts, PRUNE_SHARE)
                while index.prune_pending:
                    index.prune(ts, PRUNE_SHARE)
            if seq % every == 0 and seq:
                pruned = index.current["w0"].pruned
                rows.append((round(ts / 60), tracemalloc.get_traced_memory()[0] / 1e6, pruned.bytes_used / 1e6,
                             pruned.count))
    finally:
        tracemalloc.stop()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hours", type=float, default=2.0)
    parser.add_argument("--hz", type=int, default=50)
    parser.add_argument("--per-step", type=int, default=16)
    parser.add_argument("--resident", type=int, default=4096)
    parser.add_argument("--horizon", type=float, default=3600.0)
    parser.add_argument("--every-min", type=float, default=15.0)
    args = parser.parse_args()
    print(f"one worker, {args.resident} resident blocks, {args.per_step} stored + {args.per_step} removed per step, "
          f"{args.hz} steps/s ({args.per_step * args.hz} evictions/s), retention 30 s, {args.hours:g} h of engine "
          f"time; compiled table: {ACCELERATED}")
    results = {}
    for horizon in (float("inf"), args.horizon):
        started = time.process_time()
        results[horizon] = run(horizon, args)
        print(f"aged_out_horizon_s = {horizon:g}: {time.process_time() - started:.0f} s CPU")
    print("| engine time | traced MB, horizon inf (before) | filter MB / records | "
          f"traced MB, horizon {args.horizon:g} s | filter MB / records |")
    print("|---|---|---|---|---|")
    for before, after in zip(results[float("inf")], results[args.horizon]):
        print(f"| {before[0]} min | {before[1]:.1f} | {before[2]:.1f} / {before[3]:,} | {after[1]:.1f} | "
              f"{after[2]:.1f} / {after[3]:,} |")


if __name__ == "__main__":
    main()
