"""What the residency index proves at a lookup time: ATTRIBUTION.md's worked cases at the
evidence level, plus the timing, reference-counting, retention and fleet rules."""

from __future__ import annotations

import msgspec
from fleet_builders import PARENT, H, WorkerFeed, cleared, removed, request, stored

from kvmiss.collectors.engines import canonical_medium
from kvmiss.enricher.core.attribution import Attributor
from kvmiss.enricher.core.evidence import gather
from kvmiss.enricher.core.index import ResidencyIndex
from kvmiss.schemas.attribution import ClockOffset, History, Label, Presence, WindowStart
from kvmiss.schemas.stream import RunStart


def feed(index: ResidencyIndex, batches) -> None:
    for b in batches:
        index.apply(b)


class TestWorkedCases:
    def test_stored_at_100_removed_at_148_continuous_through_a_request_at_160_is_evicted(self):
        index, a = ResidencyIndex(), WorkerFeed("A", epoch=42)
        a.start_run(90, RunStart.JOINED)
        feed(index, a.batches(range(90, 162), {100: [stored(H)], 148: [removed(H)]}))
        ev = gather(index, request("A", a.ts(160) - 0.5))
        assert ev.history is History.CONTINUOUS and ev.presence is Presence.EVICTED
        assert (ev.stored_seq, ev.removed_seq, ev.epoch) == (100, 148, 42)
        assert ev.removed_ts == a.ts(148) and not ev.removed_by_clear

    def test_a_hole_replay_could_not_fill_makes_an_absent_block_unprovable(self):
        index, a = ResidencyIndex(), WorkerFeed("A")
        feed(index, a.batches(range(0, 201)))
        a.start_run(205, RunStart.AFTER_GAP, gap=(201, 204))
        feed(index, a.batches(range(205, 210)))
        ev = gather(index, request("A", a.ts(208) - 0.5))
        assert ev.history is History.QUARANTINED
        assert (ev.gap_from_seq, ev.gap_to_seq) == (201, 204)

    def test_a_removal_recovered_through_replay_still_proves_the_eviction(self):
        index, a = ResidencyIndex(), WorkerFeed("A")
        feed(index, a.batches(range(0, 162), {100: [stored(H)], 148: [removed(H)]}))
        ev = gather(index, request("A", a.ts(160) - 0.5))
        assert ev.presence is Presence.EVICTED and ev.history is History.CONTINUOUS

    def test_an_unrecovered_removal_leaves_the_block_unprovable(self):
        index, a = ResidencyIndex(), WorkerFeed("A")
        feed(index, a.batches(range(0, 148), {100: [stored(H)]}))
        a.start_run(149, RunStart.AFTER_GAP, gap=(148, 148))
        feed(index, a.batches(range(149, 162)))
        assert gather(index, request("A", a.ts(160) - 0.5)).history is History.QUARANTINED

    def test_a_restart_drops_the_old_epochs_residency(self):
        index, old = ResidencyIndex(), WorkerFeed("A", epoch=0)
        feed(index, old.batches(range(0, 50), {10: [stored(H)]}))
        new = WorkerFeed("A", epoch=1, ts0=old.ts(49) + 5)
        feed(index, new.batches(range(0, 10)))
        ev = gather(index, request("A", new.ts(8) - 0.5))
        assert ev.presence is Presence.ABSENT and ev.epoch == 1
        assert ev.window_start is WindowStart.EPOCH_START and ev.window_start_ts == new.ts(0)
        # A request that looked up in the old lifetime is still judged on the old view.
        assert gather(index, request("A", old.ts(30) - 0.5)).presence is Presence.RESIDENT

    def test_a_lookup_between_two_lifetimes_is_epoch_unknown(self):
        index, old = ResidencyIndex(), WorkerFeed("A", epoch=0)
        feed(index, old.batches(range(0, 5)))
        new = WorkerFeed("A", epoch=1, ts0=old.ts(4) + 10)
        feed(index, new.batches(range(0, 3)))
        assert gather(index, request("A", old.ts(4) + 3)).history is History.EPOCH_UNKNOWN

    def test_a_consumer_outage_longer_than_the_replay_window_quarantines(self):
        index, a = ResidencyIndex(), WorkerFeed("A")
        feed(index, a.batches(range(0, 20)))
        a.start_run(10_020, RunStart.AFTER_GAP, gap=(20, 10_019))
        feed(index, a.batches(range(10_020, 10_030)))
        assert gather(index, request("A", a.ts(10_025))).history is History.QUARANTINED

    def test_a_block_resident_on_another_worker_makes_a_holder(self):
        index, a, b = ResidencyIndex(), WorkerFeed("A"), WorkerFeed("B")
        feed(index, a.batches(range(0, 20)))
        feed(index, b.batches(range(0, 20), {5: [stored(H)]}))
        ev = gather(index, request("A", a.ts(15) - 0.5))
        assert [h.worker for h in ev.holders] == ["B"]
        assert ev.presence is Presence.ABSENT


