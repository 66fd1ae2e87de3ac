"""Counts come from what the engine did, not from what it said twice (ATTRIBUTION.md rule 7),
and vLLM #49125's stale partial stores.

vLLM's per-request `kv_cache_report_mode: "full"` re-announces a reused chain as a BlockStored
with no parent from block 0 (`BlockPool.emit_cached_block_events`); an exact one-block prompt
that recomputes block 0 stores it again with no parent too. On the wire the two are the same,
so such a store (no parent, its last block already resident) is never counted as a copy:
a resident claim rests on the counted copies (a lower bound), and an absence claim after it
is not made -- until the request it re-announced for (it hit those blocks, in that step)
shows what it was."""

from __future__ import annotations

from fleet_builders import (
    FULL,
    WINDOW,
    H,
    WorkerFeed,
    chain_request,
    full_stored,
    group_removed,
    group_stored,
    removed,
    request,
    stored,
    window_stored,
)

from kvmiss.enricher.core.attribution import Attributor
from kvmiss.enricher.core.index import ResidencyIndex
from kvmiss.schemas.attribution import Label


def judge(index, facts):
    return Attributor(index).attribute(facts)


def feed(index: ResidencyIndex, a: WorkerFeed, events: dict, seqs=range(0, 30)) -> None:
    for b in a.batches(seqs, events):
        index.apply(b)


def reporter(a: WorkerFeed, seq: int, chain: list[int], block_size: int = 16, mode: str | None = "full"):
    """The request that re-announced ``chain`` in batch ``seq``: it hit all of it, in full
    report mode (its spans say so)."""
    return chain_request("A", a.ts(seq) - 0.5, chain + [0xDEAD], prompt_tokens=(len(chain) + 1) * block_size + 1,
                         cached_tokens=len(chain) * block_size, block_size=block_size, kv_cache_report_mode=mode)


def test_a_re_announced_chain_never_makes_a_removed_block_look_resident():
    index, a = ResidencyIndex(), WorkerFeed("A")
    feed(index, a, {3: [stored(H - 1, H)], 6: [stored(H - 1, H)], 7: [stored(H - 1, H)], 15: [removed(H)]})
    assert index.anomalies[("re_announced_stores", "A")] == 2
    miss = request("A", a.ts(20) - 0.5)
    assert judge(index, miss).label is Label.UNKNOWN_HISTORY  # never resident_miss
    judge(index, reporter(a, 6, [H - 1, H]))
    assert judge(index, miss).label is Label.UNKNOWN_HISTORY  # the store at 7 is still open
    judge(index, reporter(a, 7, [H - 1, H]))
    v = judge(index, miss)
    assert v.label is Label.EVICTED and v.removed_seq == 15


def test_a_request_that_looked_up_after_the_store_confirms_nothing():
    """(A lookup time before the store's step may still be its own: with requests in flight a
    span's lookup time can precede the step that scheduled it. One after it cannot.)"""
    index, a = ResidencyIndex(), WorkerFeed("A")
    feed(index, a, {3: [stored(H - 1, H)], 6: [stored(H - 1, H)], 15: [removed(H)]})
    judge(index, reporter(a, 8, [H - 1, H]))
    assert index.anomalies[("re_announced_confirmed", "A")] == 0
    assert judge(index, request("A", a.ts(20) - 0.5)).label is Label.UNKNOWN_HISTORY


def test_while_the_counted_copy_stands_the_block_is_still_proven_resident():
    index, a = ResidencyIndex(), WorkerFeed("A")
    feed(index, a, {3: [stored(H - 1, H)], 6: [stored(H - 1, H)]})
    assert judge(index, request("A", a.ts(20) - 0.5)).label is Label.RESIDENT_MISS


def test_an_exact_one_block_prompts_recompute_looks_the_same_and_nothing_is_claimed_after_a_removal():
    """Block 0 stored, then stored again with no parent (the lookup limit's recompute; the
    request hit nothing, so it confirms nothing): after one removal the second copy may or may
    not remain -- neither resident_miss nor evicted is proven (the demo's ground truth found
    the duplicate real: a request that skips the cache)."""
    index, a = ResidencyIndex(), WorkerFeed("A")
    feed(index, a, {3: [stored(H)], 4: [stored(H)], 9: [removed(H)]})
    judge(index, chain_request("A", a.ts(4) - 0.5, [H], prompt_tokens=16, cached_tokens=0, block_size=16))
    v = judge(index, request("A", a.ts(12) - 0.5, cached_blocks=0, first_miss=H))
    assert v.label is Label.UNKNOWN_HISTORY and "second copy" in v.reason


