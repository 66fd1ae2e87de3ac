"""Hybrid models: KV-cache groups learned from events, the per-kind hit rule, the limiting
group, and the labels read in it (window_limit, evicted there, unknown for kinds not modelled)."""

from __future__ import annotations

from fleet_builders import (
    FULL,
    WINDOW,
    WorkerFeed,
    chain_request,
    full_stored,
    group_removed,
    group_stored,
    window_stored,
)
from hypothesis import given, settings, strategies as st

from kvmiss.enricher.core.attribution import Attributor
from kvmiss.enricher.core.hit_rule import full_attention_hit, hybrid_hit, window_hit
from kvmiss.enricher.core.index import ResidencyIndex
from kvmiss.schemas.attribution import History, KVCacheGroup, Label
from kvmiss.schemas.stream import RunStart

P = [0xA000 + i for i in range(6)]  # a 200-token prompt: six 32-token blocks
Q = P[:2] + [0xB000, 0xB001]  # shares P's first 64 tokens


def judge(index, facts):
    return Attributor(index).attribute(facts)


def worker(events: dict, *, seqs=range(0, 40), feed: WorkerFeed | None = None) -> tuple[ResidencyIndex, WorkerFeed]:
    index, a = ResidencyIndex(), feed or WorkerFeed("A")
    for b in a.batches(seqs, events):
        index.apply(b)
    return index, a


# --- the plain rule, from the spec, as an oracle -----------------------------------------------

def accepts(group: KVCacheGroup, cached: set[int], p: int) -> bool:
    """ATTRIBUTION.md / vLLM, read plainly: full attention accepts p blocks when all of
    [0, p) are cached; a window group when p == 0, or the `need` blocks ending at p are, or
    p < need and all of [0, p) are."""
    if group.full_attention:
        return all(i in cached for i in range(p))
    need = group.window_blocks
    return p == 0 or all(i in cached for i in range(max(0, p - need), p))


def oracle(groups, cached: dict[int, set[int]], max_blocks: int) -> int:
    return max(p for p in range(max_blocks + 1) if all(accepts(g, cached[g.idx], p) for g in groups))


GROUP_SETS = st.lists(st.sampled_from([16, 32, 33, 64, 65, 96, 128]), min_size=0, max_size=3).map(
    lambda windows: [KVCacheGroup(0, "full_attention", None, 16)]
    + [KVCacheGroup(i + 1, "sliding_window", w, 16) for i, w in enumerate(windows)])


@settings(max_examples=400, deadline=None)
@given(groups=GROUP_SETS, data=st.data(), max_blocks=st.integers(0, 12))
def test_the_hybrid_hit_is_the_longest_length_every_group_accepts(groups, data, max_blocks):
    cached = {g.idx: set(data.draw(st.sets(st.integers(0, 12)))) for g in groups}
    hit, limiting = hybrid_hit(groups, lambda g, i: i in cached[g], max_blocks)
    assert hit == oracle(groups, cached, max_blocks)
    if hit < max_blocks:  # the limiting group refuses every longer length the others accept
        assert limiting is not None
        refused = next(g for g in groups if g.idx == limiting)
        others = [g for g in groups if g.idx != limiting]
        for p in range(hit + 1, max_blocks + 1):
            if all(accepts(g, cached[g.idx], p) for g in others):
                assert not accepts(refused, cached[limiting], p)
    else:
        assert limiting is None


@settings(max_examples=300, deadline=None)
@given(cached=st.sets(st.integers(0, 10)), max_blocks=st.integers(0, 10), need=st.integers(1, 4))
def test_each_kinds_rule_alone_matches_the_plain_reading(cached, max_blocks, need):
    full = KVCacheGroup(0, "full_attention", None, 16)
    window = KVCacheGroup(1, "sliding_window", need * 16 + 1, 16)
    assert window.window_blocks == need
    assert full_attention_hit(cached.__contains__, max_blocks) == oracle([full], {0: cached}, max_blocks)
    assert window_hit(cached.__contains__, max_blocks, need) == oracle([window], {1: cached}, max_blocks)


def test_window_blocks_is_cdiv_of_the_window_less_one():
    assert KVCacheGroup(0, "sliding_window", 64, 32).window_blocks == 2  # cdiv(63, 32)
    assert KVCacheGroup(0, "sliding_window", 65, 32).window_blocks == 2  # cdiv(64, 32)
    assert KVCacheGroup(0, "sliding_window", 66, 32).window_blocks == 3
    assert KVCacheGroup(0, "mamba", None, 32).window_blocks == 1  # a state group: its state at the last boundary
    assert KVCacheGroup(0, "chunked_local_attention", None, 32).window_blocks is None


# --- groups learned from the events ------------------------------------------------------------

def test_the_full_attention_group_is_learned_from_the_stores_kinds_whatever_its_index():
    index, _ = worker({3: [window_stored(P[4], P[5]), full_stored(*P)]})
    view = index.views("A")[0]
    assert view.primary_group == FULL and view.hybrid
    assert view.groups[WINDOW] == KVCacheGroup(WINDOW, "sliding_window", 64, 32)
    assert P[0] in view.media["GPU"] and P[0] not in view.tiers[(("GPU", WINDOW))]


def test_a_single_unnamed_group_stays_the_one_full_attention_group():
    index, _ = worker({3: [group_stored(0, *P, kind=None)]})
    view = index.views("A")[0]
    assert not view.hybrid and view.primary_group == 0


def test_a_group_seen_first_through_a_removal_is_learned_at_its_first_store():
    index, _ = worker({3: group_removed(WINDOW, 7), 4: [window_stored(P[4], P[5])], 5: [full_stored(*P)]},
                      feed=WorkerFeed("A"))
    view = index.views("A")[0]
    assert view.groups[WINDOW].kind == "sliding_window" and view.primary_group == FULL