class TestLookupStepTiming:
    def test_a_store_in_the_lookup_step_happened_after_the_lookup(self):
        index, a = ResidencyIndex(), WorkerFeed("A")
        feed(index, a.batches(range(0, 12), {10: [stored(H)]}))
        ev = gather(index, request("A", a.ts(10) - 0.5))  # the request's own recompute
        assert ev.presence is Presence.ABSENT

    def test_a_removal_in_the_lookup_step_happened_before_the_lookup(self):
        index, a = ResidencyIndex(), WorkerFeed("A")
        feed(index, a.batches(range(0, 12), {3: [stored(H)], 10: [removed(H)]}))
        ev = gather(index, request("A", a.ts(10) - 0.5))
        assert ev.presence is Presence.EVICTED and ev.removed_seq == 10

    def test_a_restore_after_the_lookup_does_not_hide_the_earlier_eviction(self):
        index, a = ResidencyIndex(), WorkerFeed("A")
        feed(index, a.batches(range(0, 20), {3: [stored(H)], 7: [removed(H)], 12: [stored(H)]}))
        ev = gather(index, request("A", a.ts(12) - 0.5))
        assert ev.presence is Presence.EVICTED and (ev.stored_seq, ev.removed_seq) == (3, 7)

    def test_history_that_has_not_reached_the_lookup_is_lagging(self):
        index, a = ResidencyIndex(), WorkerFeed("A")
        feed(index, a.batches(range(0, 5)))
        assert gather(index, request("A", a.ts(4) + 0.1)).history is History.LAGGING

    def test_a_holder_removed_in_the_step_containing_the_lookup_is_not_proof(self):
        index, a, b = ResidencyIndex(), WorkerFeed("A"), WorkerFeed("B", ts0=1000.25)
        feed(index, a.batches(range(0, 20)))
        feed(index, b.batches(range(0, 20), {2: [stored(H)], 10: [removed(H)]}))
        assert gather(index, request("A", b.ts(10) - 0.5)).holders == ()
        assert len(gather(index, request("A", b.ts(9) - 0.5)).holders) == 1


