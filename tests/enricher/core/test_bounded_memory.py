"""The residency index keeps a steady state at a steady state: its memory depends on the fleet
and the retention window (and the aged-out horizon), not on how long the engines have run.

Engine-time driven: a simulated engine steps on its own clock, so an hour of engine time
passes in seconds; the index is pruned as the service prunes it (every engine second, in
shares: enricher/service/handoff.py). The shape is the one that exposed the staircase: one
worker, 4,096 resident blocks, 800 blocks stored and 800 removed per engine second,
retention 30 s (5 steps/s of 160 blocks each: the same eviction rate in a tenth of the
batches). Before the aged-out filter had a horizon, this index's traced memory doubled in
steps for as long as the run lasted (2.2 MB at 10 min, 3.3 at 15, 5.4 at 30).
"""

from __future__ import annotations

import collections
import random
import tracemalloc

from kvmiss.enricher.core.aged_out import AgedOutFilter
from kvmiss.enricher.core.attribution import Attributor
from kvmiss.enricher.core.evidence import gather
from kvmiss.enricher.core.index import ResidencyIndex
from kvmiss.schemas.attribution import History, Label, Presence, RequestFacts, WindowStart
from kvmiss.schemas.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvmiss.schemas.stream import AppliedBatch, RunStart

PRUNE_SHARE = 4096  # retention-queue entries per prune call, as the service takes them


class SteadyEngine:
    """One worker at a steady state: every step stores ``per_step`` new blocks and removes
    the chain stored ``resident // per_step`` steps earlier. ``gap_every``: start a new run
    (after a hole) every that many steps; ``clear_every``: a cache reset that often."""

    def __init__(self, index: ResidencyIndex, *, hz: int = 5, per_step: int = 160, resident: int = 4096,
                 gap_every: int = 0, clear_every: int = 0, worker: str = "w0", seed: int = 1):
        self.index, self.hz, self.per_step, self.resident = index, hz, per_step, resident
        self.gap_every, self.clear_every, self.worker = gap_every, clear_every, worker
        self.rng = random.Random(seed)
        self.chains: collections.deque[list[int]] = collections.deque()
        self.removed: collections.deque[tuple[float, list[int]]] = collections.deque(maxlen=600)
        self.seq, self.run_start, self.start_kind, self.gap = 0, 0, RunStart.EPOCH_START, (None, None)
        self.last_clear_seq = -1

    @property
    def ts(self) -> float:
        return self.seq / self.hz

    def run_until(self, until_ts: float) -> None:
        index, hz = self.index, self.hz
        while self.ts < until_ts:
            seq, ts = self.seq, self.ts
            if self.gap_every and seq and seq % self.gap_every == 0:
                seq = self.seq = seq + 1  # a hole of one batch: a new run after it
                ts = self.ts
                self.run_start, self.start_kind, self.gap = seq, RunStart.AFTER_GAP, (seq - 1, seq - 1)
            chain = [self.rng.getrandbits(64) for _ in range(self.per_step)]
            events: list = [BlockStored(block_hashes=chain, parent_block_hash=None, block_size=16)]
            self.chains.append(chain)
            if len(self.chains) * self.per_step > self.resident:
                old = self.chains.popleft()
                events.append(BlockRemoved(block_hashes=old))
                self.removed.append((ts, old))
            if self.clear_every and seq and seq % self.clear_every == 0:
                events.append(AllBlocksCleared())
                self.chains.clear()
                self.last_clear_seq = seq
            index.apply(AppliedBatch(worker=self.worker, epoch=0, seq=seq, ts=ts, recv_ts=ts, events=events,
                                     run_start_seq=self.run_start, run_start=self.start_kind,
                                     gap_from_seq=self.gap[0], gap_to_seq=self.gap[1]))
            if seq % hz == 0:  # once per engine second, in shares, as the service does
                index.prune(ts, PRUNE_SHARE)
                while index.prune_pending:
                    index.prune(ts, PRUNE_SHARE)
            self.seq += 1


