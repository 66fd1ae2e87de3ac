"""attribute(): the worked cases of ATTRIBUTION.md, one test per label, one per precedence step.

Evidence is built literally here, as the evidence builder would hand it over at lookup time:
these tests pin what the verdict concludes from it, not how the index proves it.
"""

from __future__ import annotations

import math

import msgspec
import pytest

from kvmiss.enricher.core.geometry import lookup_limit_tokens
from kvmiss.enricher.core.verdict import attribute
from kvmiss.schemas.attribution import (
    LABEL_OWNER,
    ClockOffset,
    Evidence,
    History,
    Holder,
    Label,
    Owner,
    Presence,
    RequestFacts,
    TierHolding,
    TransferAttempt,
    TransferResult,
    WindowStart,
)

B = 16
T = 1_000.0  # lookup time, engine-clock seconds
CHAIN = [0x9E3779B97F4A7C15 + 7919 * i for i in range(8)]  # large uint64s: easy to spot


def request(prompt: int = 8 * B, cached: int = 2 * B, **overrides) -> RequestFacts:
    fields = dict(
        prompt_tokens=prompt,
        cached_tokens=cached,
        block_size=B,
        worker="A",
        lookup_time=T,
        block_hashes=CHAIN,
    )
    fields.update(overrides)
    return RequestFacts(**fields)


def continuous(**overrides) -> Evidence:
    return Evidence(**{"history": History.CONTINUOUS, "epoch": 42, **overrides})


def resident() -> Evidence:
    return continuous(presence=Presence.RESIDENT, stored_seq=100, stored_ts=900.0)


def evicted(**overrides) -> Evidence:
    """Stored by batch 100, removed by batch 148, 9.5 s before the lookup."""
    stored_then_removed = {
        "presence": Presence.EVICTED,
        "stored_seq": 100,
        "stored_ts": 900.0,
        "removed_seq": 148,
        "removed_ts": 990.5,
    }
    return continuous(**{**stored_then_removed, **overrides})


def absent(start: WindowStart = WindowStart.EPOCH_START, start_ts: float = 500.0) -> Evidence:
    return continuous(presence=Presence.ABSENT, window_start=start, window_start_ts=start_ts)


ON_WORKER_B = (Holder(worker="B", medium="GPU", stored_ts=950.0),)
ON_CPU_TIER = (TierHolding(medium="CPU", stored_ts=950.0),)
FAILED_TRANSFER = (TransferAttempt(result=TransferResult.FAILED, source="B"),)