class TestCopiesAndTiers:
    def test_one_removal_of_two_copies_leaves_the_block_resident(self):
        # (the second copy has its parent: a recompute, never a re-announcement, which has none)
        index, a = ResidencyIndex(), WorkerFeed("A")
        feed(index, a.batches(range(0, 10), {1: [stored(H)], 2: [stored(H, parent=PARENT)], 3: [removed(H)]}))
        assert gather(index, request("A", a.ts(8))).presence is Presence.RESIDENT

    def test_tiers_count_copies_separately_from_the_gpu(self):
        index, a = ResidencyIndex(), WorkerFeed("A")
        feed(index, a.batches(range(0, 10), {
            1: [stored(H), stored(H, medium="cpu")],
            2: [removed(H)],
        }))
        ev = gather(index, request("A", a.ts(8)))
        assert ev.presence is Presence.EVICTED
        assert [t.medium for t in ev.tiers] == ["CPU"]

    def test_sglang_and_connector_medium_spellings_are_canonical(self):
        assert [canonical_medium(m) for m in (None, "GPU", "cpu", "CPU_PINNED", "DISK", "STORAGE", "EXTERNAL", "nvme")] == [
            "GPU", "GPU", "CPU", "CPU", "STORAGE", "STORAGE", "EXTERNAL", "NVME"]

    def test_a_removal_of_a_block_stored_before_our_history_is_not_a_provable_store(self):
        index, a = ResidencyIndex(), WorkerFeed("A")
        a.start_run(50, RunStart.JOINED)
        feed(index, a.batches(range(50, 60), {52: [removed(H)]}))
        ev = gather(index, request("A", a.ts(58)))
        assert ev.history is History.GAP and (ev.gap_from_seq, ev.gap_to_seq) == (0, 49)


class TestKnownEmptyPoints:
    def test_an_observed_clear_is_a_known_empty_point_and_ends_quarantine(self):
        index, a = ResidencyIndex(), WorkerFeed("A")
        a.start_run(100, RunStart.AFTER_GAP, gap=(0, 99))
        feed(index, a.batches(range(100, 120), {105: [cleared()]}))
        ev = gather(index, request("A", a.ts(115)))
        assert ev.history is History.CONTINUOUS and ev.presence is Presence.ABSENT
        assert ev.window_start is WindowStart.CLEAR and ev.window_start_ts == a.ts(105)

    def test_a_clear_evicts_every_resident_block(self):
        index, a = ResidencyIndex(), WorkerFeed("A")
        feed(index, a.batches(range(0, 20), {2: [stored(H, PARENT)], 9: [cleared()]}))
        ev = gather(index, request("A", a.ts(15)))
        assert ev.presence is Presence.EVICTED and ev.removed_by_clear and ev.removed_seq == 9

    def test_a_mid_epoch_join_without_a_clear_cannot_prove_absence(self):
        index, a = ResidencyIndex(), WorkerFeed("A")
        a.start_run(500, RunStart.JOINED)
        feed(index, a.batches(range(500, 520)))
        ev = gather(index, request("A", a.ts(510)))
        assert ev.history is History.GAP and ev.gap_to_seq == 499

    def test_an_unverified_epoch_proves_nothing(self):
        index, a = ResidencyIndex(), WorkerFeed("A")
        a.epoch_certain = False
        feed(index, a.batches(range(0, 10), {2: [stored(H)]}))
        assert gather(index, request("A", a.ts(5))).history is History.EPOCH_UNKNOWN


