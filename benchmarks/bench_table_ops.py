"""One compiled residency table, op by op: ns per block for store, remove, `in` and as_of.

    .venv/bin/python benchmarks/bench_table_ops.py [--sizes 480000,715000] [--repeat 3]

For each size, a fresh `BlockTable` stores that many random hashes (16 per call, one batch
each, growing as it goes), answers 200,000 `in` and as_of for absent hashes (what the fleet
view asks of every other worker) and for resident ones, then removes half of those. The best
of ``--repeat`` runs is printed. With the table's 0.8 maximum load and 1.5x growth, 715,000
blocks sit just under a growth point (load 0.80, the longest probes) and 480,000 just over
one (0.53). Below the index and the Python loops: for choosing the table's load factor and
slot layout.
"""

from __future__ import annotations

import argparse
import random
import time

from kvmiss.enricher.core.residency_table import ACCELERATED, BlockTable

QUERIES = 200_000


def run(n: int, repeat: int) -> dict[str, float]:
    rng = random.Random(5)
    keys = [rng.getrandbits(64) for _ in range(n)]
    absent = [rng.getrandbits(64) for _ in range(QUERIES)]
    present = rng.sample(keys, min(n, QUERIES))
    chunks = [keys[i:i + 16] for i in range(0, n, 16)]
    victims = present[: len(present) // 2]
    gone = [victims[i:i + 16] for i in range(0, len(victims), 16)]
    best: dict[str, float] = {}
    for _ in range(repeat):
        table = BlockTable(0)
        t0 = time.perf_counter()
        for seq, chunk in enumerate(chunks):
            table.store(chunk, seq)
        t1 = time.perf_counter()
        seq, contains, as_of = len(chunks), table.__contains__, table.as_of
        for h in absent:
            contains(h)
        t2 = time.perf_counter()
        for h in absent:
            as_of(h, seq)
        t3 = time.perf_counter()
        for h in present:
            as_of(h, seq)
        t4 = time.perf_counter()
        for j, chunk in enumerate(gone):
            table.remove(chunk, seq + j, float(j))
        t5 = time.perf_counter()
        times = {"store": (t1 - t0) / n, "in (absent)": (t2 - t1) / len(absent),
                 "as_of (absent)": (t3 - t2) / len(absent), "as_of (resident)": (t4 - t3) / len(present),
                 "remove": (t5 - t4) / len(victims)}
        for name, s in times.items():
            best[name] = min(best.get(name, float("inf")), s)
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="480000,715000")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    if not ACCELERATED:
        raise SystemExit("the compiled table is not built: nothing to measure")
    for n in (int(s) for s in args.sizes.split(",")):
        best = run(n, args.repeat)
        print(f"{n:>9,} blocks: " + "  ".join(f"{name} {s * 1e9:5.0f} ns" for name, s in best.items()))


if __name__ == "__main__":
    main()
