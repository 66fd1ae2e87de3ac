"""Evidence: what the residency index can *prove* about a request's first-miss block.

`gather(index, facts)` asks the index about the chosen worker at the lookup time t
(`ResidencyIndex.lookup`: enricher/core/worker_lookup.py has the timing and continuity rules)
and about the rest of the fleet (`others_at`: enricher/core/fleet_view.py), and returns an
`Evidence` (schemas/attribution.py) for the pure `enricher.verdict.attribute`.

Clocks: every claim places a worker's event times (its engine clock) against t, trusting each
engine clock to be within ``[history] clock_skew_s`` of kvmiss's. ``clocks(worker)`` says what
the service measured (`ClockOffset`; None: nothing measured). The chosen worker's goes into the
evidence as a fact, judged by the verdict; another worker whose clock is out of bound is
consulted for nothing (`Evidence.skewed_workers`).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from kvmiss.enricher.core.fleet_view import NOBODY, Clocks, FleetRound, others_at
from kvmiss.enricher.core.geometry import first_miss_index, lookup_limit_blocks
from kvmiss.enricher.core.group_evidence import limiting_group_evidence
from kvmiss.enricher.core.index import ResidencyIndex
from kvmiss.enricher.core.worker_lookup import Fate, WorkerLookup
from kvmiss.schemas.attribution import Evidence, History, Presence, RequestFacts, WindowStart

__all__ = ["Clocks", "FleetRound", "first_miss_hash", "gather", "read_the_cache"]


def first_miss_hash(facts: RequestFacts) -> int | None:
    """h[C // B] when the request carries a long enough chain, else None."""
    chain = facts.block_hashes
    if not chain or facts.block_size <= 0:
        return None
    i = first_miss_index(facts.cached_tokens, facts.block_size)
    return chain[i] if 0 <= i < len(chain) else None


def read_the_cache(facts: RequestFacts) -> bool:
    """Whether the request provably read the prefix cache: it hit a block, or its spans say it
    did not skip reading it (vLLM's `skip_reading_prefix_cache` false). Only then does the
    engine's hit rule speak for it: one that skips the cache misses blocks it holds."""
    b = facts.block_size
    return b > 0 and (facts.cached_tokens >= b or facts.skip_reading_prefix_cache is False)


def _no_copy_preceded(at: WorkerLookup, facts: RequestFacts) -> bool:
    """Two copies of the first missed block were stored in the lookup's step; had one been
    stored before the lookup (a request that skips the cache, scheduled first), the block
    would have been held when the request looked. For a request that read the cache
    (`read_the_cache`), the engine's hit rule over what its groups held, with that block held
    besides, would then have given a longer hit than it reported -- so no copy preceded the
    lookup, and the step's stores came after it. On a hybrid the block alone does not make a
    hit (a window group may not have kept the window there): what the step stored up to that
    first copy, in every group, is held besides (`WorkerLookup.copy_would_have_hit`). Otherwise
    (a request that may have skipped the cache, a group the rule does not model, a step whose
    order was not kept) the doubt stays."""
    chain, b = facts.block_hashes, facts.block_size
    if chain is None or not read_the_cache(facts):
        return False
    return at.copy_would_have_hit(chain, first_miss_index(facts.cached_tokens, b),
                                  lookup_limit_blocks(facts.prompt_tokens, b), b)


def gather(
    index: ResidencyIndex,
    facts: RequestFacts,
    *,
    aged_out_as_recent_match: bool = False,
    clocks: Clocks | None = None,
    unsubscribed: Collection[str] = (),
    fleet: FleetRound | None = None,
) -> Evidence:
    """Judge the request's first-miss block against the index at its lookup time.

    ``aged_out_as_recent_match``: when a dropped record might have been H's, answer
    "no recent match" over the retained window instead of "aged out" (opt-in: it is true
    that H was not resident in the window, but it cannot tell evicted from never stored).
    ``clocks``: each tracked worker's measured clock offset (see the module docstring).
    ``unsubscribed``: workers of the fleet the index does not follow (`others_at`).
    ``fleet``: a `FleetRound` of this index in its current state and these clocks, when the
    caller judges many requests between changes (built per call otherwise).
    """
    worker, t = facts.worker, facts.lookup_time
    at = index.lookup(worker, t, facts.instance_hint)
    if at.doubt is History.UNTRACKED:
        return Evidence(history=History.UNTRACKED)
    clock = clocks(worker) if clocks is not None else None  # type: ignore[arg-type]
    if not at.placed:
        key = first_miss_hash(facts) if at.plain else None
        if key is None:
            return Evidence(history=at.doubt, epoch=at.epoch, clock=clock)  # type: ignore[arg-type]
        # Which lifetime served t is open, but none of them could give a label above
        # routing_miss: another member's proven hold of H still proves it (docs/HISTORY.md).
        fleet_at = others_at(index, worker, key, t, clocks, unsubscribed, fleet,  # type: ignore[arg-type]
                             facts.route_candidates)
        return Evidence(history=History.EPOCH_UNKNOWN, clock=clock, holders=fleet_at.holders,
                        unresolved_holders=fleet_at.unresolved, skewed_workers=fleet_at.skewed,
                        unsettled_members=fleet_at.unsettled, stepped_workers=fleet_at.stepped)
    base: dict[str, Any] = dict(epoch=at.epoch, applied_through_ts=at.applied_through_ts, clock=clock)
    if at.doubt is History.AGED_OUT:
        return Evidence(history=History.AGED_OUT, window_start_ts=at.horizon_ts, **base)
    if at.doubt is not None:
        return Evidence(history=at.doubt, **base)
    if at.clock_step_s is not None:  # t cannot be placed among this worker's batches
        return Evidence(history=History.CONTINUOUS, clock_step_s=at.clock_step_s, **base)
    base["lookup_step_seq"] = at.step_seq
    key = first_miss_hash(facts)
    fleet_at = NOBODY if key is None else others_at(index, worker, key, t, clocks, unsubscribed, fleet,  # type: ignore[arg-type]
                                                     facts.route_candidates)
    tiers, tier_doubts = at.tiers(key) if key is not None and at.tiered else ((), ())
    base.update(holders=fleet_at.holders, tiers=tiers, unresolved_holders=fleet_at.unresolved + tier_doubts,
                skewed_workers=fleet_at.skewed, unsettled_members=fleet_at.unsettled,
                stepped_workers=fleet_at.stepped)
    if at.hole is not None:
        return Evidence(history=History.QUARANTINED, gap_from_seq=at.hole[0], gap_to_seq=at.hole[1], **base)
    if key is None:
        return Evidence(history=History.CONTINUOUS, **base)
    if at.hybrid:  # several KV-cache groups: the one that limited the hit decides
        found = limiting_group_evidence(at, facts, base)
        if found is not None:
            return found
        base["group"] = at.primary_group
    return _primary_evidence(at, facts, key, base, aged_out_as_recent_match)


def _primary_evidence(at: WorkerLookup, facts: RequestFacts, key: int, base: dict[str, Any],
                      aged_out_as_recent_match: bool) -> Evidence:
    """H's fate in the full-attention group of the chosen worker, as evidence."""
    block = at.fate(key)
    fate, node = block.fate, block.interval
    if node is not None and fate is Fate.UNPLACED:
        return Evidence(history=History.GAP, **at.gap, **base)  # the store predates the run
    if node is not None and fate is Fate.UNPROVEN:
        # a store not counted as a copy (rule 7) may have outlived this removal
        return Evidence(history=History.CONTINUOUS, re_announced=True, **base)
    if block.copied and fate is not Fate.HELD and not _no_copy_preceded(at, facts):
        return Evidence(history=History.CONTINUOUS, same_step_copies=True, **base)
    if node is not None:
        removed = fate is Fate.REMOVED
        return Evidence(
            history=History.CONTINUOUS,
            presence=Presence.EVICTED if removed else Presence.RESIDENT,
            stored_seq=node.stored_seq, stored_ts=node.stored_ts,
            removed_seq=node.removed_seq if removed else None,
            removed_ts=node.removed_ts if removed else None,
            removed_by_clear=removed and node.removed_by_clear,
            **base,
        )
    if fate is Fate.UNPROVEN:
        return Evidence(history=History.CONTINUOUS, re_announced=True, **base)
    if block.history is History.AGED_OUT:
        if not aged_out_as_recent_match:
            return Evidence(history=History.AGED_OUT, window_start_ts=at.horizon_ts, **base)
        return Evidence(history=History.CONTINUOUS, presence=Presence.ABSENT,
                        window_start=WindowStart.HORIZON, window_start_ts=at.horizon_ts, **base)
    if block.since is None:  # no known-empty point in the run
        return Evidence(history=History.GAP, **at.gap, **base)
    return Evidence(history=History.CONTINUOUS, presence=Presence.ABSENT, window_start=block.since[0],
                    window_start_ts=block.since[1], **base)