def test_a_store_with_a_parent_is_a_real_copy_and_counted():
    """The lookup-limit recompute of a two-block prompt stores block 1 again with its parent."""
    index, a = ResidencyIndex(), WorkerFeed("A")
    feed(index, a, {3: [stored(H - 1, H)], 4: [stored(H, parent=H - 1)], 9: [removed(H)]})
    assert judge(index, request("A", a.ts(12) - 0.5)).label is Label.RESIDENT_MISS
    assert index.anomalies[("re_announced_stores", "A")] == 0


def test_another_worker_whose_only_removal_may_have_left_an_uncounted_copy_is_not_ruled_out():
    index, a, b = ResidencyIndex(), WorkerFeed("A"), WorkerFeed("B")
    feed(index, a, {})
    feed(index, b, {3: [stored(H - 1, H)], 5: [stored(H - 1, H)], 8: [removed(H)]})
    v = judge(index, request("A", a.ts(20) - 0.5))
    assert v.label is Label.UNKNOWN_HISTORY, v  # not no_match: B may still hold H


def test_without_the_re_announcement_that_worker_is_ruled_out():
    index, a, b = ResidencyIndex(), WorkerFeed("A"), WorkerFeed("B")
    feed(index, a, {})
    feed(index, b, {3: [stored(H - 1, H)], 8: [removed(H)]})
    assert judge(index, request("A", a.ts(20) - 0.5)).label is Label.NO_MATCH


def test_a_window_groups_re_announcement_names_blocks_it_never_stored_so_never_stored_is_not_proven():
    """In a sliding-window group the re-announced chain runs from block 0 although the group
    kept only P's last window: those blocks are not stored, and window_limit is not claimed
    over them (unknown_history, never a guess)."""
    p = [0xA000 + i for i in range(6)]
    q = p[:2] + [0xB000, 0xB001]
    index, a = ResidencyIndex(), WorkerFeed("A")
    feed(index, a, {3: [window_stored(p[4], p[5]), full_stored(*p)],
                    6: [window_stored(*p), full_stored(*p)]})  # P again, reported in full
    assert p[0] not in index.views("A")[0].tiers[("GPU", WINDOW)]
    v = judge(index, chain_request("A", a.ts(10) - 0.5, q, prompt_tokens=130, cached_tokens=0))
    assert v.label is Label.UNKNOWN_HISTORY and "re-announce" in v.reason
    # P's own request at 6 hit all six blocks: its stores were re-announcements
    judge(index, reporter(a, 6, p[:6], block_size=32))
    v = judge(index, chain_request("A", a.ts(10) - 0.5, q, prompt_tokens=130, cached_tokens=0))
    assert v.label is Label.WINDOW_LIMIT


def test_vllm_49125_a_stale_partial_store_after_its_removal_is_a_new_store_and_counted():
    """vLLM #49125: a partial-block hash removed when its block was promoted to a full one is
    stored again. The engine serves it again from then on (its lookup finds it), so it is a new
    store -- it never revives the interval the removal closed: a miss in between is evicted --
    and it is counted (`stale_partial_stores`)."""
    index, a = ResidencyIndex(), WorkerFeed("A")
    partial = H
    feed(index, a, {
        3: [group_stored(0, H - 1, block_size=32)],  # the group's blocks are 32 tokens
        4: [group_stored(0, partial, parent=H - 1, block_size=16)],  # a 16-token partial entry
        6: [removed(partial), group_stored(0, H + 5, parent=H - 1, block_size=32)],  # promotion
        12: [group_stored(0, partial, parent=H - 1, block_size=16)],  # the stale partial, again
    })
    assert index.anomalies[("stale_partial_stores", "A")] == 1
    view = index.views("A")[0]
    assert view.media["GPU"].chain(partial)[0][:2] == (12, None)  # a new interval from 12
    between = judge(index, request("A", a.ts(9) - 0.5, block_size=16))
    after = judge(index, request("A", a.ts(20) - 0.5, block_size=16))
    assert between.label is Label.EVICTED and between.removed_seq == 6
    assert after.label is Label.RESIDENT_MISS and after.stored_seq == 12


def test_a_partial_store_of_a_new_hash_is_not_counted_as_stale():
    index, a = ResidencyIndex(), WorkerFeed("A")
    feed(index, a, {3: [group_stored(0, H - 1, block_size=32)],
                    4: [group_stored(0, H, parent=H - 1, block_size=16)]})
    assert index.anomalies[("stale_partial_stores", "A")] == 0


