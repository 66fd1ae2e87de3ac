"""Fleets that change (docs/HISTORY.md): a departed worker is no candidate holder after it
left, counts as before until it left, and is unsettled in the band between; a request it
served while draining is judged on its own history; its views are released after retention;
a worker back under the same id is a new epoch; a listed worker without history is an
unresolved holder; before a worker joined, only a proven hold of it counts (as unsettled)."""

from __future__ import annotations

import pytest
from fleet_builders import H, WorkerFeed, removed, request, stored

from kvmiss.enricher.core.attribution import Attributor
from kvmiss.enricher.core.index import ResidencyIndex
from kvmiss.enricher.core.membership import Membership, Standing
from kvmiss.schemas.attribution import History, Label
from kvmiss.schemas.config import WorkerSpec
from kvmiss.schemas.fleet import FleetChange

BAND = 2.0


def judge(index, facts):
    return Attributor(index).attribute(facts)


def spec(worker: str, port: int = 5557) -> WorkerSpec:
    return WorkerSpec(id=worker, endpoint=f"tcp://10.0.0.1:{port}")


def depart(index, worker, at):
    index.apply_fleet_change(FleetChange(at=at, source="file", departed=(worker,)))


def join(index, worker, at, port=5557):
    index.apply_fleet_change(FleetChange(at=at, source="file", joined=(spec(worker, port),)))


def a_evicts_b_holds(upto=60):
    """A stored H at 3 and removed it at 10; B stored H at 4 and holds it; both continuous."""
    index, a, b = ResidencyIndex(["A", "B"], membership_uncertainty_s=BAND), WorkerFeed("A"), WorkerFeed("B")
    for x in a.batches(range(0, upto), {3: [stored(H)], 10: [removed(H)]}):
        index.apply(x)
    for x in b.batches(range(0, upto), {4: [stored(H)]}):
        index.apply(x)
    return index, a, b


class TestStanding:
    def test_a_static_worker_is_a_member_at_every_time_until_a_change_departs_it(self):
        m = Membership(["A"], band_s=BAND)
        assert {m.standing("A", t) for t in (-1e9, 0.0, 1e9)} == {Standing.MEMBER}
        assert m.depart("A", 100.0)
        assert [m.standing("A", t) for t in (97.9, 98.0, 102.0, 102.1)] == [
            Standing.MEMBER, Standing.UNSETTLED, Standing.UNSETTLED, Standing.DEPARTED]

    def test_a_joiner_is_not_yet_a_member_before_its_band_and_a_member_after(self):
        m = Membership(band_s=BAND)
        m.join(spec("C"), 100.0)
        assert [m.standing("C", t) for t in (97.9, 98.0, 102.0, 102.1)] == [
            Standing.NOT_YET, Standing.UNSETTLED, Standing.UNSETTLED, Standing.MEMBER]

    def test_the_same_spec_again_is_no_change_and_another_spec_under_the_id_is_a_replacement(self):
        m = Membership(band_s=BAND)
        m.join(spec("C"), 100.0)
        assert m.join(spec("C"), 150.0).value == "same" and m.standing("C", 150.0) is Standing.MEMBER
        assert m.join(spec("C", port=6000), 200.0).value == "replaced"
        assert m.standing("C", 200.0) is Standing.UNSETTLED and m.standing("C", 150.0) is Standing.MEMBER
        assert (m.joins, m.departures) == (2, 1)

    def test_a_departure_of_a_worker_that_is_not_a_member_changes_nothing(self):
        m = Membership(["A"], band_s=BAND)
        assert not m.depart("Z", 1.0)
        assert m.depart("A", 1.0) and not m.depart("A", 2.0)
        assert m.departed == {"A": 1.0} and m.departures == 1

    def test_a_change_dated_between_two_answers_is_unsettled_from_the_earlier_to_the_later(self):
        """A DNS change was made after the answer at `since` and by the one at `at`: the band
        widens by the interval, whichever answer a replica happened to read it in."""
        m = Membership(["A"], band_s=BAND)
        m.join(spec("C"), 100.0, since=90.0)
        assert [m.standing("C", t) for t in (87.9, 88.0, 102.0, 102.1)] == [
            Standing.NOT_YET, Standing.UNSETTLED, Standing.UNSETTLED, Standing.MEMBER]
        m.depart("A", 200.0, since=195.0)
        assert [m.standing("A", t) for t in (192.9, 193.0, 202.0, 202.1)] == [
            Standing.MEMBER, Standing.UNSETTLED, Standing.UNSETTLED, Standing.DEPARTED]
        m.depart("C", 300.0, since=310.0)  # a since after at is no interval: the point at
        assert m.spans["C"][-1] == [90.0, 100.0, 300.0, 300.0]

    def test_beyond_what_the_sources_were_asked_no_member_or_departure_is_settled(self):
        """Watched sources tell a change up to a band late: at a lookup time t with t + band
        past `known_through`, a member may have left unseen and a departed worker may be back."""
        m = Membership(["A"], band_s=BAND)
        m.join(spec("C"), 10.0)
        m.join(spec("D"), 10.0)
        m.depart("D", 50.0)
        settled = [m.standing(w, 80.0) for w in "ACD"]
        assert settled == [Standing.MEMBER, Standing.MEMBER, Standing.DEPARTED]  # no source watched
        m.watched()
        assert [m.standing(w, 80.0) for w in "ACD"] == [Standing.UNSETTLED] * 3
        m.seen_through(81.9)
        assert [m.standing(w, 80.0) for w in "ACD"] == [Standing.UNSETTLED] * 3  # not a band after
        m.seen_through(82.0)
        assert [m.standing(w, 80.0) for w in "ACD"] == settled
        m.seen_through(70.0)  # an older answer moves nothing back
        assert m.known_through == 82.0
        assert m.standing("C", 5.0) is Standing.NOT_YET  # a later join is still a later join

    def test_a_nan_lookup_time_cannot_be_placed(self):
        m = Membership(["A"], band_s=BAND)
        m.depart("A", 10.0)
        assert m.standing("A", float("nan")) is Standing.UNSETTLED

    def test_a_negative_band_is_refused(self):
        with pytest.raises(ValueError, match="band"):
            Membership(band_s=-1.0)


