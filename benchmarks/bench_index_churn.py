"""The residency index under fleet churn: memory must follow retention, not the number of
workers that ever joined.

    .venv/bin/python benchmarks/bench_index_churn.py [--cycles 12000] [--retention 30] [--live 5]

One static worker publishes a batch a second (a store, and a removal of the block stored
ten seconds before); every second a new worker joins (a `FleetChange`), publishes three
batches and, ``--live`` seconds later, departs; `ResidencyIndex.prune` runs every ten
seconds. Prints, at checkpoints, the Python heap the index holds (tracemalloc), its epoch
views, tracked workers, membership spans and remembered released ids, and the time
`apply_fleet_change` and `prune` take per call.
"""

from __future__ import annotations

import argparse
import time
import tracemalloc
from array import array

from kvmiss.enricher.core.index import ResidencyIndex
from kvmiss.schemas.config import WorkerSpec
from kvmiss.schemas.events import BlockRemoved, BlockStored
from kvmiss.schemas.fleet import FleetChange
from kvmiss.schemas.stream import AppliedBatch, RunStart


def batch(worker: str, epoch: int, seq: int, ts: float, events: list) -> AppliedBatch:
    return AppliedBatch(worker=worker, epoch=epoch, seq=seq, ts=ts, recv_ts=ts, events=events,
                        run_start_seq=0, run_start=RunStart.EPOCH_START)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cycles", type=int, default=12_000)
    parser.add_argument("--retention", type=float, default=30.0)
    parser.add_argument("--live", type=int, default=5, help="seconds a joined worker stays")
    args = parser.parse_args()
    change_ns = array("q", bytes(8 * args.cycles))  # allocated before tracing: not counted
    prune_ns = array("q", bytes(8 * (args.cycles // 10 + 1)))
    tracemalloc.start()
    index = ResidencyIndex(["static"], retention_s=args.retention)
    checkpoints = {args.cycles // 6, args.cycles // 3, 2 * args.cycles // 3, args.cycles - 1}
    print(f"{args.cycles:,} join/depart cycles, one a second, each worker a member for {args.live} s; "
          f"retention {args.retention:.0f} s")
    for i in range(args.cycles):
        now = float(i)
        events = [BlockStored(block_hashes=[10**9 + i], block_size=16)]
        if i >= 10:
            events.append(BlockRemoved(block_hashes=[10**9 + i - 10]))
        index.apply(batch("static", 0, i, now, events))
        worker = f"w{i}"
        joined = FleetChange(at=now, source="file", joined=(
            WorkerSpec(id=worker, endpoint=f"tcp://10.0.0.{i % 250}:{5000 + i % 50}"),))
        departed = (f"w{i - args.live}",) if i >= args.live else ()
        t0 = time.perf_counter_ns()
        index.apply_fleet_change(joined)
        if departed:
            index.apply_fleet_change(FleetChange(at=now, source="file", departed=departed))
        change_ns[i] = time.perf_counter_ns() - t0
        epoch = index.next_epoch(worker)
        for seq in range(3):
            index.apply(batch(worker, epoch, seq, now + seq * 0.1,
                              [BlockStored(block_hashes=[i * 10 + seq], block_size=16)]))
        if i % 10 == 0:
            t0 = time.perf_counter_ns()
            index.prune(now)
            prune_ns[i // 10] = time.perf_counter_ns() - t0
        if i in checkpoints:
            heap = tracemalloc.get_traced_memory()[0]
            print(f"cycle {i + 1:>6,}: heap {heap / 1e6:.2f} MB, views {index.view_count}, tracked "
                  f"{len(index.tracked)}, spans {index.membership.span_count}, released ids "
                  f"{len(index.membership.released)}")
    tracemalloc.stop()
    change_ns, prune_ns = sorted(change_ns), sorted(prune_ns)
    print(f"apply_fleet_change (join + departure): p50 {change_ns[len(change_ns) // 2] / 1e3:.1f} us, "
          f"max {change_ns[-1] / 1e3:.1f} us; prune every 10 s: p50 {prune_ns[len(prune_ns) // 2] / 1e3:.1f} us, "
          f"max {prune_ns[-1] / 1e3:.1f} us")


if __name__ == "__main__":
    main()