def test_in_a_hybrid_each_groups_re_announcement_is_no_copy_of_its_own():
    index, a = ResidencyIndex(), WorkerFeed("A")
    chain = [H - 1, H, H + 1]
    feed(index, a, {3: [window_stored(H, H + 1), full_stored(*chain)],
                    5: [window_stored(*chain), full_stored(*chain)],  # reported in full, both groups
                    9: group_removed(FULL, H)})
    assert index.anomalies[("re_announced_stores", "A")] == 2
    view = index.views("A")[0]
    assert view.media["GPU"].copies(H - 1) == 1 and view.tiers[("GPU", WINDOW)].copies(H) == 1
    judge(index, reporter(a, 5, chain, block_size=32))
    v = judge(index, chain_request("A", a.ts(12) - 0.5, chain + [H + 2], prompt_tokens=130, cached_tokens=32))
    assert v.label is Label.EVICTED and v.removed_seq == 9  # read in the full-attention group


def test_marks_leave_with_retention_into_the_aged_out_filter():
    index, a = ResidencyIndex(retention_s=5.0), WorkerFeed("A")
    feed(index, a, {3: [stored(H - 1, H)], 5: [stored(H - 1, H)]})
    view = index.views("A")[0]
    assert view.unproven and view.unproven_before(0, H, 6) and not view.unproven_before(0, H, 5)
    index.prune(a.ts(29))  # horizon at seq 24: the marks of seq 5 go
    assert view.unproven == {} and H in view.pruned


def test_a_request_that_hit_part_of_a_recomputed_chain_does_not_take_it_for_its_re_announcement():
    """The demo's ground truth: in one step a request hit the shared prefix while a request that
    skips the cache recomputed the prefix and its own blocks (a real copy). Only a store of
    exactly the chain the request hit can be its re-announcement."""
    index, a = ResidencyIndex(), WorkerFeed("A")
    feed(index, a, {3: [stored(H - 1, H, H + 1)], 6: [stored(H - 1, H, H + 1)], 15: [removed(H)]})
    judge(index, reporter(a, 6, [H - 1, H]))  # hit two blocks; the store at 6 has three
    assert index.anomalies[("re_announced_confirmed", "A")] == 0
    assert judge(index, request("A", a.ts(20) - 0.5)).label is Label.UNKNOWN_HISTORY


def test_a_request_not_known_to_be_in_full_report_mode_confirms_nothing_even_for_its_exact_chain():
    """The demo's ground truth, seed 7: the same prompt twice in one step, one request hitting
    its three blocks, the other (prompt logprobs: it skips the cache) recomputing them and
    storing a real second copy with no parent. Only a request in full report mode re-announces."""
    index, a = ResidencyIndex(), WorkerFeed("A")
    feed(index, a, {3: [stored(H - 1, H, H + 1)], 6: [stored(H - 1, H, H + 1)], 15: [removed(H)]})
    for mode in (None, "incremental"):
        judge(index, reporter(a, 6, [H - 1, H, H + 1], mode=mode))
    assert index.anomalies[("re_announced_confirmed", "A")] == 0
    assert judge(index, request("A", a.ts(20) - 0.5)).label is Label.UNKNOWN_HISTORY


def test_a_deployment_that_promises_no_full_report_mode_counts_such_a_store_as_a_copy():
    """[history] kv_cache_report_mode = "incremental": a store with no parent re-storing a resident
    chain can only be a recomputed copy, so it is counted and the block outlives one removal."""
    index, a = ResidencyIndex(re_announcements=False), WorkerFeed("A")
    feed(index, a, {3: [stored(H - 1, H)], 6: [stored(H - 1, H)], 15: [removed(H)]})
    assert index.anomalies[("re_announced_stores", "A")] == 0
    assert judge(index, request("A", a.ts(20) - 0.5)).label is Label.RESIDENT_MISS


def test_the_removal_of_a_copy_never_counted_makes_no_history_gap_for_earlier_lookups():
    """Two removals after an uncounted store: the second is that copy's own (it was real after
    all). It is counted, the mark stays, and no interval 'stored before our history' is made
    of it -- which would turn every earlier lookup of the block into a gap."""
    index, a = ResidencyIndex(), WorkerFeed("A")
    feed(index, a, {3: [stored(H - 1, H)], 6: [stored(H - 1, H)], 10: [removed(H)], 12: [removed(H)]})
    assert index.anomalies[("uncounted_copies_removed", "A")] == 1
    assert judge(index, request("A", a.ts(5) - 0.5)).label is Label.RESIDENT_MISS
    assert judge(index, request("A", a.ts(20) - 0.5)).label is Label.UNKNOWN_HISTORY