class TestWorkedCases:
    def test_store_at_100_removal_at_148_continuous_through_the_request_is_evicted(self):
        verdict = attribute(request(), evicted())
        assert verdict.label is Label.EVICTED
        assert (verdict.stored_seq, verdict.removed_seq) == (100, 148)
        assert verdict.eviction_age_ms == 9_500
        assert verdict.history is History.CONTINUOUS

    def test_gap_201_to_204_is_unknown_history_even_though_the_block_looks_absent(self):
        # The index rebuilt from 205 on has no H, but 201..204 could have stored it.
        gap = Evidence(
            history=History.GAP, presence=Presence.ABSENT, gap_from_seq=201, gap_to_seq=204
        )
        verdict = attribute(request(), gap)
        assert verdict.label is Label.UNKNOWN_HISTORY
        assert verdict.history is History.GAP
        assert (verdict.gap_from_seq, verdict.gap_to_seq) == (201, 204)
        assert "201..204" in verdict.reason

    def test_a_dropped_removal_batch_that_replay_recovered_is_still_evicted(self):
        assert attribute(request(), evicted()).label is Label.EVICTED

    def test_a_dropped_removal_batch_that_replay_lost_is_unknown_history_not_resident_miss(self):
        # The store was seen and the removal was not: the index alone would call H resident.
        lost = Evidence(
            history=History.GAP,
            presence=Presence.RESIDENT,
            epoch=42,
            stored_seq=100,
            gap_from_seq=148,
            gap_to_seq=148,
        )
        verdict = attribute(request(), lost)
        assert verdict.label is Label.UNKNOWN_HISTORY
        assert (verdict.gap_from_seq, verdict.gap_to_seq) == (148, 148)

    def test_a_restart_whose_epoch_is_not_yet_resolved_is_unknown_epoch(self):
        uncertain = Evidence(history=History.EPOCH_UNKNOWN, presence=Presence.RESIDENT)
        verdict = attribute(request(), uncertain)
        assert verdict.label is Label.UNKNOWN_EPOCH
        assert verdict.owner is Owner.TELEMETRY

    def test_blocks_stored_before_a_restart_are_not_credited_to_the_new_epoch(self):
        new_epoch = Evidence(
            history=History.CONTINUOUS,
            presence=Presence.ABSENT,
            epoch=43,
            window_start=WindowStart.EPOCH_START,
            window_start_ts=995.0,
        )
        verdict = attribute(request(), new_epoch)
        assert verdict.label is Label.NO_MATCH
        assert verdict.epoch == 43
        assert verdict.window_start is WindowStart.EPOCH_START

    def test_a_worker_down_longer_than_the_replay_window_is_quarantined_not_resumed(self):
        quarantined = Evidence(
            history=History.QUARANTINED, epoch=42, gap_from_seq=5_000, gap_to_seq=31_000
        )
        verdict = attribute(request(), quarantined)
        assert verdict.label is Label.UNKNOWN_HISTORY
        assert verdict.history is History.QUARANTINED
        assert "quarantined" in verdict.reason
        assert "5000..31000" in verdict.reason

    @pytest.mark.parametrize(
        ("prompt", "cached", "label"),
        [
            (16, 0, Label.LOOKUP_LIMIT),  # the only full block holds the last token
            (17, 16, Label.HIT),
            (32, 16, Label.LOOKUP_LIMIT),  # not an eviction
            (33, 32, Label.HIT),
        ],
    )
    def test_fully_cached_prompts_of_16_17_32_33_tokens(self, prompt, cached, label):
        assert lookup_limit_tokens(prompt, B) == cached
        verdict = attribute(request(prompt, cached), evicted())
        assert verdict.label is label
        assert verdict.owner is Owner.NONE
        assert verdict.missed_tokens == 0

    @pytest.mark.parametrize(
        ("kinds", "cached", "first_block"),
        [
            (("cache_salt",), 0, 0),  # the salt is on block 0: every block differs
            (("lora",), 0, 0),  # the adapter is in every block's extra keys
            ((), 2 * B, 2),  # token 37 changed: blocks 0 and 1 still match
        ],
        ids=["different-salt", "different-lora", "one-changed-token"],
    )
    def test_a_different_chain_is_no_match_naming_extra_key_kinds(self, kinds, cached, first_block):
        verdict = attribute(request(cached=cached, extra_key_kinds=kinds), absent())
        assert verdict.label is Label.NO_MATCH
        assert verdict.owner is Owner.APPLICATION
        assert verdict.extra_key_kinds == kinds
        assert verdict.first_miss_block == first_block
        assert verdict.first_miss_token == first_block * B <= 37
        assert all(kind in verdict.reason for kind in kinds)

    def test_block_resident_on_worker_b_while_routed_to_a_is_routing_miss(self):
        on_b = continuous(presence=Presence.ABSENT, holders=ON_WORKER_B)
        verdict = attribute(request(), on_b)
        assert verdict.label is Label.ROUTING_MISS
        assert verdict.owner is Owner.ROUTING
        assert verdict.holders == 1