class TestDeparture:
    def test_after_the_band_the_departed_holder_is_no_candidate_before_it_it_proves_routing_miss(self):
        index, a, _ = a_evicts_b_holds()
        d = a.ts(30)
        depart(index, "B", d)
        assert judge(index, request("A", d + BAND + 0.5)).label is Label.EVICTED
        assert judge(index, request("A", d - BAND - 0.5)).label is Label.ROUTING_MISS

    def test_inside_the_band_a_holder_neither_proves_routing_miss_nor_is_ruled_out(self):
        index, a, _ = a_evicts_b_holds()
        d = a.ts(30)
        depart(index, "B", d)
        for t in (d - BAND + 0.5, d - 0.5, d + 0.5, d + BAND - 0.5):
            v = judge(index, request("A", t))
            assert v.label is Label.UNKNOWN_HISTORY and v.holders == 0, (t, v)
            assert "membership" in v.reason

    def test_inside_the_band_a_departed_worker_that_provably_never_held_it_does_not_matter(self):
        index, a, b = ResidencyIndex(["A", "B"]), WorkerFeed("A"), WorkerFeed("B")
        for x in a.batches(range(0, 60), {3: [stored(H)], 10: [removed(H)]}):
            index.apply(x)
        for x in b.batches(range(0, 60)):  # B never stores H
            index.apply(x)
        depart(index, "B", a.ts(30))
        assert judge(index, request("A", a.ts(30) - 0.5)).label is Label.EVICTED

    def test_a_departed_worker_whose_history_stopped_never_blocks_a_proof_after_the_band(self):
        # B's stream ends with its departure: behind every later lookup, which would leave
        # a member unresolved; departed, it no longer counts.
        index, a, b = ResidencyIndex(["A", "B"]), WorkerFeed("A"), WorkerFeed("B")
        for x in a.batches(range(0, 60), {3: [stored(H)], 10: [removed(H)]}):
            index.apply(x)
        for x in b.batches(range(0, 30)):
            index.apply(x)
        assert judge(index, request("A", a.ts(50))).label is Label.UNKNOWN_HISTORY  # B lags
        depart(index, "B", a.ts(30))
        assert judge(index, request("A", a.ts(50))).label is Label.EVICTED

    def test_a_request_the_departed_worker_served_while_draining_is_judged_on_its_own_history(self):
        index, a, b = ResidencyIndex(["A", "B"]), WorkerFeed("A"), WorkerFeed("B")
        for x in a.batches(range(0, 60)):  # A never stores H
            index.apply(x)
        depart(index, "B", b.ts(20))
        for x in b.batches(range(0, 50), {4: [stored(H)], 30: [removed(H)]}):  # B drains
            index.apply(x)
        v = judge(index, request("B", b.ts(40) - 0.5))
        assert v.label is Label.EVICTED and (v.stored_seq, v.removed_seq) == (4, 30), v
        # Had a member held H then, the router could have sent it there: routing_miss.
        for x in WorkerFeed("C").batches(range(0, 60), {5: [stored(H)]}):
            index.apply(x)
        assert judge(index, request("B", b.ts(40) - 0.5)).label is Label.ROUTING_MISS

    def test_the_departed_workers_clock_beyond_the_bound_no_longer_counts_after_the_band(self):
        from kvmiss.schemas.attribution import ClockOffset

        index, a, _ = a_evicts_b_holds()
        depart(index, "B", a.ts(30))
        ahead = {"B": ClockOffset(-2.0, -0.25, 1.25)}
        attributor = Attributor(index, clocks=ahead.get)
        assert attributor.attribute(request("A", a.ts(30) + BAND + 0.5)).label is Label.EVICTED
        assert attributor.attribute(request("A", a.ts(30) - BAND - 0.5)).label is Label.UNKNOWN_HISTORY