def test_a_re_announcement_in_the_step_that_stored_the_block_is_no_second_copy_once_confirmed():
    """One request stores H and, later in the same engine step, a full-report request hits it
    and re-announces it (seen on the real engine, 8 in flight). Until that request is seen the
    second store may be a duplicate stored before another lookup in the step (unknown); once it
    confirms the re-announcement, a miss in that step is judged by the ordinary rule."""
    index, a = ResidencyIndex(), WorkerFeed("A")
    feed(index, a, {5: [stored(H), stored(H)]})
    miss = chain_request("A", a.ts(5) - 0.5, [H], prompt_tokens=17, cached_tokens=0, block_size=16)
    assert judge(index, miss).label is Label.UNKNOWN_HISTORY
    judge(index, chain_request("A", a.ts(5) - 0.5, [H, 0xBEEF], prompt_tokens=33, cached_tokens=16,
                               block_size=16, kv_cache_report_mode="full"))
    assert index.anomalies[("re_announced_confirmed", "A")] == 1
    assert judge(index, miss).label is Label.NO_MATCH


# --- a hybrid's window group tells a recompute from a re-announcement -------------------------
# vLLM re-announces a chain in every group in one call (group order), and a sliding-window group
# re-announces only a chain whose last cdiv(W - 1, B) blocks it held -- its hit needed them. A
# `window_limit` miss at block 0 recomputes the prompt: the full-attention group stores its
# resident chain again with no parent, and the window group stores blocks it did not hold. That
# is a real copy (seen on the real engine: a Gemma-3-style model, 8 in flight, full report mode).

P = [0xA000 + i for i in range(6)]


def _recompute_then_removal(window_group: int, full_group: int, first: str) -> tuple[ResidencyIndex, WorkerFeed]:
    index, a = ResidencyIndex(), WorkerFeed("A")
    window = window_stored(P[0], P[1], group=window_group)
    full = full_stored(P[0], P[1], group=full_group)
    feed(index, a, {
        3: [window_stored(P[4], P[5], group=window_group), full_stored(*P, group=full_group)],  # P: the window keeps its tail
        6: [window, full] if first == "window" else [full, window],  # Q = P[:2]: 0 cached (window_limit), recomputed
        9: group_removed(full_group, P[0]),  # one of the two copies
    })
    return index, a


def test_a_window_limit_recompute_is_a_real_copy_whichever_group_comes_first():
    for window_group, full_group, first in ((0, 1, "window"), (1, 0, "full")):
        index, a = _recompute_then_removal(window_group, full_group, first)
        view = index.views("A")[0]
        assert index.anomalies[("re_announced_stores", "A")] == 0, first
        assert view.tiers[("GPU", full_group)].copies(P[0]) == 1 and view.tiers[("GPU", window_group)].copies(P[0]) == 1
        # a lookup after the removal: the second copy stayed, and the window group held the
        # window, so the engine would have hit block 0 -- resident, not a doubt about a mark
        v = judge(index, chain_request("A", a.ts(12) - 0.5, P[:2] + [0xBEEF], prompt_tokens=80, cached_tokens=0,
                                       skip_reading_prefix_cache=False))
        assert v.label is Label.RESIDENT_MISS, (first, v.reason)


def test_a_re_announcement_of_a_chain_whose_window_the_group_held_stays_a_possible_one():
    """The same stores, but the window group held Q's window (P[:2]) before: a full-report hit of
    Q would re-announce exactly this, so nothing is counted until its request says which."""
    index, a = ResidencyIndex(), WorkerFeed("A")
    feed(index, a, {3: [window_stored(*P[:2]), full_stored(*P)],
                    6: [window_stored(*P[:2]), full_stored(*P[:2])]})
    assert index.anomalies[("re_announced_stores", "A")] == 2
    assert index.views("A")[0].media["GPU"].copies(P[0]) == 1


def test_a_recompute_and_a_re_announcement_of_one_chain_in_one_step_are_told_apart():
    """In one step request A recomputes Q (window_limit) and request B, scheduled after it,
    hits A's fresh blocks and re-announces them: only B's pair is a possible re-announcement."""
    index, a = ResidencyIndex(), WorkerFeed("A")
    feed(index, a, {3: [window_stored(P[4], P[5]), full_stored(*P)],
                    6: [window_stored(*P[:2]), full_stored(*P[:2]), window_stored(*P[:2]), full_stored(*P[:2])]})
    view = index.views("A")[0]
    assert index.anomalies[("re_announced_stores", "A")] == 2  # B's two events
    assert view.media["GPU"].copies(P[0]) == 2 and view.tiers[("GPU", WINDOW)].copies(P[0]) == 1