class TestEachLabel:
    def test_hit_when_everything_reusable_was_reused(self):
        verdict = attribute(request(prompt=100, cached=96), None)
        assert (verdict.label, verdict.owner, verdict.missed_tokens) == (Label.HIT, Owner.NONE, 0)
        assert verdict.first_miss_block is None

    def test_lookup_limit_when_only_the_never_probed_block_was_recomputed(self):
        verdict = attribute(request(prompt=128, cached=112), None)
        assert verdict.label is Label.LOOKUP_LIMIT

    def test_transfer_failure_when_a_transfer_span_timed_out(self):
        timeout = (TransferAttempt(result=TransferResult.TIMEOUT, source="cpu"),)
        verdict = attribute(request(transfers=timeout), absent())
        assert (verdict.label, verdict.owner) == (Label.TRANSFER_FAILURE, Owner.PLATFORM)
        assert "CPU offload tier timed out" in verdict.reason

    def test_transfer_failure_when_an_offload_tier_held_the_block_and_it_was_not_loaded(self):
        verdict = attribute(request(), continuous(presence=Presence.ABSENT, tiers=ON_CPU_TIER))
        assert verdict.label is Label.TRANSFER_FAILURE
        assert "CPU offload tier" in verdict.reason

    def test_a_completed_transfer_is_not_a_failure(self):
        done = (TransferAttempt(result=TransferResult.COMPLETED, source="B"),)
        assert attribute(request(transfers=done), absent()).label is Label.NO_MATCH

    def test_routing_miss_counts_every_holder(self):
        holders = ON_WORKER_B + (Holder(worker="C", medium="CPU", stored_ts=960.0),)
        verdict = attribute(request(), continuous(presence=Presence.ABSENT, holders=holders))
        assert (verdict.label, verdict.holders) == (Label.ROUTING_MISS, 2)
        assert verdict.reason.startswith("2 other tracked workers")

    def test_resident_miss_when_the_index_says_the_block_was_there(self):
        verdict = attribute(request(), resident())
        assert (verdict.label, verdict.owner) == (Label.RESIDENT_MISS, Owner.PLATFORM)
        assert verdict.stored_seq == 100

    def test_evicted_by_a_clear_says_cleared(self):
        verdict = attribute(request(), evicted(removed_by_clear=True))
        assert verdict.label is Label.EVICTED
        assert "cleared" in verdict.reason and "9500 ms" in verdict.reason

    def test_evicted_by_a_removal_says_removed(self):
        assert "removed" in attribute(request(), evicted()).reason

    def test_a_removal_stamped_after_the_lookup_has_no_eviction_age(self):
        verdict = attribute(request(), evicted(removed_ts=T + 1.0))
        assert verdict.label is Label.EVICTED
        assert verdict.eviction_age_ms is None

    def test_evicted_without_a_lookup_time_reports_no_age(self):
        verdict = attribute(request(lookup_time=None), evicted())
        assert verdict.label is Label.EVICTED
        assert verdict.eviction_age_ms is None

    def test_no_match_since_an_observed_clear(self):
        verdict = attribute(request(), absent(WindowStart.CLEAR, 800.0))
        assert verdict.label is Label.NO_MATCH
        assert (verdict.window_start, verdict.window_start_ts) == (WindowStart.CLEAR, 800.0)
        assert "cache clear" in verdict.reason

    def test_no_match_from_the_retention_horizon_is_only_no_recent_match(self):
        verdict = attribute(request(), absent(WindowStart.HORIZON, 400.0))
        assert verdict.label is Label.NO_MATCH
        assert verdict.window_start is WindowStart.HORIZON
        assert verdict.reason.startswith("no recent match")
        assert "last 600 s" in verdict.reason

    def test_unknown_history_when_presence_is_unknown_despite_continuous_history(self):
        verdict = attribute(request(), continuous(presence=Presence.UNKNOWN))
        assert verdict.label is Label.UNKNOWN_HISTORY
        assert verdict.history is History.CONTINUOUS

    def test_unknown_epoch_when_the_process_lifetime_is_not_established(self):
        verdict = attribute(request(), Evidence(history=History.EPOCH_UNKNOWN))
        assert (verdict.label, verdict.history) == (Label.UNKNOWN_EPOCH, History.EPOCH_UNKNOWN)

    def test_every_verdict_takes_its_owner_from_the_label(self):
        for verdict in (attribute(request(), e) for e in (resident(), evicted(), absent(), None)):
            assert verdict.owner is LABEL_OWNER[verdict.label]