class TestRetention:
    def test_a_dropped_eviction_record_answers_aged_out_not_absent(self):
        index, a = ResidencyIndex(retention_s=50), WorkerFeed("A")
        feed(index, a.batches(range(0, 200), {3: [stored(H)], 7: [removed(H)]}))
        assert index.prune(now_ts=a.ts(199)) >= 1
        ev = gather(index, request("A", a.ts(190)))
        assert ev.history is History.AGED_OUT and ev.window_start_ts == a.ts(149)

    def test_opting_in_turns_aged_out_into_no_recent_match_with_the_window(self):
        index, a = ResidencyIndex(retention_s=50), WorkerFeed("A")
        feed(index, a.batches(range(0, 200), {3: [stored(H)], 7: [removed(H)]}))
        index.prune(now_ts=a.ts(199))
        ev = gather(index, request("A", a.ts(190)), aged_out_as_recent_match=True)
        assert ev.presence is Presence.ABSENT and ev.window_start is WindowStart.HORIZON

    def test_blocks_never_stored_stay_provably_absent_after_pruning(self):
        index, a = ResidencyIndex(retention_s=50), WorkerFeed("A")
        feed(index, a.batches(range(0, 200), {3: [stored(PARENT)], 7: [removed(PARENT)]}))
        index.prune(now_ts=a.ts(199))
        ev = gather(index, request("A", a.ts(190)))
        assert ev.presence is Presence.ABSENT and ev.window_start is WindowStart.EPOCH_START

    def test_pruning_in_bounded_shares_ends_where_one_whole_prune_does(self):
        """The service prunes a share per drain (a bounded pause): the shares add up to one
        whole prune -- the same records gone, the same evidence after."""
        whole, shared = ResidencyIndex(retention_s=50), ResidencyIndex(retention_s=50)
        a, b = WorkerFeed("A"), WorkerFeed("B")
        plan = {s: [stored(H + s)] for s in range(0, 150, 3)}
        plan.update({s + 1: [removed(H + s)] for s in range(0, 150, 3)})
        for index in (whole, shared):
            feed(index, a.batches(range(0, 200), plan))
            feed(index, b.batches(range(0, 200), {2: [stored(H)], 9: [removed(H)]}))
        total = whole.prune(now_ts=a.ts(199))
        assert not whole.prune_pending and total > 7
        shares = [shared.prune(now_ts=a.ts(199), limit=7)]
        while shared.prune_pending:
            shares.append(shared.prune(now_ts=a.ts(199), limit=7))
        assert sum(shares) == total and len(shares) > 2
        for worker in ("A", "B"):
            w, s = whole.current[worker], shared.current[worker]
            assert (w.horizon_ts, w.log_base, list(w.log_seq)) == (s.horizon_ts, s.log_base, list(s.log_seq))
            assert all((h in w.pruned) == (h in s.pruned) for h in [H + k for k in range(200)])
        for t in (a.ts(160), a.ts(190)):
            assert gather(whole, request("A", t)) == gather(shared, request("A", t))
            assert gather(whole, request("B", t)) == gather(shared, request("B", t))

    def test_a_lookup_older_than_the_horizon_is_aged_out(self):
        index, a = ResidencyIndex(retention_s=50), WorkerFeed("A")
        feed(index, a.batches(range(0, 200)))
        index.prune(now_ts=a.ts(199))
        assert gather(index, request("A", a.ts(20))).history is History.AGED_OUT

    def test_resident_blocks_survive_pruning(self):
        index, a = ResidencyIndex(retention_s=50), WorkerFeed("A")
        feed(index, a.batches(range(0, 200), {3: [stored(H)]}))
        index.prune(now_ts=a.ts(199))
        assert gather(index, request("A", a.ts(190))).presence is Presence.RESIDENT


class TestWorkersAndEpochs:
    def test_an_untracked_or_missing_worker(self):
        index = ResidencyIndex(["A"])
        assert gather(index, request("Z", 1.0)).history is History.UNTRACKED
        assert gather(index, request(None, 1.0)).history is History.UNTRACKED
        assert gather(index, request("A", 1.0)).history is History.LAGGING

    def test_an_instance_hint_selects_the_lifetime_and_an_unknown_one_is_epoch_unknown(self):
        index = ResidencyIndex()
        old, new = WorkerFeed("A", 0, instance="pod-1"), WorkerFeed("A", 1, ts0=2000, instance="pod-2")
        feed(index, old.batches(range(0, 10), {2: [stored(H)]}))
        feed(index, new.batches(range(0, 10)))
        assert gather(index, request("A", old.ts(5), instance_hint="pod-1")).presence is Presence.RESIDENT
        assert gather(index, request("A", old.ts(5), instance_hint="pod-9")).history is History.EPOCH_UNKNOWN

    def test_a_lookup_just_before_a_fresh_epochs_first_batch_belongs_to_it(self):
        index, a = ResidencyIndex(), WorkerFeed("A")
        feed(index, a.batches(range(0, 3), {0: [stored(H)]}))
        ev = gather(index, request("A", a.ts(0) - 0.01))
        assert ev.presence is Presence.ABSENT and ev.window_start is WindowStart.EPOCH_START