class TestRelease:
    def test_a_departed_workers_views_are_released_after_retention_and_the_band(self):
        index, a, _ = a_evicts_b_holds()
        index.retention_s = 100.0
        d = a.ts(30)
        depart(index, "B", d)
        index.prune(d + 100.0 + BAND - 1.0)
        assert "B" in index.tracked and index.views("B")
        index.prune(d + 100.0 + BAND + 1.0)
        assert "B" not in index.tracked and not index.views("B") and index.view_count == 1
        assert index.membership.known_departed("B") and "B" not in index.membership.members()
        index.apply(WorkerFeed("B").batch(60))  # a stray late batch holds nothing again
        assert "B" not in index.tracked and not index.views("B") and index.stale_batches == 1

    def test_memory_does_not_grow_with_churn(self):
        """A thousand workers join, publish and depart; with retention of 30 s and one change
        a second, what the index holds stays bounded by retention, not by the churn."""
        index = ResidencyIndex(["A"], retention_s=30.0, membership_uncertainty_s=BAND)
        a = WorkerFeed("A", ts0=0.0)
        peak = {"views": 0, "tracked": 0, "spans": 0}
        for i in range(1000):
            now = float(i)
            index.apply(a.batch(i, stored(1_000_000 + i)))
            worker = f"w{i}"
            join(index, worker, now, port=1000 + i % 50)
            feed = WorkerFeed(worker, epoch=index.next_epoch(worker), ts0=now)
            for seq in range(3):
                index.apply(feed.batch(seq, stored(i * 10 + seq)))
            if i >= 5:
                depart(index, f"w{i - 5}", now)
            if i % 10 == 0:
                index.prune(now)
            peak = {"views": max(peak["views"], index.view_count),
                    "tracked": max(peak["tracked"], len(index.tracked)),
                    "spans": max(peak["spans"], index.membership.span_count)}
        # ~5 members + ~(30 + 2 + 10) s of departed workers kept for lookups before they left.
        assert peak["views"] <= 60 and peak["tracked"] <= 60 and peak["spans"] <= 60, peak
        assert len(index.membership.released) <= 4096

    def test_a_worker_that_departs_and_rejoins_over_and_over_keeps_bounded_spans(self):
        index = ResidencyIndex(["A"], retention_s=10.0)
        for i in range(500):
            depart(index, "A", 2.0 * i)
            join(index, "A", 2.0 * i + 1.0)
            if i % 5 == 0:
                index.prune(2.0 * i)
        assert index.membership.span_count <= 12