class TestInsufficientHistory:
    def test_no_evidence_means_the_worker_is_untracked(self):
        verdict = attribute(request(), None)
        assert (verdict.label, verdict.history) == (Label.UNKNOWN_HISTORY, History.UNTRACKED)
        assert "not tracked" in verdict.reason

    def test_no_evidence_and_no_worker_says_no_worker_was_named(self):
        assert "names no chosen worker" in attribute(request(worker=None), None).reason

    def test_lagging_says_how_far_behind_the_stream_was(self):
        lagging = Evidence(history=History.LAGGING, applied_through_ts=998.75)
        verdict = attribute(request(), lagging)
        assert verdict.label is Label.UNKNOWN_HISTORY
        assert verdict.reason.startswith("lagging") and "1.250 s" in verdict.reason

    def test_aged_out_reports_the_retention_horizon(self):
        aged = Evidence(
            history=History.AGED_OUT, window_start=WindowStart.HORIZON, window_start_ts=700.0
        )
        verdict = attribute(request(), aged)
        assert verdict.label is Label.UNKNOWN_HISTORY
        assert verdict.reason.startswith("aged out") and "300.0 s before lookup" in verdict.reason
        assert verdict.window_start_ts == 700.0

    def test_evidence_that_says_untracked_is_unknown_history(self):
        verdict = attribute(request(), Evidence(history=History.UNTRACKED))
        assert (verdict.label, verdict.history) == (Label.UNKNOWN_HISTORY, History.UNTRACKED)

    def test_a_request_without_a_block_chain_cannot_name_its_first_missed_block(self):
        verdict = attribute(request(block_hashes=None), resident())
        assert verdict.label is Label.UNKNOWN_HISTORY
        assert "no block chain" in verdict.reason
        assert verdict.history is History.CONTINUOUS  # what the evidence said
        assert verdict.first_miss_block == 2 and verdict.first_miss_digest is None

    def test_a_chain_that_ends_before_the_first_miss_is_unknown_history(self):
        verdict = attribute(request(block_hashes=CHAIN[:2]), resident(), digest=hex)
        assert verdict.label is Label.UNKNOWN_HISTORY
        assert "ends before" in verdict.reason
        assert verdict.first_miss_digest is None


class TestPrecedence:
    def test_hit_beats_everything(self):
        facts = request(prompt=33, cached=32, transfers=FAILED_TRANSFER)
        everything = Evidence(history=History.GAP, holders=ON_WORKER_B, tiers=ON_CPU_TIER)
        assert attribute(facts, everything).label is Label.HIT

    def test_lookup_limit_beats_everything(self):
        facts = request(prompt=32, cached=16, transfers=FAILED_TRANSFER)
        assert attribute(facts, Evidence(history=History.GAP)).label is Label.LOOKUP_LIMIT

    def test_transfer_failure_beats_routing_miss(self):
        with_holder = continuous(presence=Presence.ABSENT, holders=ON_WORKER_B)
        verdict = attribute(request(transfers=FAILED_TRANSFER), with_holder)
        assert verdict.label is Label.TRANSFER_FAILURE
        assert verdict.holders == 1  # still reported

    def test_tier_residency_beats_routing_miss(self):
        both = continuous(presence=Presence.ABSENT, holders=ON_WORKER_B, tiers=ON_CPU_TIER)
        assert attribute(request(), both).label is Label.TRANSFER_FAILURE

    def test_a_failed_transfer_span_needs_neither_a_chain_nor_a_tracked_worker(self):
        facts = request(block_hashes=None, transfers=FAILED_TRANSFER)
        assert attribute(facts, None).label is Label.TRANSFER_FAILURE

    def test_routing_miss_beats_unknown_history(self):
        broken = Evidence(history=History.GAP, holders=ON_WORKER_B, gap_from_seq=3, gap_to_seq=9)
        verdict = attribute(request(), broken)
        assert verdict.label is Label.ROUTING_MISS
        assert (verdict.history, verdict.gap_from_seq, verdict.gap_to_seq) == (History.GAP, 3, 9)

    def test_routing_miss_beats_unknown_epoch(self):
        unsure = Evidence(history=History.EPOCH_UNKNOWN, holders=ON_WORKER_B)
        assert attribute(request(), unsure).label is Label.ROUTING_MISS

    def test_routing_miss_still_reports_the_eviction_on_the_chosen_worker(self):
        verdict = attribute(request(), evicted(holders=ON_WORKER_B))
        assert verdict.label is Label.ROUTING_MISS
        assert (verdict.stored_seq, verdict.removed_seq) == (100, 148)
        assert verdict.eviction_age_ms == 9_500

    def test_unknown_epoch_beats_resident_miss(self):
        unsure = Evidence(history=History.EPOCH_UNKNOWN, presence=Presence.RESIDENT, stored_seq=7)
        assert attribute(request(), unsure).label is Label.UNKNOWN_EPOCH

    def test_unknown_history_beats_evicted(self):
        gap = evicted(history=History.GAP, gap_from_seq=150, gap_to_seq=155)
        verdict = attribute(request(), gap)
        assert verdict.label is Label.UNKNOWN_HISTORY
        assert verdict.eviction_age_ms is None  # an age is a claim broken history cannot back

    def test_unknown_history_beats_no_match(self):
        lagging = Evidence(history=History.LAGGING, presence=Presence.ABSENT)
        assert attribute(request(), lagging).label is Label.UNKNOWN_HISTORY

    def test_evicted_reports_no_holders(self):
        assert attribute(request(), evicted()).holders == 0