def test_two_copies_stored_in_one_batch_need_two_removals():
    index, a = ResidencyIndex(), WorkerFeed("A")
    feed(index, a.batches(range(0, 10), {1: [stored(H), stored(H, parent=PARENT)], 3: [removed(H)]}))
    assert gather(index, request("A", a.ts(8))).presence is Presence.RESIDENT
    feed(index, a.batches(range(10, 20), {12: [removed(H)]}))
    assert gather(index, request("A", a.ts(18))).presence is Presence.EVICTED


def test_every_interval_of_a_block_stored_and_evicted_three_times_is_judged_at_its_time():
    index, a = ResidencyIndex(), WorkerFeed("A")
    events = {2: [stored(H)], 5: [removed(H)], 8: [stored(H)], 11: [cleared()],
              14: [stored(H)], 17: [removed(H)]}
    feed(index, a.batches(range(0, 25), events))
    expected = {4: (Presence.RESIDENT, 2, None), 7: (Presence.EVICTED, 2, 5),
                10: (Presence.RESIDENT, 8, None), 13: (Presence.EVICTED, 8, 11),
                16: (Presence.RESIDENT, 14, None), 20: (Presence.EVICTED, 14, 17)}
    for seq, (presence, stored_seq, removed_seq) in expected.items():
        ev = gather(index, request("A", a.ts(seq) - 0.5))
        assert (ev.presence, ev.stored_seq, ev.removed_seq) == (presence, stored_seq, removed_seq), seq
    assert gather(index, request("A", a.ts(13) - 0.5)).removed_by_clear


def test_pruning_the_oldest_interval_keeps_the_newer_ones_exact():
    index, a = ResidencyIndex(retention_s=30), WorkerFeed("A")
    feed(index, a.batches(range(0, 100), {2: [stored(H)], 5: [removed(H)],
                                          80: [stored(H)], 85: [removed(H)]}))
    index.prune(now_ts=a.ts(99))
    ev = gather(index, request("A", a.ts(90)))
    assert ev.presence is Presence.EVICTED and (ev.stored_seq, ev.removed_seq) == (80, 85)
    assert gather(index, request("A", a.ts(75))).history is History.AGED_OUT


class TestSameStepCopies:
    """A request that skips the prefix cache can store a block earlier in the very step in
    which another request looks it up and misses (found by the demo's ground truth)."""

    def test_two_copies_stored_in_the_lookup_step_make_absence_unprovable(self):
        index, a = ResidencyIndex(), WorkerFeed("A")
        feed(index, a.batches(range(0, 4), {1: [stored(H), stored(H)]}))
        ev = gather(index, request("A", a.ts(1) - 0.5))
        assert ev.same_step_copies and ev.presence is Presence.UNKNOWN

    def test_and_an_earlier_eviction_no_longer_proves_the_cause(self):
        index, a = ResidencyIndex(), WorkerFeed("A")
        feed(index, a.batches(range(0, 9), {1: [stored(H)], 3: [removed(H)], 6: [stored(H), stored(H)]}))
        ev = gather(index, request("A", a.ts(6) - 0.5))
        assert ev.same_step_copies and ev.presence is Presence.UNKNOWN

    def test_a_request_that_read_the_cache_and_held_the_prefix_would_have_hit_an_earlier_copy(self):
        """Had one of the step's copies preceded the lookup, vLLM's prefix lookup -- which
        held the block before it -- would have hit it. A request that hit a block read the
        cache (one that skips it reports none), so neither copy preceded: absence is proven.
        A request that hit nothing proves that only when its spans say it read the cache."""
        index, a = ResidencyIndex(), WorkerFeed("A")
        feed(index, a.batches(range(0, 4), {0: [stored(PARENT)], 1: [stored(H, parent=PARENT), stored(H, parent=PARENT)]}))
        assert gather(index, request("A", a.ts(1) - 0.5)).presence is Presence.ABSENT
        index, a = ResidencyIndex(), WorkerFeed("A")
        feed(index, a.batches(range(0, 4), {1: [stored(H), stored(H)]}))
        nothing_hit = request("A", a.ts(1) - 0.5, cached_blocks=0)
        assert gather(index, nothing_hit).same_step_copies  # it may have skipped the cache
        read = msgspec.structs.replace(nothing_hit, skip_reading_prefix_cache=False)
        assert gather(index, read).presence is Presence.ABSENT

    def test_one_copy_in_the_lookup_step_is_the_requests_own_recompute(self):
        index, a = ResidencyIndex(), WorkerFeed("A")
        feed(index, a.batches(range(0, 4), {1: [stored(H)]}))
        assert gather(index, request("A", a.ts(1) - 0.5)).presence is Presence.ABSENT

    def test_a_block_resident_before_the_step_stays_a_resident_miss(self):
        index, a = ResidencyIndex(), WorkerFeed("A")
        feed(index, a.batches(range(0, 6), {1: [stored(H)], 4: [stored(H)]}))
        assert gather(index, request("A", a.ts(4) - 0.5)).presence is Presence.RESIDENT


