"""Retention pruning over a long run: what a dropped record may and may not cost.

Found by the soak (benchmarks/soak.py, RESULTS.md "Soak"): kvmiss keeps a Bloom filter of
blocks whose closed residency records retention dropped (`EpochResidency.pruned`, 2^20 bits per
worker lifetime, never reset). A busy engine evicts hundreds of blocks a second, so the
filter fills within minutes and answers "maybe" for most blocks.

* On the *chosen* worker that "maybe" is rightly an honest unknown: without the record,
  "never stored" (no_match) cannot be told from "stored and evicted long ago" (spec rule 5).
* On *other* workers (routing) and offload tiers the question is only whether the block was
  held at the lookup time t. A dropped record is an interval closed before the retention
  horizon, and t is after it (earlier lookups are "aged out" anyway), so a dropped record
  cannot have held the block at t. Treating it as "maybe held" made every label below
  routing_miss unknown_history once any other worker's filter saturated.
"""

from __future__ import annotations

import random

from kvmiss.enricher.core.aged_out import AgedOutFilter
from kvmiss.enricher.core.attribution import Attributor
from kvmiss.enricher.core.index import ResidencyIndex
from kvmiss.schemas.attribution import Label, RequestFacts
from kvmiss.schemas.events import BlockRemoved, BlockStored
from kvmiss.schemas.stream import AppliedBatch, RunStart

H, K = 0x1111_0000_0000_0001, 0x2222_0000_0000_0002


def batch(worker: str, seq: int, *events) -> AppliedBatch:
    """seq n of an epoch that began at seq 0, stamped at engine time n seconds."""
    return AppliedBatch(worker=worker, epoch=0, seq=seq, ts=float(seq), recv_ts=float(seq), events=list(events),
                        run_start_seq=0, run_start=RunStart.EPOCH_START, gap_from_seq=None, gap_to_seq=None,
                        instance=None, epoch_certain=True)


def store(*hashes: int) -> BlockStored:
    return BlockStored(block_hashes=list(hashes), parent_block_hash=None, block_size=16)


def remove(*hashes: int) -> BlockRemoved:
    return BlockRemoved(block_hashes=list(hashes))


def facts(worker: str, t: float, first_miss: int) -> RequestFacts:
    return RequestFacts(prompt_tokens=49, cached_tokens=16, block_size=16, worker=worker, lookup_time=t,
                        block_hashes=[7, first_miss, 9])


def build() -> tuple[ResidencyIndex, Attributor]:
    """w1 held H from seq 1 to seq 3; w0 stores K at seq 95; both step once a second to 100.
    Retention 30 s, pruned at engine time 100: w1's record of H (closed at ts 3) is dropped."""
    index = ResidencyIndex(["w0", "w1"], retention_s=30.0)
    for seq in range(101):
        index.apply(batch("w0", seq, *([store(K)] if seq == 95 else [])))
        events = [store(H)] if seq == 1 else [remove(H)] if seq == 3 else []
        index.apply(batch("w1", seq, *events))
    assert index.prune(100.0) == 1
    assert H in index.current["w1"].pruned and index.current["w1"].horizon_ts == 70.0
    return index, Attributor(index)


def test_a_record_pruned_on_another_worker_does_not_block_proofs_on_the_chosen_one():
    _, attributor = build()
    # H was on w1 long before the horizon, never on w0: routing is ruled out, w0 never had it.
    assert attributor.attribute(facts("w0", 90.5, H)).label is Label.NO_MATCH
    # K resident on w0 at t; w1's dropped record of another block changes nothing.
    assert attributor.attribute(facts("w0", 97.5, K)).label is Label.RESIDENT_MISS


def test_a_record_pruned_on_the_chosen_worker_is_still_an_honest_unknown():
    _, attributor = build()
    verdict = attributor.attribute(facts("w1", 90.5, H))  # evicted long ago, or never stored?
    assert verdict.label is Label.UNKNOWN_HISTORY and verdict.history.value == "aged_out"
    # and before the horizon nothing is provable anywhere
    assert attributor.attribute(facts("w0", 60.5, H)).label is Label.UNKNOWN_HISTORY


def test_the_pruned_filter_stays_accurate_at_a_busy_engines_eviction_rate():
    """At 800 evictions/s (a busy engine) retention drops 200k blocks in ~4 min and 400k in
    ~8 min; a fixed 2^20-bit filter answered "maybe" for 5 % and then 25 % of blocks never
    dropped (turning no_match into aged-out unknowns). The scalable filter stays below 1 %."""
    rng = random.Random(1)
    pruned = AgedOutFilter()
    rates = {}
    added = 0
    for n in (100_000, 200_000, 400_000):
        while added < n:
            pruned.add(rng.getrandbits(64))
            added += 1
        rates[n] = sum(rng.getrandbits(64) in pruned for _ in range(5000)) / 5000
    assert all(rate < 0.01 for rate in rates.values()), rates