class TestReportedFacts:
    def test_a_miss_reports_where_it_started_and_what_it_cost(self):
        verdict = attribute(request(prompt=100, cached=32), absent())
        assert (verdict.first_miss_block, verdict.first_miss_token) == (2, 32)
        assert verdict.missed_tokens == 96 - 32

    def test_the_digest_names_the_first_missed_block(self):
        verdict = attribute(request(cached=3 * B), absent(), digest=lambda h: f"k:{h % 97}")
        assert verdict.first_miss_digest == f"k:{CHAIN[3] % 97}"

    def test_no_digest_function_means_no_digest(self):
        assert attribute(request(), absent()).first_miss_digest is None

    def test_a_partially_cached_block_is_still_the_first_miss(self):
        verdict = attribute(request(prompt=100, cached=20), absent())
        assert (verdict.first_miss_block, verdict.missed_tokens) == (1, 76)


class TestBadFacts:
    @pytest.mark.parametrize(
        ("overrides", "words"),
        [
            (dict(block_size=0), "block size"),
            (dict(prompt_tokens=-1, cached_tokens=0), "negative"),
            (dict(prompt_tokens=10, cached_tokens=-16), "negative"),
            (dict(prompt_tokens=10, cached_tokens=16), "exceed"),
        ],
    )
    def test_impossible_counts_are_unknown_history_not_an_exception(self, overrides, words):
        verdict = attribute(request(**overrides), resident())
        assert verdict.label is Label.UNKNOWN_HISTORY
        assert verdict.reason.startswith("invalid request facts") and words in verdict.reason

    def test_an_engine_reusing_beyond_its_lookup_limit_is_a_hit(self):
        assert attribute(request(prompt=32, cached=32), None).label is Label.HIT



SKEW, DELAY = 0.25, 1.0  # [history] clock_skew_s, publish_delay_s
LOW, HIGH = -SKEW, SKEW + DELAY  # the receive-lag bound


def clock(lag: float) -> ClockOffset:
    return ClockOffset(lag_s=lag, low_s=LOW, high_s=HIGH)