class TestRejoin:
    def test_a_worker_back_under_the_same_id_is_a_new_epoch_with_nothing_carried_over(self):
        index, a, b = ResidencyIndex(["A", "B"]), WorkerFeed("A"), WorkerFeed("B")
        for x in a.batches(range(0, 100)):
            index.apply(x)
        for x in b.batches(range(0, 40), {4: [stored(H)]}):  # the old process held H
            index.apply(x)
        depart(index, "B", b.ts(40))
        join(index, "B", b.ts(50))
        epoch = index.next_epoch("B")
        assert epoch == 1
        back = WorkerFeed("B", epoch=epoch, ts0=b.ts(50))
        for x in back.batches(range(0, 20)):  # the new process never stores H
            index.apply(x)
        assert {v.epoch for v in index.views("B")} == {0, 1}
        v = judge(index, request("B", back.ts(10)))
        assert v.label is Label.NO_MATCH and v.epoch == 1, v
        # The old lifetime still answers for a lookup before it left.
        assert judge(index, request("B", b.ts(30))).epoch == 0

    def test_a_rejoined_worker_that_held_the_block_only_before_it_left_is_no_candidate_after(self):
        index, a, b = a_evicts_b_holds(upto=80)  # B's old lifetime held H throughout
        depart(index, "B", a.ts(20))
        join(index, "B", a.ts(40))
        back = WorkerFeed("B", epoch=index.next_epoch("B"), ts0=a.ts(41))
        for x in back.batches(range(0, 35)):
            index.apply(x)
        # Between leaving and coming back B's old lifetime held H: not a member then, and it
        # proves a hold before a join -> unsettled, never routing_miss.
        assert judge(index, request("A", a.ts(30))).label is Label.UNKNOWN_HISTORY
        # After it came back, its new lifetime never stored H: A's eviction stands.
        assert judge(index, request("A", a.ts(60))).label is Label.EVICTED


class TestJoin:
    def test_a_listed_worker_that_never_connected_is_an_unresolved_holder_never_absent(self):
        index, a, _ = a_evicts_b_holds()
        depart(index, "B", a.ts(5))
        join(index, "C", a.ts(10))
        v = judge(index, request("A", a.ts(50)))
        assert v.label is Label.UNKNOWN_HISTORY and v.history is History.LAGGING, v
        assert "C" in index.tracked and "C" in index.membership.members()

    def test_a_listed_worker_whose_stream_died_stays_unresolved(self):
        index, a, _ = a_evicts_b_holds(upto=60)
        depart(index, "B", a.ts(5))
        join(index, "C", a.ts(10))
        c = WorkerFeed("C", ts0=a.ts(11))
        for x in c.batches(range(0, 10)):  # then silent: silence is never a departure
            index.apply(x)
        assert judge(index, request("A", a.ts(15))).label is Label.EVICTED  # C proven empty then
        assert judge(index, request("A", a.ts(50))).label is Label.UNKNOWN_HISTORY

    def test_before_it_joined_a_worker_is_ruled_out_only_by_its_history(self):
        # C's engine ran from ts 1000 and is followed from seq 0 (its ring held it), but a
        # source announced it at ts 1040: before, it held H, or provably never did.
        for holds, expected in ((True, Label.UNKNOWN_HISTORY), (False, Label.EVICTED)):
            index, a, b = a_evicts_b_holds()
            depart(index, "B", a.ts(5))
            join(index, "C", a.ts(40))
            c = WorkerFeed("C", ts0=1000.0)
            for x in c.batches(range(0, 60), {6: [stored(H)]} if holds else {}):
                index.apply(x)
            v = judge(index, request("A", a.ts(20)))  # clearly before the join
            assert v.label is expected and v.holders == 0, (holds, v)
            assert holds == ("membership" in v.reason)

    def test_a_worker_announced_with_history_unknown_before_its_join_is_not_ignored_then(self):
        """A file read at start-up names C, an engine running long before, followed from a
        joined run (its ring had moved on): whether it held H before is unknown, and so is
        whether it was a member -- never taken as absent (that would let A's eviction stand
        where C may have held H: routing_miss)."""
        index, a, b = a_evicts_b_holds()
        depart(index, "B", a.ts(5))
        join(index, "C", a.ts(40))
        c = WorkerFeed("C", ts0=1000.0)
        for x in c.batches(range(30, 60)):  # first seen at seq 30: a joined run
            index.apply(x)
        v = judge(index, request("A", a.ts(20)))
        assert v.label is Label.UNKNOWN_HISTORY and "membership" in v.reason, v
        after = judge(index, request("A", a.ts(50)))  # a member then, its history as unknown as ever
        assert after.label is Label.UNKNOWN_HISTORY and "membership" not in after.reason, after

    def test_a_joiner_is_a_candidate_holder_once_past_the_band(self):
        index, a, b = a_evicts_b_holds()
        depart(index, "B", a.ts(5))
        join(index, "C", a.ts(20))
        c = WorkerFeed("C", ts0=a.ts(20))
        for x in c.batches(range(0, 40), {2: [stored(H)]}):
            index.apply(x)
        assert judge(index, request("A", a.ts(40))).label is Label.ROUTING_MISS


