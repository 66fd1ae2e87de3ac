"""ATTRIBUTION.md's worked cases end to end: applied batches -> index -> evidence -> verdict."""

from __future__ import annotations

import msgspec
from fleet_builders import (
    FULL,
    WINDOW,
    H,
    WorkerFeed,
    chain_request,
    full_stored,
    group_removed,
    removed,
    request,
    stored,
    window_stored,
)

from kvmiss.enricher.core.attribution import Attributor
from kvmiss.enricher.core.index import ResidencyIndex
from kvmiss.enricher.core.privacy import DigestKey
from kvmiss.schemas.attribution import History, Label, RequestFacts
from kvmiss.schemas.stream import RunStart

KEY = DigestKey("worked-cases-test-secret")


def judge(index, facts):
    verdict = Attributor(index, KEY).attribute(facts)
    # The what-if facts (finish time, output tokens) never decide a verdict, whatever they say.
    for finish, output in ((0.0, 0), ((facts.lookup_time or 0.0) + 3600.0, 10**6)):
        whatif = msgspec.structs.replace(facts, finish_time=finish, output_tokens=output)
        assert Attributor(index, KEY).attribute(whatif) == verdict
    return verdict


def test_case_1_stored_100_removed_148_request_at_160_is_evicted():
    index, a = ResidencyIndex(), WorkerFeed("A", epoch=42)
    feed = a.batches(range(0, 162), {100: [stored(H)], 148: [removed(H)]})
    for b in feed:
        index.apply(b)
    v = judge(index, request("A", a.ts(160) - 0.5))
    assert v.label is Label.EVICTED
    assert (v.stored_seq, v.removed_seq, v.epoch) == (100, 148, 42)
    assert v.eviction_age_ms == 11_500
    assert v.first_miss_digest == KEY.digest_block(H)


def test_case_2_hole_201_to_204_unfilled_makes_a_miss_at_208_unknown_history():
    index, a = ResidencyIndex(), WorkerFeed("A")
    for b in a.batches(range(0, 201)):
        index.apply(b)
    a.start_run(205, RunStart.AFTER_GAP, gap=(201, 204))
    for b in a.batches(range(205, 209)):
        index.apply(b)
    v = judge(index, request("A", a.ts(208) - 0.5))
    assert v.label is Label.UNKNOWN_HISTORY
    assert (v.gap_from_seq, v.gap_to_seq) == (201, 204)


def test_case_3_removal_recovered_by_replay_is_evicted_and_unrecovered_is_unknown():
    recovered, a = ResidencyIndex(), WorkerFeed("A")
    for b in a.batches(range(0, 162), {100: [stored(H)], 148: [removed(H)]}):
        recovered.apply(b)
    assert judge(recovered, request("A", a.ts(160) - 0.5)).label is Label.EVICTED

    lost, a = ResidencyIndex(), WorkerFeed("A")
    for b in a.batches(range(0, 148), {100: [stored(H)]}):
        lost.apply(b)
    a.start_run(149, RunStart.AFTER_GAP, gap=(148, 148))
    for b in a.batches(range(149, 162)):
        lost.apply(b)
    assert judge(lost, request("A", a.ts(160) - 0.5)).label is Label.UNKNOWN_HISTORY


def test_case_4_a_restart_does_not_credit_blocks_stored_before_it():
    index, old = ResidencyIndex(), WorkerFeed("A", epoch=0)
    for b in old.batches(range(0, 30), {5: [stored(H)]}):
        index.apply(b)
    new = WorkerFeed("A", epoch=1, ts0=old.ts(29) + 3)
    for b in new.batches(range(0, 10)):
        index.apply(b)
    v = judge(index, request("A", new.ts(5)))
    assert v.label is Label.NO_MATCH and v.epoch == 1


def test_case_5_an_outage_longer_than_the_replay_window_is_quarantined():
    index, a = ResidencyIndex(), WorkerFeed("A")
    for b in a.batches(range(0, 10), {2: [stored(H)]}):
        index.apply(b)
    a.start_run(20_010, RunStart.AFTER_GAP, gap=(10, 20_009))
    for b in a.batches(range(20_010, 20_020)):
        index.apply(b)
    v = judge(index, request("A", a.ts(20_015)))
    assert v.label is Label.UNKNOWN_HISTORY and v.history is History.QUARANTINED