class TestClockSkew:
    """The chosen worker's clock (the sliding minimum of its receive lags) is a fact of the
    evidence: out of the bound, no index claim stands (unknown_history, "clock skew");
    other workers out of bound block every label below routing_miss."""

    @pytest.mark.parametrize("lag", [LOW, -0.1, 0.0, 0.3, HIGH], ids=["low-edge", "ahead", "zero", "behind", "high-edge"])
    def test_within_the_bound_including_its_edges_the_verdict_is_judged(self, lag):
        assert clock(lag).within_bound
        for evidence, label in ((evicted(), Label.EVICTED), (resident(), Label.RESIDENT_MISS),
                                (absent(), Label.NO_MATCH)):
            evidence = msgspec.structs.replace(evidence, clock=clock(lag))
            assert attribute(request(), evidence).label is label

    @pytest.mark.parametrize(("lag", "words"), [
        (math.nextafter(LOW, -math.inf), "ahead of kvmiss"),
        (-3.0, "at least 3.000 s ahead"),
        (math.nextafter(HIGH, math.inf), "runs behind"),
        (4.5, "arrive at least 4.500 s after"),
    ], ids=["just-below", "ahead", "just-above", "behind"])
    def test_out_of_the_bound_the_verdict_is_unknown_history_for_clock_skew(self, lag, words):
        assert not clock(lag).within_bound
        verdict = attribute(request(), evicted(clock=clock(lag)))
        assert verdict.label is Label.UNKNOWN_HISTORY and verdict.owner is Owner.TELEMETRY
        assert verdict.reason.startswith("clock skew:") and words in verdict.reason
        assert "-0.250..1.250 s" in verdict.reason
        assert verdict.history is History.CONTINUOUS  # the stream itself is fine: no new value

    def test_no_measurement_is_no_claim_about_the_clock(self):
        assert attribute(request(), evicted(clock=None)).label is Label.EVICTED

    def test_a_skewed_chosen_worker_reports_no_timed_fact(self):
        verdict = attribute(request(), evicted(clock=clock(9.0), holders=ON_WORKER_B))
        assert verdict.label is Label.UNKNOWN_HISTORY
        assert verdict.eviction_age_ms is None and verdict.holders == 0
        assert verdict.stored_seq is None and verdict.removed_seq is None
        assert (verdict.first_miss_block, verdict.missed_tokens, verdict.epoch) == (2, 112 - 32, 42)

    def test_clock_skew_beats_routing_miss_and_tier_residency(self):
        """Both place another worker's or tier's event times against t, stamped on the
        skewed clock."""
        for evidence in (continuous(holders=ON_WORKER_B, clock=clock(-2.0)),
                         continuous(tiers=ON_CPU_TIER, clock=clock(-2.0))):
            assert attribute(request(), evidence).reason.startswith("clock skew:")

    def test_clock_skew_beats_the_chosen_workers_other_history_reasons(self):
        for history in (History.GAP, History.LAGGING, History.QUARANTINED, History.EPOCH_UNKNOWN):
            verdict = attribute(request(), Evidence(history=history, clock=clock(5.0)))
            assert verdict.label is Label.UNKNOWN_HISTORY and verdict.reason.startswith("clock skew:")
            assert verdict.history is history

    def test_what_needs_no_clock_still_wins(self):
        skewed = evicted(clock=clock(-2.0))
        assert attribute(request(prompt=33, cached=32), skewed).label is Label.HIT
        assert attribute(request(prompt=32, cached=16), skewed).label is Label.LOOKUP_LIMIT
        assert attribute(request(transfers=FAILED_TRANSFER), skewed).label is Label.TRANSFER_FAILURE

    def test_another_worker_out_of_bound_blocks_every_label_below_routing_miss(self):
        for evidence in (resident(), evicted(), absent()):
            blocked = msgspec.structs.replace(evidence, skewed_workers=(clock(3.0),))
            verdict = attribute(request(), blocked)
            assert verdict.label is Label.UNKNOWN_HISTORY
            assert "1 stream with a clock beyond the skew bound" in verdict.reason
            assert verdict.history is History.CONTINUOUS

    def test_another_worker_out_of_bound_does_not_undo_a_proven_holder(self):
        proven = msgspec.structs.replace(absent(), holders=ON_WORKER_B, skewed_workers=(clock(3.0),))
        assert attribute(request(), proven).label is Label.ROUTING_MISS

    def test_skewed_and_unresolved_workers_are_counted_together(self):
        evidence = Evidence(history=History.CONTINUOUS, presence=Presence.ABSENT,
                            unresolved_holders=(History.QUARANTINED,), skewed_workers=(clock(-1.0),))
        verdict = attribute(request(), evidence)
        assert verdict.label is Label.UNKNOWN_HISTORY and verdict.history is History.QUARANTINED
        assert "2 streams quarantined, with a clock beyond the skew bound" in verdict.reason
