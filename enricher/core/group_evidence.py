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
    once (`EpochResidency.residency`) for the blocks its rule needs at ``p``; the first that lacks
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
full attention (ATTRIBUTION.md rule 8). The timing and continuity rules are evidence.py's.
"""

from __future__ import annotations

import enum
from typing import Any, NamedTuple

from kvmiss.enricher.core.epoch_residency import EpochResidency
from kvmiss.enricher.core.geometry import first_miss_index, lookup_limit_blocks
from kvmiss.enricher.core.hit_rule import kind_name, rule_for
from kvmiss.enricher.core.residency_types import HistoryRun, Interval
from kvmiss.schemas.attribution import Evidence, History, Presence, RequestFacts, WindowStart
from kvmiss.schemas.stream import RunStart


class Fate(enum.Enum):
    """A block of one group at the lookup time."""

    HELD = "held"
    REMOVED = "removed"  # stored in this run, removed before t
    NEVER = "never"  # no record since a known-empty point
    UNPROVEN = "unproven"  # a store not counted as a copy (rule 7) leaves it open
    UNPLACED = "unplaced"  # history cannot say


class BlockAt(NamedTuple):
    fate: Fate
    interval: Interval | None = None
    history: History | None = None  # why UNPLACED


def fates(view: EpochResidency, group: int, keys: list[int], step_seq: int, run: HistoryRun) -> list[BlockAt]:
    """Each key's fate in ``group`` at the lookup step (evidence.py's timing rules)."""
    out: list[BlockAt] = []
    known_empty = None
    for key, node in zip(keys, view.residency(group, keys, step_seq)):
        if node is None:
            if key in view.pruned:
                out.append(BlockAt(Fate.UNPLACED, history=History.AGED_OUT))
                continue
            if view.unproven and view.unproven_before(group, key, step_seq):
                out.append(BlockAt(Fate.UNPROVEN))
                continue
            if known_empty is None:
                known_empty = run.start is RunStart.EPOCH_START or view.last_clear_between(
                    run.start_seq, step_seq + 1) is not None
            out.append(BlockAt(Fate.NEVER) if known_empty else BlockAt(Fate.UNPLACED, history=History.GAP))
        elif node.stored_seq is None or node.stored_seq < run.start_seq:
            out.append(BlockAt(Fate.UNPLACED, node, History.GAP))  # the store predates the run
        elif node.removed_seq is not None and node.removed_seq <= step_seq:
            unproven = view.unproven and view.unproven_before(group, key, step_seq)
            out.append(BlockAt(Fate.UNPROVEN) if unproven else BlockAt(Fate.REMOVED, node))
        else:
            out.append(BlockAt(Fate.HELD, node))
    return out


def limiting_group_evidence(view: EpochResidency, facts: RequestFacts, step_seq: int, run: HistoryRun,
                            base: dict[str, Any], gap: dict[str, Any]) -> Evidence | None:
    """The evidence of the group that limited the hit, or None when the full-attention group
    did (or the index holds everything the groups needed): the caller judges H there."""
    b, chain = facts.block_size, facts.block_hashes or []
    primary = view.groups.get(view.primary_group)
    if primary is None or not primary.full_attention:
        kinds = sorted({kind_name(g) for g in view.groups.values()})
        return Evidence(history=History.CONTINUOUS, unmodelled=f"no full-attention group ({', '.join(kinds)})",
                        **base)
    if primary.block_size not in (0, b):  # fine-grained hash units: H may sit inside a block
        return Evidence(history=History.CONTINUOUS, group=primary.idx, unmodelled=(
            f"groups of block size {primary.block_size} for requests hashed in blocks of {b}"), **base)
    first = first_miss_index(facts.cached_tokens, b)
    limit = min(lookup_limit_blocks(facts.prompt_tokens, b), len(chain))
    run_end = first
    for at in fates(view, primary.idx, chain[first:limit], step_seq, run):
        if at.fate is not Fate.HELD:
            break
        run_end += 1
    if run_end == first:
        return None  # the full-attention group cut the hit at H itself
    others = sorted(g for g in {t.group for t in view.tiers if t.medium == "GPU"} if g != primary.idx)
    failing: list[tuple[int, list[BlockAt]]] = []
    for idx in others:
        rule = rule_for(view.groups.get(idx), b)
        if not rule.modelled:
            return Evidence(history=History.CONTINUOUS, group=idx, unmodelled=rule.reason, **base)
        found = fates(view, idx, [chain[i] for i in rule.needed(run_end)], step_seq, run)
        if any(at.fate is not Fate.HELD for at in found):
            failing.append((idx, found))
    if not failing:
        return None  # every group held what it needed: the caller finds H resident
    state = {idx: rule_for(view.groups.get(idx)).keeps_state for idx, _ in failing}  # a Mamba group's verdicts say so
    for idx, found in failing:
        for at in found:
            if at.fate is Fate.UNPLACED:
                history = at.history or History.GAP
                extra = gap if history is History.GAP else {}
                if history is History.AGED_OUT:
                    extra = {"window_start_ts": view.horizon_ts}
                return Evidence(history=history, group=idx, window_group=True, state_group=state[idx], **extra,
                                **base)
    for idx, found in failing:
        if any(at.fate is Fate.UNPROVEN for at in found):
            return Evidence(history=History.CONTINUOUS, group=idx, window_group=True, state_group=state[idx],
                            re_announced=True, **base)
    for idx, found in failing:
        for at in found:
            if at.fate is Fate.REMOVED:
                node = at.interval
                return Evidence(history=History.CONTINUOUS, presence=Presence.EVICTED, group=idx, window_group=True,
                                state_group=state[idx],
                                stored_seq=node.stored_seq, stored_ts=node.stored_ts,  # type: ignore[union-attr]
                                removed_seq=node.removed_seq, removed_ts=node.removed_ts,  # type: ignore[union-attr]
                                removed_by_clear=node.removed_by_clear, **base)  # type: ignore[union-attr]
    clear = view.last_clear_between(run.start_seq, step_seq + 1)
    start: dict[str, Any] = (dict(window_start=WindowStart.CLEAR, window_start_ts=clear[1]) if clear is not None
                             else dict(window_start=WindowStart.EPOCH_START, window_start_ts=run.start_ts))
    forgotten = view.pruned.forgotten_through  # aged-out blocks forgotten past the horizon
    if forgotten is not None and start["window_start_ts"] < forgotten:
        start = dict(window_start=WindowStart.HORIZON, window_start_ts=forgotten)  # "not recently"
    return Evidence(history=History.CONTINUOUS, presence=Presence.ABSENT, group=failing[0][0],
                    window_group=True, state_group=state[failing[0][0]], window_limit=True, **start, **base)
