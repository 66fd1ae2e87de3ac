"""Evidence for a hybrid model: which KV-cache group limited the hit, read in that group.

`evidence.gather` calls `limiting_group_evidence` when the chosen worker's epoch named
several KV-cache groups (or one that is not full attention: `EpochResidency.hybrid`). The engine's
hit is the longest length every group accepts (enricher/core/hit_rule.py). With the reported
C and the request's chain, the first missed block H = h[C / B]:

  * H not held by the full-attention group at t: that group alone cut the hit at C (its
    leading run ends there, whatever the others hold). The caller judges H in it as for a
    single group (None is returned): evicted, no_match, resident_miss or unknown.
  * H held there: the full-attention group allowed a longer hit, ``p`` blocks (its leading
    run, up to the lookup limit), and another group refused it. Each other group is asked
    once (`WorkerLookup.fate`) for the blocks its rule needs at ``p``; the first that lacks
    one is the limiting group, and its blocks decide: one that history cannot place ->
    unknown_history; one stored there in this epoch and removed before t -> evicted (read in
    that group); all never stored there since a known-empty point -> window_limit. When every
    group holds what it needs, the index contradicts the engine: None again, and the caller
    finds H resident (resident_miss).

A Mamba / linear-attention state group is read like a window of one block: the state at
the boundary ``p`` it needed (window_limit when never stored there, evicted when removed).
A group whose hit rule is not modelled (chunked local attention, a kind this release does
not know), a model with no full-attention group, or a group whose
block size is not the request's (fine-grained hash units, ``prefix_match_unit``) gives
``Evidence.unmodelled`` naming it: unknown_history, never a label computed as if it were
full attention (ATTRIBUTION.md rule 8). The timing and continuity rules are enricher/core/worker_lookup.py's.
"""

from __future__ import annotations

from typing import Any

from kvmiss.enricher.core.geometry import first_miss_index, lookup_limit_blocks
from kvmiss.enricher.core.hit_rule import rule_for
from kvmiss.enricher.core.worker_lookup import BlockAt, Fate, WorkerLookup
from kvmiss.schemas.attribution import Evidence, History, Presence, RequestFacts


def limiting_group_evidence(at: WorkerLookup, facts: RequestFacts, base: dict[str, Any]) -> Evidence | None:
    """The evidence of the group that limited the hit, or None when the full-attention group
    did (or the index holds everything the groups needed): the caller judges H there."""
    b, chain = facts.block_size, facts.block_hashes or []
    groups = at.groups()
    primary = groups.primary
    if primary is None or not primary.full_attention:
        return Evidence(history=History.CONTINUOUS,
                        unmodelled=f"no full-attention group ({', '.join(groups.kinds)})", **base)
    if primary.block_size not in (0, b):  # fine-grained hash units: H may sit inside a block
        return Evidence(history=History.CONTINUOUS, group=primary.idx, unmodelled=(
            f"groups of block size {primary.block_size} for requests hashed in blocks of {b}"), **base)
    first = first_miss_index(facts.cached_tokens, b)
    limit = min(lookup_limit_blocks(facts.prompt_tokens, b), len(chain))
    run_end = first
    for key in chain[first:limit]:
        if at.fate(key, primary.idx).fate is not Fate.HELD:
            break
        run_end += 1
    if run_end == first:
        return None  # the full-attention group cut the hit at H itself
    failing: list[tuple[int, list[BlockAt]]] = []
    state: dict[int, bool] = {}  # a Mamba group's verdicts say so
    for idx, group in groups.others:
        rule = rule_for(group, b)
        if not rule.modelled:
            return Evidence(history=History.CONTINUOUS, group=idx, unmodelled=rule.reason, **base)
        found = [at.fate(chain[i], idx) for i in rule.needed(run_end)]
        if any(block.fate is not Fate.HELD for block in found):
            failing.append((idx, found))
            state[idx] = rule.keeps_state
    if not failing:
        return None  # every group held what it needed: the caller finds H resident
    return _failing_group_evidence(at, failing, state, base)


def _failing_group_evidence(at: WorkerLookup, failing: list[tuple[int, list[BlockAt]]], state: dict[int, bool],
                            base: dict[str, Any]) -> Evidence:
    """The groups that refused the longer hit: a block history cannot place, then one not
    counted as a copy, then one removed before t, else every block never stored (window_limit)."""
    for idx, found in failing:
        for block in found:
            if block.fate is Fate.UNPLACED:
                history = block.history or History.GAP
                extra = at.gap if history is History.GAP else {}
                if history is History.AGED_OUT:
                    extra = {"window_start_ts": at.horizon_ts}
                return Evidence(history=history, group=idx, window_group=True, state_group=state[idx], **extra,
                                **base)
    for idx, found in failing:
        if any(block.fate is Fate.UNPROVEN for block in found):
            return Evidence(history=History.CONTINUOUS, group=idx, window_group=True, state_group=state[idx],
                            re_announced=True, **base)
    for idx, found in failing:
        for block in found:
            if block.fate is Fate.REMOVED:
                node = block.interval
                return Evidence(history=History.CONTINUOUS, presence=Presence.EVICTED, group=idx, window_group=True,
                                state_group=state[idx],
                                stored_seq=node.stored_seq, stored_ts=node.stored_ts,  # type: ignore[union-attr]
                                removed_seq=node.removed_seq, removed_ts=node.removed_ts,  # type: ignore[union-attr]
                                removed_by_clear=node.removed_by_clear, **base)  # type: ignore[union-attr]
    # (every block not held is NEVER here, each with the same known-empty point)
    window_start, window_start_ts = next(block.since for _, found in failing for block in found  # type: ignore[misc]
                                         if block.fate is Fate.NEVER)
    return Evidence(history=History.CONTINUOUS, presence=Presence.ABSENT, group=failing[0][0],
                    window_group=True, state_group=state[failing[0][0]], window_limit=True, window_start=window_start,
                    window_start_ts=window_start_ts, **base)