def sizes(index: ResidencyIndex) -> dict[str, int]:
    view = index.current["w0"]
    return {"filter_bytes": view.pruned.bytes_used, "filter_records": view.pruned.count,
            "log": len(view.log_seq), "runs": len(view.runs), "clears": len(view.clears),
            "same_step": len(view.same_step_copies), "traced": tracemalloc.get_traced_memory()[0]}


def test_steady_eviction_keeps_the_index_flat_after_warm_up():
    """Horizon 180 s: warm-up is retention + horizon + one generation (~4.5 min); over the
    next 10 min of engine time nothing may grow. Without a horizon the filter doubled in this
    run (0.9 M records remembered at its end, 2 MB, and growing)."""
    index = ResidencyIndex(["w0"], retention_s=30.0, aged_out_horizon_s=180.0)
    engine = SteadyEngine(index)
    tracemalloc.start()
    try:
        engine.run_until(5 * 60)
        warm = sizes(index)
        samples = []
        for minute in range(6, 17):
            engine.run_until(minute * 60)
            samples.append(sizes(index))
    finally:
        tracemalloc.stop()
    # Remembered: at most 800 evictions/s over the horizon and one generation (+ a prune share).
    assert all(s["filter_records"] <= 800 * 180 * 1.25 + 2 * PRUNE_SHARE for s in samples), samples[-1]
    assert max(s["filter_bytes"] for s in samples) == warm["filter_bytes"]
    second_half = samples[len(samples) // 2:]
    growth = max(s["traced"] for s in second_half) - second_half[0]["traced"]
    assert growth < 64 * 1024, (growth, samples[-1])
    assert max(s["log"] for s in samples) <= 31 * engine.hz + 2 * engine.hz
    assert index.current["w0"].pruned.forgotten > 0


def test_inside_the_horizon_every_dropped_block_is_still_remembered():
    """No false negatives inside the horizon: every block removed between the retention
    horizon and the aged-out horizon before it answers `in pruned`, however the generations
    rotated; and what was forgotten closed before `forgotten_through`."""
    index = ResidencyIndex(["w0"], retention_s=30.0, aged_out_horizon_s=120.0)
    engine = SteadyEngine(index, hz=5, per_step=40, resident=1024)
    engine.removed = collections.deque()  # every removal, with its engine time
    engine.run_until(20 * 60)
    view, now = index.current["w0"], engine.ts
    retention_horizon = view.horizon_ts
    kept = [h for ts, chain in engine.removed if now - 1 - 30 - 120 <= ts < retention_horizon - 1 for h in chain]
    assert len(kept) > 20_000  # 200 evictions/s over the 120 s horizon
    assert all(h in view.pruned for h in kept)
    forgotten = view.pruned.forgotten_through
    assert forgotten is not None and now - 30 - 120 * 1.25 - 2 <= forgotten <= now - 30 - 120
    # the generations before it were dropped: records removed long before are mostly gone
    early = [h for ts, chain in engine.removed if ts < forgotten - 60 for h in chain][:20_000]
    assert sum(h in view.pruned for h in early) < 0.02 * len(early)


def facts(t: float, first_miss: int) -> RequestFacts:
    return RequestFacts(prompt_tokens=49, cached_tokens=16, block_size=16, worker="w0", lookup_time=t,
                        block_hashes=[7, first_miss, 9])


def test_past_the_horizon_an_absent_block_is_no_recent_match_with_its_window_never_unknown():
    """ATTRIBUTION.md, `no_match`: absence proven from the retention horizon is "no recent
    match", the window reported. Within the horizon a dropped block stays aged-out (rule 5);
    a block never stored is absent since what the filter forgot, not unknown."""
    index = ResidencyIndex(["w0"], retention_s=30.0, aged_out_horizon_s=120.0)
    engine = SteadyEngine(index, hz=5, per_step=40, resident=1024)
    engine.run_until(10 * 60)
    t = engine.ts - 2.0
    never_stored = 0x5A5A_0000_0000_0001
    ev = gather(index, facts(t, never_stored))
    forgotten = index.current["w0"].pruned.forgotten_through
    assert ev.history is History.CONTINUOUS and ev.presence is Presence.ABSENT
    assert ev.window_start is WindowStart.HORIZON and ev.window_start_ts == forgotten
    verdict = Attributor(index).attribute(facts(t, never_stored))
    assert verdict.label is Label.NO_MATCH and "no recent match" in verdict.reason
    recently_dropped = engine.removed[-200][1][0]  # removed ~45 s ago: record pruned, remembered
    assert gather(index, facts(t, recently_dropped)).history is History.AGED_OUT
    # Before anything was forgotten the same question is a plain no_match from the epoch start.
    young = ResidencyIndex(["w0"], retention_s=30.0, aged_out_horizon_s=120.0)
    SteadyEngine(young, hz=5, per_step=40, resident=1024).run_until(100)
    ev = gather(young, facts(98.0, never_stored))
    assert ev.window_start is WindowStart.EPOCH_START and young.current["w0"].pruned.forgotten_through is None


def test_runs_and_clears_of_a_long_lifetime_are_bounded_by_the_log():
    """A hole every 80 s and a cache reset every 50 s for an hour of engine time: the run
    and clear lists keep what the retained log can ask for (plus the first run and the
    latest clear before the log), not one entry per hole or reset ever seen."""
    index = ResidencyIndex(["w0"], retention_s=30.0, aged_out_horizon_s=300.0)
    engine = SteadyEngine(index, hz=5, per_step=40, resident=1024, gap_every=400, clear_every=250)
    engine.run_until(3600)
    view = index.current["w0"]
    assert len(view.runs) <= 4 and len(view.clears) <= 3, (len(view.runs), len(view.clears))
    assert view.runs[0].start is RunStart.EPOCH_START  # the lifetime's first run is kept
    # A hole quarantines the run until a reset; after the reset the run proves again, and it
    # still does once the reset has left the log (kept: the run's known-empty point).
    while not (engine.last_clear_seq > engine.run_start and engine.seq - engine.last_clear_seq >= 15):
        engine.run_until(engine.ts + 1)
    assert gather(index, facts(engine.ts - 0.5, engine.chains[-6][0])).presence is Presence.RESIDENT
    clear_seq, hole_due = engine.last_clear_seq, engine.run_start + engine.gap_every
    engine.run_until(min(clear_seq / engine.hz + 40, hole_due / engine.hz - 1))
    assert view.log_seq[0] > clear_seq and view.clears[-1][0] == clear_seq and len(view.clears) <= 3
    ev = gather(index, facts(engine.ts - 0.5, engine.chains[-6][0]))
    assert ev.history is History.CONTINUOUS and ev.presence is Presence.RESIDENT


def test_the_filter_forgets_whole_generations_only_past_the_horizon():
    pruned = AgedOutFilter(horizon_s=100.0)
    rng = random.Random(3)
    by_time = {}
    for at in range(0, 400, 5):
        hashes = [rng.getrandbits(64) for _ in range(500)]
        pruned.add_many(hashes, float(at))
        pruned.forget(float(at))
        by_time[at] = hashes
    assert all(h in pruned for at, hs in by_time.items() if at >= 395 - 100 for h in hs)
    assert pruned.forgotten_through is not None and 395 - 125 <= pruned.forgotten_through < 395 - 100
    assert pruned.count == sum(len(hs) for at, hs in by_time.items() if at > pruned.forgotten_through)
    assert pruned.forgotten + pruned.count == 500 * len(by_time)


def test_a_window_group_block_forgotten_past_the_horizon_is_window_limit_over_the_remembered_window():
    """Hybrid: the window group's copy of Q's shared blocks was evicted long ago. Inside the
    aged-out horizon that is aged out (it may have been evicted, not never stored); once
    forgotten it is window_limit with the window it is proven over (`horizon`), not "since
    the epoch start"."""
    from fleet_builders import FULL, WINDOW, WorkerFeed, chain_request, full_stored, group_removed, window_stored

    p = [0xA000 + i for i in range(6)]
    q = p[:2] + [0xB000, 0xB001]
    index, a = ResidencyIndex(retention_s=5.0, aged_out_horizon_s=10.0), WorkerFeed("A")
    events = {3: [window_stored(p[0], p[1]), full_stored(*p)], 4: group_removed(WINDOW, p[0], p[1])}

    def judge_at(seq: int):
        return Attributor(index).attribute(chain_request("A", a.ts(seq) - 0.5, q, prompt_tokens=130, cached_tokens=0))

    for b in a.batches(range(0, 61), events):
        index.apply(b)
        index.prune(b.ts)
        if b.seq == 14:  # dropped by retention at ~9 s, remembered
            v = judge_at(14)
            assert v.label is Label.UNKNOWN_HISTORY and v.history is History.AGED_OUT, v
    assert index.views("A")[0].primary_group == FULL
    forgotten = index.views("A")[0].pruned.forgotten_through
    assert forgotten is not None
    v = judge_at(60)
    assert v.label is Label.WINDOW_LIMIT, v
    ev = gather(index, chain_request("A", a.ts(60) - 0.5, q, prompt_tokens=130, cached_tokens=0))
    assert ev.window_start is WindowStart.HORIZON and ev.window_start_ts == forgotten


def test_a_flood_of_kv_cache_group_ids_is_refused_past_the_cap_and_quarantines_until_a_clear():
    """Decodable garbage: every batch names new (medium, group) pairs. The lifetime keeps at
    most `MAX_TIERS` tables (and a bounded cache of spellings); the rest is refused, counted,
    and -- since what those events did is missing -- the worker proves nothing from that batch
    until a cache clear: its requests are unknown_history (quarantined), never a label."""
    from kvmiss.enricher.core.epoch_residency import MAX_TIERS

    index = ResidencyIndex(["w0"], retention_s=30.0, aged_out_horizon_s=120.0)
    engine = SteadyEngine(index, hz=5, per_step=40, resident=1024)
    engine.run_until(60)
    view = index.current["w0"]
    resident = engine.chains[-3][0]
    assert Attributor(index).attribute(facts(engine.ts - 0.5, resident)).label is Label.RESIDENT_MISS
    flood_seq = engine.seq
    for i in range(50):  # 50 batches x 40 events, each a new group on a new medium spelling
        index.apply(AppliedBatch(worker="w0", epoch=0, seq=engine.seq, ts=engine.ts, recv_ts=engine.ts,
                                 events=[BlockStored(block_hashes=[i * 100 + j], parent_block_hash=None, block_size=16,
                                                     medium=f"m{i}", group_idx=j) for j in range(40)],
                                 run_start_seq=0, run_start=RunStart.EPOCH_START))
        engine.seq += 1
    engine.run_until(engine.ts + 5)
    assert len(view.tiers) == MAX_TIERS and len(view._tables) <= 4 * MAX_TIERS
    assert index.anomalies[("events_refused_tiers", "w0")] == 50 * 40 - (MAX_TIERS - 1)  # (GPU group 0 was one)
    verdict = Attributor(index).attribute(facts(engine.ts - 0.5, engine.chains[-3][0]))
    assert verdict.label is Label.UNKNOWN_HISTORY and verdict.reason.startswith("quarantined"), verdict.reason
    assert (verdict.gap_from_seq, verdict.gap_to_seq) == (flood_seq + 1, flood_seq + 1)
    engine.clear_every = engine.seq + 1  # a cache reset at the next step: a known-empty point
    engine.run_until(engine.ts + 5)
    engine.clear_every = 0
    engine.run_until(engine.ts + 5)
    ev = gather(index, facts(engine.ts - 0.5, engine.chains[-3][0]))
    assert ev.history is not History.QUARANTINED, ev