def test_case_6_block_multiples_are_lookup_limit_not_eviction():
    index = ResidencyIndex(["A"])
    labels = []
    for n, cached in ((16, 0), (17, 16), (32, 16), (33, 32)):
        facts = RequestFacts(prompt_tokens=n, cached_tokens=cached, block_size=16, worker="A",
                             lookup_time=1.0, block_hashes=[H, H + 1][: n // 16])
        labels.append(judge(index, facts).label)
    assert labels == [Label.LOOKUP_LIMIT, Label.HIT, Label.LOOKUP_LIMIT, Label.HIT]


def test_case_7_a_different_salt_lora_or_token_is_no_match_with_the_kinds():
    index, a = ResidencyIndex(), WorkerFeed("A")
    for b in a.batches(range(0, 20), {3: [stored(H - 1, H)]}):
        index.apply(b)
    for kinds in (("cache_salt",), ("lora",), ()):
        facts = request("A", a.ts(15), cached_blocks=1, first_miss=H + 99, extra_key_kinds=kinds)
        v = judge(index, facts)
        assert v.label is Label.NO_MATCH and v.extra_key_kinds == kinds


def test_case_8_resident_on_b_but_routed_to_a_is_a_routing_miss():
    index, a, b = ResidencyIndex(), WorkerFeed("A"), WorkerFeed("B")
    for x in a.batches(range(0, 20)):
        index.apply(x)
    for x in b.batches(range(0, 20), {4: [stored(H)]}):
        index.apply(x)
    v = judge(index, request("A", a.ts(12)))
    assert v.label is Label.ROUTING_MISS and v.holders == 1


def test_case_9_a_worker_that_left_the_fleet_is_no_routing_miss_after_it_left():
    """Worker B left the fleet at D (listed out, draining) still holding H: a miss on A looked
    up after D is A's own history's to decide; before D it is routing_miss; a listed worker
    that never connected leaves it unknown_history."""
    from kvmiss.schemas.config import WorkerSpec
    from kvmiss.schemas.fleet import FleetChange

    def fleet():
        index, a, b = ResidencyIndex(["A", "B"], membership_uncertainty_s=2.0), WorkerFeed("A"), WorkerFeed("B")
        for x in a.batches(range(0, 60), {3: [stored(H)], 10: [removed(H)]}):
            index.apply(x)
        for x in b.batches(range(0, 60), {4: [stored(H)]}):  # B holds H throughout
            index.apply(x)
        return index, a

    index, a = fleet()
    departed_at = a.ts(30)
    index.apply_fleet_change(FleetChange(at=departed_at, source="file", departed=("B",)))
    after = judge(index, request("A", departed_at + 10.5))
    assert after.label is Label.EVICTED and after.holders == 0, after
    before = judge(index, request("A", departed_at - 10.5))
    assert before.label is Label.ROUTING_MISS and before.holders == 1, before

    index, a = fleet()
    index.apply_fleet_change(FleetChange(at=a.ts(30), source="file",
                                         joined=(WorkerSpec(id="C", endpoint="tcp://10.0.0.9:5557"),)))
    never = judge(index, request("A", a.ts(50) - 0.5))  # C is listed, never connected
    assert never.label is Label.ROUTING_MISS  # B, a member, proves it: C does not undo a proof
    index.apply_fleet_change(FleetChange(at=a.ts(30), source="file", departed=("B",)))
    never = judge(index, request("A", a.ts(50) - 0.5))
    assert never.label is Label.UNKNOWN_HISTORY and never.history is History.LAGGING, never


def test_case_hybrid_a_shared_prefix_the_window_group_never_kept_is_window_limit_then_evicted():
    """W=64, B=32 (the window group needs 2 contiguous blocks). P (200 tokens, 6 full blocks)
    is cached: the full-attention group stores all six, the window group only P's last
    window. Q shares P's first 64 tokens: the engine reports 0 cached although the
    full-attention group held both shared blocks -> window_limit, never no_match. After
    fillers evict P from the full-attention group, P again -> evicted, read in the
    full-attention group (where it was stored), not the window group (where it never was)."""
    p = [0xA000 + i for i in range(6)]
    q = p[:2] + [0xB000 + i for i in range(2)]
    fillers = [0xC000 + i for i in range(6)]
    index, a = ResidencyIndex(), WorkerFeed("A")
    events = {
        3: [window_stored(p[4], p[5]), full_stored(*p)],
        # fillers take the pool: the engine evicts P's blocks (tail first) in both groups
        20: [*group_removed(FULL, *reversed(p)), *group_removed(WINDOW, p[5], p[4]),
             window_stored(fillers[4], fillers[5]), full_stored(*fillers)],
    }
    for b in a.batches(range(0, 40), events):
        index.apply(b)
    assert index.views("A")[0].primary_group == FULL  # learned from the stores' kinds

    v = judge(index, chain_request("A", a.ts(10) - 0.5, q, prompt_tokens=130, cached_tokens=0))
    assert v.label is Label.WINDOW_LIMIT and v.owner.value == "none" and v.kv_cache_group == WINDOW
    assert v.first_miss_block == 0 and v.missed_tokens == 128
    assert "sliding-window" in v.reason

    v = judge(index, chain_request("A", a.ts(30) - 0.5, p, prompt_tokens=200, cached_tokens=0))
    assert v.label is Label.EVICTED and (v.stored_seq, v.removed_seq) == (3, 20) and v.kv_cache_group == FULL


def test_case_hybrid_the_same_prompt_with_its_window_evicted_from_the_window_group_is_evicted():
    """The full-attention group still holds P; the window group's blocks of P were stored and
    removed: a block the limiting group needed had been stored there and removed -> evicted."""
    p = [0xA000 + i for i in range(6)]
    index, a = ResidencyIndex(), WorkerFeed("A")
    events = {3: [window_stored(p[4], p[5]), full_stored(*p)], 8: group_removed(WINDOW, p[5])}
    for b in a.batches(range(0, 20), events):
        index.apply(b)
    v = judge(index, chain_request("A", a.ts(12) - 0.5, p, prompt_tokens=200, cached_tokens=0))
    assert v.label is Label.EVICTED and (v.stored_seq, v.removed_seq) == (3, 8)
    assert "window group needed" in v.reason and "group 0" in v.reason


def test_case_full_report_mode_a_re_announcement_is_no_copy_so_one_removal_makes_it_evicted():
    """A request with `kv_cache_report_mode: "full"` hit 3 blocks: its step carries a
    BlockStored of those 3 hashes with no parent. A later single BlockRemoved of one of them
    makes it absent: a miss on it is evicted, not resident_miss (ATTRIBUTION.md rule 7). The
    re-announcing request itself (3 blocks hit, looked up in that step) tells its store from
    a recomputed duplicate; before its facts are seen, absence is not claimed either."""
    chain = [H - 1, H, H + 1]
    index, a = ResidencyIndex(), WorkerFeed("A", epoch=7)
    events = {3: [stored(*chain)], 10: [stored(*chain)], 15: [removed(H)]}
    for b in a.batches(range(0, 30), events):
        index.apply(b)
    assert index.anomalies[("re_announced_stores", "A")] == 1
    assert index.anomalies[("re_announced_blocks", "A")] == 3
    miss = request("A", a.ts(20) - 0.5)
    assert judge(index, miss).label is Label.UNKNOWN_HISTORY  # a duplicate, for all kvmiss knows yet

    reporter = RequestFacts(prompt_tokens=4 * 16 + 1, cached_tokens=3 * 16, block_size=16, worker="A",
                            lookup_time=a.ts(10) - 0.5, block_hashes=chain + [H + 2], kv_cache_report_mode="full")
    assert judge(index, reporter).label is Label.NO_MATCH  # (its 4th block was never stored)
    assert index.anomalies[("re_announced_confirmed", "A")] == 3
    v = judge(index, miss)
    assert v.label is Label.EVICTED and (v.stored_seq, v.removed_seq) == (3, 15)
