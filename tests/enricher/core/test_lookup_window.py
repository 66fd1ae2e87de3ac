"""A lookup known only within a window (vLLM's `llm_request` without the kvmiss plugin).

vLLM's span starts when the API server took the request; its time in queue runs from when the
engine core queued it, so start + time in queue is only the earliest the lookup can have been
(measured on the real engine with 8 requests in flight: up to ~100 ms early, a step or more
before the lookup). Start + time to first token - prefill time is the latest. A verdict then
stands only if every engine step in between -- of any worker: another worker's step may
change what it held -- gives the same label; otherwise it is unknown, never the label of the
wrong step."""

from __future__ import annotations

import msgspec
from fleet_builders import (
    PARENT,
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

from kvmiss.enricher.core.attribution import MAX_WINDOW_STEPS, Attributor
from kvmiss.enricher.core.index import ResidencyIndex
from kvmiss.schemas.attribution import Label


def one_worker(events: dict) -> tuple[ResidencyIndex, WorkerFeed]:
    index, a = ResidencyIndex(), WorkerFeed("A")
    for b in a.batches(range(0, 30), events):
        index.apply(b)
    return index, a


def test_a_window_whose_steps_give_two_labels_is_unknown_naming_both():
    """H stored at 3, removed in step 10. A lookup in step 9 finds it resident (resident_miss),
    one in step 10 finds it removed (vLLM frees before it allocates: evicted). A window
    reaching both is unknown -- the resident_miss its earliest time alone gave was wrong on
    the real engine."""
    index, a = one_worker({3: [stored(H)], 10: [removed(H)]})
    early = request("A", a.ts(9) - 0.5)
    assert Attributor(index).attribute(early).label is Label.RESIDENT_MISS  # the earliest time alone
    v = Attributor(index).attribute(request("A", a.ts(9) - 0.5, lookup_time_latest=a.ts(10) - 0.1))
    assert v.label is Label.UNKNOWN_HISTORY
    assert "resident_miss" in v.reason and "evicted" in v.reason and "window" in v.reason
    assert v.first_miss_block == 1 and v.missed_tokens > 0  # the request's own facts stay


def test_a_window_inside_one_step_or_whose_steps_agree_keeps_its_label():
    index, a = one_worker({3: [stored(H)], 10: [removed(H)]})
    same_step = request("A", a.ts(9) - 0.5, lookup_time_latest=a.ts(9) - 0.1)
    assert Attributor(index).attribute(same_step).label is Label.RESIDENT_MISS
    after = request("A", a.ts(12) - 0.5, lookup_time_latest=a.ts(16) - 0.5)  # steps 12-16: all removed
    v = Attributor(index).attribute(after)
    assert v.label is Label.EVICTED and v.removed_seq == 10


def test_another_workers_step_inside_the_window_counts_too():
    """B held H until its step 8 (stamped 1008.3); A's lookup is known within [1007.2, 1008.5].
    Before B's removal the miss is a routing_miss (B held it), after it B had removed it and A
    never held it. Both are possible: unknown."""
    index = ResidencyIndex(["A", "B"])
    a, b = WorkerFeed("A"), WorkerFeed("B", ts0=1000.3)
    for batch in sorted([*a.batches(range(0, 20), {}), *b.batches(range(0, 20), {2: [stored(H)], 8: [removed(H)]})],
                        key=lambda x: x.ts):
        index.apply(batch)
    early = request("A", 1007.2)
    assert Attributor(index).attribute(early).label is Label.ROUTING_MISS
    late = request("A", 1008.6)
    assert Attributor(index).attribute(late).label is not Label.ROUTING_MISS
    v = Attributor(index).attribute(request("A", 1007.2, lookup_time_latest=1008.5))
    assert v.label is Label.UNKNOWN_HISTORY and "routing_miss" in v.reason


def test_a_window_reaching_more_steps_than_are_judged_is_unknown():
    index, a = ResidencyIndex(), WorkerFeed("A")
    for batch in a.batches(range(0, 2 * MAX_WINDOW_STEPS), {3: [stored(H)]}):
        index.apply(batch)
    wide = request("A", a.ts(4) - 0.5, lookup_time_latest=a.ts(4) + MAX_WINDOW_STEPS + 0.5)
    v = Attributor(index).attribute(wide)
    assert v.label is Label.UNKNOWN_HISTORY and "more engine steps" in v.reason


def test_a_hit_needs_no_window():
    index, a = one_worker({3: [stored(H)], 10: [removed(H)]})
    hit = chain_request("A", a.ts(9) - 0.5, [7, H, 9, 10], prompt_tokens=65, cached_tokens=64, block_size=16,
                        lookup_time_latest=a.ts(12))
    assert Attributor(index).attribute(hit).label is Label.HIT


def test_a_step_where_the_engine_would_have_hit_the_block_is_not_the_lookup():
    """The request's own recompute stores H in its lookup step (10); a window reaching step 11
    sees H resident there, with the block before it: vLLM's full-attention lookup would then
    have hit H, and the engine said it did not -- so the lookup was not in step 11, and the
    window's other steps agree on no_match (ATTRIBUTION.md rule 4, across a window)."""
    index, a = one_worker({2: [stored(PARENT)], 10: [stored(H, parent=PARENT)]})
    own = request("A", a.ts(9) - 0.5, lookup_time_latest=a.ts(11) - 0.5)  # steps 9, 10 and 11
    assert Attributor(index).attribute(msgspec.structs.replace(own, lookup_time=a.ts(11) - 0.5)).label \
        is Label.RESIDENT_MISS  # what step 11 alone would say
    assert Attributor(index).attribute(own).label is Label.NO_MATCH


def test_a_step_where_the_block_was_held_but_one_before_it_was_not_stays_possible():
    """H held in step 9 but the block before it was not: the engine's lookup would have stopped
    before H anyway, so step 9 is not ruled out, and its resident_miss against step 10's
    evicted leaves the request unknown."""
    index, a = one_worker({3: [stored(H, parent=PARENT)], 10: [removed(H)]})
    v = Attributor(index).attribute(request("A", a.ts(9) - 0.5, lookup_time_latest=a.ts(10) - 0.1))
    assert v.label is Label.UNKNOWN_HISTORY
    index, a = one_worker({2: [stored(PARENT)], 3: [stored(H, parent=PARENT)], 10: [removed(H)]})
    v = Attributor(index).attribute(request("A", a.ts(9) - 0.5, lookup_time_latest=a.ts(10) - 0.1))
    assert v.label is Label.EVICTED and v.removed_seq == 10  # step 9 would have hit H


def test_on_a_hybrid_the_window_groups_rule_decides_whether_the_engine_would_have_hit():
    """A Gemma-3-style hybrid (window group 0, full attention 1): a 200-token prompt recomputes
    its six blocks in step 10, the window group keeping its last window (blocks 4 and 5). From
    step 11 on, vLLM's coordinator would hit all six (the full group's run, the window's
    rightmost two contiguous blocks), though a search limited to block 0 would find no
    window: so step 11, where kvmiss alone says resident_miss, is not the lookup of a request
    that read the cache. One that may have skipped it stays unknown."""
    chain = [0xC0DE_0000 + i for i in range(6)]
    index, a = one_worker({2: [window_stored(0xAAAA), full_stored(0xBBBB)],
                           10: [full_stored(*chain), window_stored(*chain[4:])]})
    facts = chain_request("A", a.ts(9) - 0.5, chain, prompt_tokens=200, cached_tokens=0,
                          lookup_time_latest=a.ts(11) - 0.5, skip_reading_prefix_cache=False)
    assert Attributor(index).attribute(msgspec.structs.replace(
        facts, lookup_time=a.ts(11) - 0.5, lookup_time_latest=None)).label is Label.RESIDENT_MISS
    assert Attributor(index).attribute(facts).label is Label.NO_MATCH
    maybe_skipped = msgspec.structs.replace(facts, skip_reading_prefix_cache=None)
    assert Attributor(index).attribute(maybe_skipped).label is Label.UNKNOWN_HISTORY


def test_a_step_where_the_engine_would_have_hit_is_ruled_out_whatever_its_label():
    """The hybrid's window group held blocks 0..2 from step 3 and lost block 2 in step 8. In a
    step after that, evidence names the removed block the window group needed for a three-block
    hit (evicted), but vLLM's window search still finds blocks 0 and 1 and the engine would have
    hit two -- the request got none, so its lookup was not there. Only the steps before 3 remain:
    no_match (seen on the real engine, 8 in flight: evicted against no_match had left it unknown)."""
    chain = [0xD0_0000 + i for i in range(3)]
    index, a = one_worker({1: [window_stored(0xAAAA), full_stored(0xBBBB)],
                           3: [window_stored(*chain), full_stored(*chain)],
                           8: group_removed(WINDOW, chain[2])})
    facts = chain_request("A", a.ts(2) - 0.5, chain, prompt_tokens=100, cached_tokens=0,
                          lookup_time_latest=a.ts(9) - 0.5, skip_reading_prefix_cache=False)
    late = msgspec.structs.replace(facts, lookup_time=a.ts(9) - 0.5, lookup_time_latest=None)
    assert Attributor(index).attribute(late).label is Label.EVICTED  # what the late step alone says
    assert Attributor(index).attribute(facts).label is Label.NO_MATCH
    maybe_skipped = msgspec.structs.replace(facts, skip_reading_prefix_cache=None)
    assert Attributor(index).attribute(maybe_skipped).label is Label.UNKNOWN_HISTORY


def test_a_window_where_every_step_would_have_hit_contradicts_the_spans_and_is_unknown():
    """PARENT and H held through the whole window: vLLM would have hit both in every step, yet
    the engine reported nothing cached. No step fits: unknown, never the label of one of them."""
    index, a = one_worker({2: [stored(PARENT)], 3: [stored(H, parent=PARENT)]})
    v = Attributor(index).attribute(request("A", a.ts(6) - 0.5, cached_blocks=0, first_miss=PARENT,
                                            lookup_time_latest=a.ts(9) - 0.5, skip_reading_prefix_cache=False))
    assert v.label is Label.UNKNOWN_HISTORY and "no engine step" in v.reason


def own_prompt(a: WorkerFeed, **extra):
    """A request that hit nothing: H, H+1 (33 tokens), its window over steps 9, 10 and 11."""
    return chain_request("A", a.ts(9) - 0.5, [H, H + 1], prompt_tokens=33, cached_tokens=0, block_size=16,
                         lookup_time_latest=a.ts(11) - 0.5, **extra)


def test_a_step_after_which_its_own_prompt_was_never_stored_is_not_the_lookup():
    """Its spans do not say it read the cache, so the engine's hit rule cannot speak for step 11,
    where H is held. But vLLM stores a request's computed blocks when it schedules them, and
    nothing of its prompt was stored from step 11 until it finished: its own store (10) came
    before, so its lookup did too."""
    index, a = one_worker({10: [stored(H, H + 1)]})
    assert Attributor(index).attribute(own_prompt(a)).label is Label.UNKNOWN_HISTORY  # no finish time
    assert Attributor(index).attribute(own_prompt(a, finish_time=a.ts(12) - 0.5)).label is Label.NO_MATCH


def test_a_store_of_its_prompt_after_the_step_keeps_the_step_possible():
    """A second parentless store of the same prompt in step 12, before it finished (another
    request's, or its own if it skipped the cache and the one at 10 was another's): step 11
    stays possible."""
    index, a = one_worker({10: [stored(H, H + 1)], 12: [stored(H, H + 1)]})
    v = Attributor(index).attribute(own_prompt(a, finish_time=a.ts(13) - 0.5))
    assert v.label is Label.UNKNOWN_HISTORY and "window" in v.reason


def test_without_history_through_its_finish_nothing_is_ruled_out():
    index, a = one_worker({10: [stored(H, H + 1)]})
    assert Attributor(index).attribute(own_prompt(a, finish_time=a.ts(40))).label is Label.UNKNOWN_HISTORY