def test_the_pruned_filter_stays_accurate_however_many_records_are_dropped():
    import random

    from kvmiss.enricher.core.aged_out import AgedOutFilter

    rng = random.Random(5)
    pruned, dropped = AgedOutFilter(), [rng.getrandbits(64) for _ in range(300_000)]
    for h in dropped:
        pruned.add(h)
    assert all(h in pruned for h in dropped[::97])  # no false negatives
    others = [rng.getrandbits(64) for _ in range(20_000)]
    false_positives = sum(h in pruned for h in others) / len(others)
    assert false_positives < 0.01
    assert pruned.bytes_used < 4 * len(dropped)  # a few bytes per dropped record


IN_BOUND, AHEAD, BEHIND = ClockOffset(0.05, -0.25, 1.25), ClockOffset(-2.0, -0.25, 1.25), ClockOffset(3.0, -0.25, 1.25)


class TestClocks:
    """What the service measured of each worker's clock (`ClockOffset`) reaches the evidence:
    the chosen worker's as a fact for the verdict; another worker's, out of bound, keeps it
    out of the fleet view (neither a holder nor ruled out)."""

    def fleet(self):
        """A stores then evicts H; B stores H and keeps it; C never has it. t = 1015.5."""
        index = ResidencyIndex()
        a, b, c = WorkerFeed("A"), WorkerFeed("B"), WorkerFeed("C")
        feed(index, a.batches(range(0, 20), {2: [stored(H)], 8: [removed(H)]}))
        feed(index, b.batches(range(0, 20), {3: [stored(H)]}))
        feed(index, c.batches(range(0, 20)))
        return index, 1015.5

    def test_the_chosen_workers_clock_is_carried_as_measured_on_every_path(self):
        index, t = self.fleet()
        clocks = {"A": AHEAD, "B": IN_BOUND, "C": IN_BOUND}.get
        assert gather(index, request("A", t), clocks=clocks).clock == AHEAD
        assert gather(index, request("A", 5000.0), clocks=clocks).clock == AHEAD  # lagging
        assert gather(index, request("A", None), clocks=clocks).clock == AHEAD
        assert gather(index, request("A", t)).clock is None  # not measured: no fact

    def test_in_bound_clocks_change_nothing(self):
        index, t = self.fleet()
        clocks = {"A": IN_BOUND, "B": IN_BOUND, "C": IN_BOUND}.get
        ev = gather(index, request("A", t), clocks=clocks)
        assert ev == msgspec.structs.replace(gather(index, request("A", t)), clock=IN_BOUND)
        assert [h.worker for h in ev.holders] == ["B"] and ev.skewed_workers == ()
        assert ev.presence is Presence.EVICTED

    def test_a_holder_whose_clock_is_out_of_bound_is_no_proof(self):
        index, t = self.fleet()
        ev = gather(index, request("A", t), clocks={"A": IN_BOUND, "B": BEHIND, "C": IN_BOUND}.get)
        assert ev.holders == () and ev.skewed_workers == (BEHIND,)
        assert ev.presence is Presence.EVICTED  # the chosen worker's own evidence stands

    def test_a_worker_that_never_had_the_block_is_not_ruled_out_either_while_out_of_bound(self):
        """Its absence at t also rests on its event times (its history reaching t)."""
        index, t = self.fleet()
        ev = gather(index, request("B", t, first_miss=H + 1), clocks={"A": IN_BOUND, "B": IN_BOUND, "C": AHEAD}.get)
        assert ev.skewed_workers == (AHEAD,) and ev.unresolved_holders == ()

    def test_unmeasured_workers_are_consulted_as_before(self):
        index, t = self.fleet()
        ev = gather(index, request("A", t), clocks={"A": IN_BOUND}.get)
        assert [h.worker for h in ev.holders] == ["B"] and ev.skewed_workers == ()

    def test_through_the_attributor_out_of_bound_then_back(self):
        index, t = self.fleet()
        measured = {"A": IN_BOUND, "B": IN_BOUND, "C": IN_BOUND}
        attributor = Attributor(index, clocks=measured.get)
        assert attributor.attribute(request("A", t)).label is Label.ROUTING_MISS
        assert attributor.attribute(request("C", t)).label is Label.ROUTING_MISS
        measured["A"] = BEHIND
        attributor.clocks_changed()  # (the service says so after each round's clocks: `Service.drain`)
        skewed = attributor.attribute(request("A", t))
        assert skewed.label is Label.UNKNOWN_HISTORY and skewed.reason.startswith("clock skew:")
        # C's own verdict does not rest on A's timing: B, in bound, held H at t
        assert attributor.attribute(request("C", t)).label is Label.ROUTING_MISS
        measured["B"] = AHEAD  # now the only holder is out of bound too
        attributor.clocks_changed()
        c = attributor.attribute(request("C", t))
        assert c.label is Label.UNKNOWN_HISTORY and "2 streams with a clock beyond" in c.reason
        measured["A"] = measured["B"] = IN_BOUND  # back within: judged again
        attributor.clocks_changed()
        assert attributor.attribute(request("A", t)).label is Label.ROUTING_MISS
        assert attributor.attribute(request("C", t)).label is Label.ROUTING_MISS


def test_the_pruned_filter_sets_the_same_bits_in_bulk_as_one_by_one():
    """`add_many` (in C with the compiled table) against `add` in Python, across the stage
    boundaries where a full stage is followed by a larger one."""
    import random

    import kvmiss.enricher.core.aged_out as aged_out_module
    from kvmiss.enricher.core.aged_out import AgedOutFilter

    rng = random.Random(9)
    hashes = [rng.getrandbits(64) for _ in range(200_000)] + [0, 2**64 - 1, 2**32, 2**32 - 1]
    bulk, single = AgedOutFilter(), AgedOutFilter()
    for start in range(0, len(hashes), 30_001):  # chunks that straddle the stages' capacity
        bulk.add_many(hashes[start:start + 30_001])
    compiled, aged_out_module.bloom_add = aged_out_module.bloom_add, None  # the Python rule
    try:
        for h in hashes:
            single.add(h)
    finally:
        aged_out_module.bloom_add = compiled
    assert bulk.count == single.count == len(hashes)
    (bulk_gen,), (single_gen,) = bulk._generations, single._generations
    assert [(s.count, s.bits) for s in bulk_gen.stages] == [(s.count, s.bits) for s in single_gen.stages]
    assert len(bulk_gen.stages) >= 2