def test_without_a_whole_history_the_window_groups_tail_proves_nothing():
    """Followed from a joined run (blocks stored before kvmiss followed are not in its tables),
    a tail the window group shows no copy of may have been held: the full-attention group's
    store stays a possible re-announcement."""
    index, a = ResidencyIndex(), WorkerFeed("A")
    feed(index, a, {3: [window_stored(P[4], P[5]), full_stored(*P)],
                    6: [window_stored(*P[:2]), full_stored(*P[:2])]}, seqs=range(2, 30))
    view = index.views("A")[0]
    assert view.unproven_before(FULL, P[0], 7) and view.media["GPU"].copies(P[0]) == 1


def test_a_copy_stored_earlier_in_the_lookup_step_would_have_been_hit_so_none_preceded():
    """Two copies of Q's first block in Q's lookup step. Had the first preceded the lookup, its
    call stored the window group's blocks too, and vLLM's hit rule over them gives a hit Q did
    not get: so no copy preceded, and the step's stores came after the lookup (no_match). With
    the full-attention group first in the step, the window group's part of that call comes
    after the copy, and the doubt stays."""
    q = [0xC000, 0xC001]
    for window_group, full_group, expected in ((0, 1, Label.NO_MATCH), (1, 0, Label.UNKNOWN_HISTORY)):
        index, a = ResidencyIndex(), WorkerFeed("A")
        pair = ([window_stored(*q, group=window_group), full_stored(*q, group=full_group)] if window_group == 0
                else [full_stored(*q, group=full_group), window_stored(*q, group=window_group)])
        feed(index, a, {3: [window_stored(P[4], P[5], group=window_group), full_stored(*P, group=full_group)],
                        6: pair + pair})  # another request's compute, then Q's own (or a re-announcement)
        v = judge(index, chain_request("A", a.ts(6) - 0.5, q, prompt_tokens=64, cached_tokens=0,
                                       skip_reading_prefix_cache=False))
        assert v.label is expected, (window_group, v.reason)
        if expected is Label.UNKNOWN_HISTORY:
            assert "two copies" in v.reason or "re-announce" in v.reason


def test_a_request_looked_up_twice_before_admission_confirms_both_re_announcements():
    """Seen on the real engine (plugin mode, 8 in flight): a full-report request hit H in step 5,
    did not fit, hit it again in step 6 and was admitted there. Both steps re-announced H; its
    span's lookup is step 6's, its earlier lookup step 5's. Both are confirmed, so the one copy
    removed at 9 leaves H evicted -- with only the admitted lookup, step 5's store stayed a
    possible copy and the miss unknown."""
    def run(earlier):
        index, a = ResidencyIndex(), WorkerFeed("A")
        feed(index, a, {3: [stored(H - 1, H)], 5: [stored(H - 1, H)], 6: [stored(H - 1, H)], 9: [removed(H)]})
        judge(index, chain_request("A", a.ts(6) - 0.5, [H - 1, H, 0xBEEF], prompt_tokens=40, cached_tokens=32,
                                   block_size=16, kv_cache_report_mode="full",
                                   earlier_lookups=tuple((a.ts(s) - 0.5, 32) for s in earlier)))
        return index, judge(index, request("A", a.ts(12) - 0.5))
    index, v = run([5])
    assert index.anomalies[("re_announced_confirmed", "A")] == 4 and v.label is Label.EVICTED
    _, v = run([])
    assert v.label is Label.UNKNOWN_HISTORY


def test_the_steps_kept_in_order_are_a_hybrids_only_and_bounded(monkeypatch):
    """A single-group engine keeps none (its rule needs no step order); a hybrid at most
    `MAX_COPY_STEPS`, the oldest dropped first (such a step keeps its doubt)."""
    from kvmiss.enricher.core import uncounted_stores as uncounted_module

    monkeypatch.setattr(uncounted_module, "MAX_COPY_STEPS", 3)
    index, a = ResidencyIndex(), WorkerFeed("A")
    feed(index, a, {s: [stored(H + s), stored(H + s)] for s in range(2, 8)})
    assert index.views("A")[0].copy_steps == {}
    index, a = ResidencyIndex(), WorkerFeed("A")
    feed(index, a, {1: [window_stored(0xAAAA), full_stored(0xBBBB)],
                    **{s: [full_stored(H + s), full_stored(H + s)] for s in range(2, 8)}})
    assert list(index.views("A")[0].copy_steps) == [5, 6, 7]