def test_a_static_fleet_never_given_a_change_judges_as_before():
    index, a, _ = a_evicts_b_holds()
    assert not index.membership.dynamic and index.membership.members() == ["A", "B"]
    assert judge(index, request("A", a.ts(50))).label is Label.ROUTING_MISS
    index.apply_fleet_change(FleetChange(at=0.0, source="static", joined=(spec("A"),)))
    assert not index.membership.dynamic
    assert judge(index, request("A", a.ts(50))).label is Label.ROUTING_MISS


class TestStreamsCreatedAtRunTime:
    """The collector's real state machine for a worker that joins while kvmiss runs: from its
    epoch start when the ring still holds seq 0, else a joined run; under a rejoined id its
    epochs are numbered from `next_epoch`, so the old lifetime's view stays as it was."""

    @staticmethod
    def _message(seq: int, ts: float, *events, channel=None):
        import msgspec

        from kvmiss.collectors.frames import BatchMessage, Channel
        from kvmiss.schemas.events import EventBatch

        body = msgspec.msgpack.encode(EventBatch(ts, list(events) or [stored(10_000 + seq)], 0))
        return BatchMessage(channel or Channel.LIVE, "", seq, body)

    def _join(self, index, ring_from: int, now: float):
        from kvmiss.collectors.continuity import Apply, RequestReplay, StreamConfig, StreamState
        from kvmiss.collectors.frames import Channel, ReplayEnd
        from kvmiss.collectors.stream import WorkerStream

        join(index, "B", now)
        stream = WorkerStream("B", replay=True, config=StreamConfig(replay_on_connect=False),
                              state=StreamState(epoch=index.next_epoch("B")))
        out = stream.on_live(self._message(8, now + 0.8, stored(H)), now)
        assert out == [RequestReplay(0, request_id=1)]
        for seq in range(ring_from, 9):
            out += stream.on_replay(self._message(seq, now + seq / 10, channel=Channel.REPLAY), 1, now)
        out += stream.on_replay(ReplayEnd(), 1, now)
        for action in out:
            if isinstance(action, Apply):
                index.apply(action.batch)
        return stream

    def test_a_rejoined_worker_replayed_from_zero_is_a_new_epoch_from_its_start(self):
        index, _a, b = ResidencyIndex(["A", "B"]), WorkerFeed("A"), WorkerFeed("B")
        for x in b.batches(range(0, 20), {4: [stored(H)]}):
            index.apply(x)
        depart(index, "B", b.ts(20))
        self._join(index, ring_from=0, now=b.ts(30))
        new, old = index.views("B")
        assert (new.epoch, old.epoch) == (1, 0)
        assert new.runs[0].start.name == "EPOCH_START" and new.first_seq == 0
        assert old.last_seq == 19  # the old lifetime, read-only, as it was

    def test_a_joiner_whose_ring_moved_on_starts_a_joined_run(self):
        index = ResidencyIndex(["A"])
        self._join(index, ring_from=5, now=1000.0)
        (view,) = index.views("B")
        assert view.epoch == 0 and view.runs[0].start.name == "JOINED" and view.first_seq == 5


class TestRejoinFencing:
    """After a rejoin nothing under an old epoch number is applied: a late batch of the old
    stream would extend the old lifetime past its departure, and a new stream that did not
    number its epochs from `next_epoch` would be merged into the old view. Both are refused
    and counted; the old view stays read-only as it was."""

    def _rejoined(self):
        index, b = ResidencyIndex(["A", "B"]), WorkerFeed("B")
        for x in b.batches(range(0, 20), {4: [stored(H)]}):
            index.apply(x)
        depart(index, "B", b.ts(20))
        join(index, "B", b.ts(30))
        return index, b

    def test_a_late_batch_of_the_old_stream_after_a_rejoin_is_refused(self):
        index, b = self._rejoined()
        index.apply(b.batch(20, removed(H)))
        (old,) = index.views("B")
        assert old.last_seq == 19 and index.stale_batches == 1

    def test_a_new_stream_reusing_an_old_epoch_number_is_refused_not_merged(self):
        index, b = self._rejoined()
        reused = WorkerFeed("B", epoch=0, ts0=b.ts(31))
        for x in reused.batches(range(0, 5)):
            index.apply(x)
        (old,) = index.views("B")
        assert (old.epoch, old.last_seq, index.stale_batches) == (0, 19, 5)
        fresh = WorkerFeed("B", epoch=index.next_epoch("B"), ts0=b.ts(36))
        for x in fresh.batches(range(0, 5)):
            index.apply(x)
        assert [v.epoch for v in index.views("B")] == [1, 0] and index.stale_batches == 5