# --- labels read in the limiting group -----------------------------------------------------------

def test_a_window_group_with_a_gap_before_its_blocks_is_unknown_not_window_limit():
    a = WorkerFeed("A")
    a.start_run(0, RunStart.JOINED)  # joined mid-epoch: "never stored" is not provable
    index, _ = worker({3: [window_stored(P[4], P[5]), full_stored(*P)]}, feed=a)
    v = judge(index, chain_request("A", a.ts(10) - 0.5, Q, prompt_tokens=130, cached_tokens=0))
    assert v.label is Label.UNKNOWN_HISTORY and v.history is History.GAP


def test_a_prompt_the_full_attention_group_never_held_is_no_match_even_in_a_hybrid():
    index, a = worker({3: [window_stored(P[4], P[5]), full_stored(*P)]})
    other = [0xD000 + i for i in range(4)]
    v = judge(index, chain_request("A", a.ts(10) - 0.5, other, prompt_tokens=130, cached_tokens=0))
    assert v.label is Label.NO_MATCH


def test_a_group_of_a_kind_not_modelled_that_limited_the_hit_is_unknown_history_naming_the_kind():
    """Chunked local attention has no rule here (Mamba state groups do:
    test_state_groups.py)."""
    local = 2
    index, a = worker({3: [full_stored(*P), group_stored(local, P[5], kind="chunked_local_attention")]})
    v = judge(index, chain_request("A", a.ts(10) - 0.5, Q, prompt_tokens=130, cached_tokens=0))
    assert v.label is Label.UNKNOWN_HISTORY and "chunked_local_attention" in v.reason


def test_with_a_group_not_modelled_a_miss_the_full_attention_group_explains_is_still_judged():
    """The full-attention group cut the hit at H itself (it never held H): the engine could not
    have served more whatever the other group held, so the label stands."""
    local = 2
    index, a = worker({3: [full_stored(*P), group_stored(local, P[5], kind="chunked_local_attention")]})
    other = [0xD000 + i for i in range(4)]
    v = judge(index, chain_request("A", a.ts(10) - 0.5, other, prompt_tokens=130, cached_tokens=0))
    assert v.label is Label.NO_MATCH


def test_an_unknown_kind_is_named_only_by_what_the_release_knows():
    index, a = worker({3: [full_stored(*P), group_stored(2, P[5], kind="a/secret/path")]})
    v = judge(index, chain_request("A", a.ts(10) - 0.5, Q, prompt_tokens=130, cached_tokens=0))
    assert v.label is Label.UNKNOWN_HISTORY and "does not know" in v.reason and "secret" not in v.reason


def test_a_model_without_a_full_attention_group_is_unknown():
    index, a = worker({3: [window_stored(P[4], P[5])]})
    v = judge(index, chain_request("A", a.ts(10) - 0.5, Q, prompt_tokens=130, cached_tokens=0))
    assert v.label is Label.UNKNOWN_HISTORY and "no full-attention group" in v.reason


def test_groups_of_another_block_size_than_the_requests_hash_unit_are_unknown():
    """Fine-grained hash units (prefix_match_unit): the request's chain is in 16-token units,
    the window group's blocks are 32 tokens -- not modelled, so never a guess."""
    index, a = worker({3: [group_stored(FULL, *P, block_size=16),
                           group_stored(WINDOW, P[4], P[5], kind="sliding_window", window=64, block_size=32)]})
    v = judge(index, chain_request("A", a.ts(10) - 0.5, Q, prompt_tokens=65, cached_tokens=0, block_size=16))
    assert v.label is Label.UNKNOWN_HISTORY and "block size" in v.reason


def test_every_group_holding_what_it_needed_is_a_resident_miss():
    index, a = worker({3: [window_stored(P[0], P[1]), full_stored(*P)]})
    v = judge(index, chain_request("A", a.ts(10) - 0.5, Q, prompt_tokens=130, cached_tokens=0))
    assert v.label is Label.RESIDENT_MISS


def test_in_a_hybrid_another_workers_full_attention_copy_does_not_prove_routing():
    index, a = worker({3: [window_stored(P[4], P[5]), full_stored(*P)]})
    b = WorkerFeed("B")
    for x in b.batches(range(0, 40), {3: [window_stored(P[4], P[5]), full_stored(*P)],
                                      9: group_removed(FULL, *reversed(P))}):
        index.apply(x)
    # On A: P's blocks were evicted from the full-attention group (B still holds them there).
    for x in a.batches(range(40, 50), {41: group_removed(FULL, *reversed(P))}):
        index.apply(x)
    v = judge(index, chain_request("B", b.ts(30), P, prompt_tokens=200, cached_tokens=0))
    assert v.label is Label.UNKNOWN_HISTORY and "other KV-cache groups" in v.reason


def test_a_full_attention_group_in_larger_blocks_than_the_requests_hash_unit_is_unknown_not_no_match():
    """prefix_match_unit 16 under 32-token blocks: the request's chain is in 16-token hashes,
    the group stores the hash at each 32-token boundary, so an interior hash is never stored
    there -- not a prompt change. Never no_match."""
    fine = [0xE000 + i for i in range(8)]
    index, a = worker({3: [group_stored(FULL, *fine[1::2], block_size=32),
                           group_stored(2, fine[7], kind="mamba", block_size=32)]})
    v = judge(index, chain_request("A", a.ts(10) - 0.5, fine, prompt_tokens=129, cached_tokens=32, block_size=16))
    assert v.label is Label.UNKNOWN_HISTORY and "block size 32" in v.reason