def test_a_departure_observed_before_the_join_it_follows_ends_at_the_join():
    """Two sources' changes applied out of order (a departure stamped before the rejoin it
    follows): the span is never negative, and the fleet view and the standing agree on when
    the worker left (found by test_fleet_round's random fleets)."""
    m = Membership(["A"], band_s=0.5)
    m.depart("A", 10.0)
    m.join(spec("A"), 20.0)
    m.depart("A", 19.0)
    assert m.spans["A"][-1] == [20.0, 20.0, 20.0, 20.0] and m.departed_until("A") == 20.5
    assert m.standing("A", 20.4) is Standing.UNSETTLED and m.standing("A", 20.6) is Standing.DEPARTED


class TestTheRoutersOwnChoices:
    """A router seen choosing a worker after it departed shows its lag behind the source: the
    band widens to cover it, so the lookups near the next change are judged with care."""

    def test_a_choice_within_the_band_changes_nothing(self):
        m = Membership(band_s=0.5)
        m.join(spec("A"), at=10.0)
        m.depart("A", at=20.0)
        assert m.chosen("A", 20.4) is None and m.band_s == 0.5 and m.band_widened == 0

    def test_a_choice_past_the_band_widens_it_with_headroom(self):
        m = Membership(band_s=0.5)
        m.join(spec("A"), at=10.0)
        m.depart("A", at=20.0)
        assert m.standing("A", 21.0) is Standing.DEPARTED
        assert m.chosen("A", 21.0) == pytest.approx(1.0)
        assert m.band_s == pytest.approx(1.5) and m.band_widened == 1
        assert m.standing("A", 21.0) is Standing.UNSETTLED  # now inside the widened band
        assert m.chosen("A", 21.2) is None and m.band_widened == 1  # covered already

    def test_a_choice_while_a_member_or_after_a_rejoin_is_no_lag(self):
        m = Membership(band_s=0.5)
        m.join(spec("A"), at=10.0)
        assert m.chosen("A", 15.0) is None
        m.depart("A", at=20.0)
        m.join(spec("A"), at=30.0)
        assert m.chosen("A", 31.0) is None and m.band_s == 0.5

    def test_the_band_never_grows_past_its_cap(self):
        from kvmiss.enricher.core.membership import BAND_MAX_S
        m = Membership(band_s=0.5)
        m.join(spec("A"), at=10.0)
        m.depart("A", at=20.0)
        m.chosen("A", 20.0 + 10 * BAND_MAX_S)
        assert m.band_s == BAND_MAX_S


class TestTheRoutersCandidateSet:
    """A span naming the router's candidates (``kvmiss.route.candidates``) settles the fleet at
    its lookup: a departure's band no longer matters, and only the candidates count."""

    def departed_in_band(self):
        index, a, b = a_evicts_b_holds()
        depart(index, "B", at=b.ts(30))  # B leaves holding H; a lookup just after is in the band
        return index, a.ts(31)

    def test_without_candidates_the_band_leaves_a_holder_unsettled(self):
        index, t = self.departed_in_band()
        verdict = judge(index, request("A", t))
        assert verdict.label is Label.UNKNOWN_HISTORY and "not settled" in verdict.reason

    def test_a_holder_the_router_no_longer_listed_is_no_candidate(self):
        index, t = self.departed_in_band()
        assert judge(index, request("A", t, route_candidates=("A",))).label is Label.EVICTED

    def test_a_holder_the_router_still_listed_is_a_routing_miss(self):
        index, t = self.departed_in_band()
        assert judge(index, request("A", t, route_candidates=("A", "B"))).label is Label.ROUTING_MISS

    def test_a_candidate_kvmiss_does_not_follow_may_have_held_it(self):
        index, t = self.departed_in_band()
        verdict = judge(index, request("A", t, route_candidates=("A", "Z")))
        assert verdict.label is Label.UNKNOWN_HISTORY and verdict.history is History.UNTRACKED
