"""Evidence: what the residency index can *prove* about a request's first-miss block.

`gather(index, facts)` judges H = h[C // B] on the chosen worker at the lookup time t and
returns an `Evidence` (schemas/attribution.py) for the pure `enricher.verdict.attribute`.

Timing rule (shared/reference/WIRE.md, "Timing inside one engine step"): every event of an
engine step is stamped with the step's publish time, after the lookups made during it. The
step containing a lookup at t is the first applied batch stamped at or after t. For the
chosen worker's H:
  * a store in that step happened *after* the lookup (had H been resident, it would have
    been hit) — so only stores in earlier steps count;
  * a removal in that step happened *before* the lookup (a resident H would have been hit
    and pinned, not evicted) — so removals up to and including that step count.
For claims that H was *held* somewhere (another worker, an offload tier), the removal
must come in a later step than the one containing t: anything else is not proof.

Continuity: a claim stands only if the batches from its starting point (the store of H, or
a known-empty point for "never stored") through the lookup step are one run. Quarantined
streams (a run after an unfilled hole with no clear since) and unverified epochs prove
nothing.

Idle workers: an engine publishes only when a step produced events, so a worker idle since
before t has no batch stamped after t. A tail confirmation (the publisher had nothing after
the last applied batch when it answered a probe sent at least ``index.tail_margin_s`` after
t) proves its history reaches t; the lookup step is then the virtual step after the last
applied batch (`EpochResidency.lookup_step`): everything applied came before t.

Clocks: every claim above places a worker's event times (its engine clock) against t, and
tail confirmations against kvmiss's clock, trusting each engine clock to be within
``[history] clock_skew_s`` of kvmiss's. ``clocks(worker)`` says what the service measured
(`ClockOffset`, from the sliding minimum of receive lags of live batches; None: nothing
measured). The chosen worker's goes into the evidence as a fact, judged by the verdict:
out of bound, no claim about it stands. Another worker whose clock is out of bound is
consulted for nothing: neither a holder nor ruled out (`Evidence.skewed_workers`).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable, Collection, Iterable
from typing import Any, NamedTuple, cast

from kvmiss.enricher.core.epoch_residency import EpochResidency
from kvmiss.enricher.core.geometry import first_miss_index, lookup_limit_blocks
from kvmiss.enricher.core.group_evidence import limiting_group_evidence
from kvmiss.enricher.core.index import TAIL_MARGIN_S, ResidencyIndex
from kvmiss.enricher.core.membership import INF, Standing
from kvmiss.enricher.core.residency_table import BlockTable, holding
from kvmiss.enricher.core.residency_types import GPU, HistoryRun, Interval
from kvmiss.schemas.attribution import (
    ClockOffset,
    Evidence,
    History,
    Holder,
    Presence,
    RequestFacts,
    TierHolding,
    WindowStart,
)
from kvmiss.schemas.stream import RunStart


def first_miss_hash(facts: RequestFacts) -> int | None:
    """h[C // B] when the request carries a long enough chain, else None."""
    chain = facts.block_hashes
    if not chain or facts.block_size <= 0:
        return None
    i = first_miss_index(facts.cached_tokens, facts.block_size)
    return chain[i] if 0 <= i < len(chain) else None


def _choose_view(views: list[EpochResidency], instance_hint: str | None, t: float,
                 margin: float = TAIL_MARGIN_S) -> EpochResidency | None:
    """The epoch view that served a lookup at t, or None when that cannot be established."""
    if instance_hint is not None:
        matching = [v for v in views if v.instance == instance_hint]
        if matching:
            return matching[0]
        if any(v.instance is not None for v in views):
            return None  # the request names an instance the index does not hold
    for newest, view in enumerate(views):  # newest first
        if view.first_ts is not None and view.first_ts <= t:
            if newest == 0:
                return view
            # An older lifetime serves t only if its history reaches past t; between two
            # lifetimes, which one served the lookup is not established.
            return view if view.reaches(t, margin) else None
    # t precedes every batch seen. With no earlier lifetime seen, it belongs to this one
    # only if this epoch's history starts at its seq 0.
    only = views[0]
    if len(views) == 1 and only.runs and only.runs[0].start is RunStart.EPOCH_START:
        return only
    return None


def _quarantined(view: EpochResidency, run: HistoryRun, step_seq: int) -> bool:
    return view.quarantine_hole(run, step_seq) is not None


class _Held(NamedTuple):
    """Whether a worker held a block at t: a proof either way, or why neither is possible."""

    node: Interval | None = None  # held: the interval proving it
    unresolved: History | None = None  # neither provable: why


_NOT_HELD = _Held()
# The worker's engine clock went back around t (`EpochResidency.clock_steps`): which of its
# batches came before t is not established, so its records prove nothing either way.
_STEPPED = _Held(unresolved=History.GAP)


def _held_on(view: EpochResidency, key: int, medium: str, step_seq: int, run: HistoryRun) -> _Held:
    """Whether ``key`` was resident on ``medium`` throughout the step containing t.

    Held: stored in this run before the step, not removed through the step. Not held: no
    store before the step, or removed before the step within the run. A removal *in* the
    step straddles t (the step ran on past it), and a store or removal before the run
    began leaves the hole in between: neither is provable.
    """
    node = view.interval_as_of(key, medium, step_seq)
    if view.unproven and view.unproven_before(view.primary_group, key, step_seq, medium):
        # a store not counted as a copy may have left one: resident stays provable (the
        # count is a lower bound), absence does not
        if node is None or (node.removed_seq is not None and node.removed_seq <= step_seq):
            return _Held(unresolved=History.GAP)
    if node is None:
        return _NOT_HELD
    removed = node.removed_seq
    if removed is not None and removed == step_seq:
        return _Held(unresolved=History.GAP)
    if removed is not None and removed < step_seq:
        return _NOT_HELD if removed >= run.start_seq else _Held(unresolved=History.GAP)
    if node.stored_seq is None or node.stored_seq < run.start_seq:
        return _Held(unresolved=History.GAP)
    return _Held(node)


def _worker_held(view: EpochResidency, key: int, t: float, media: Iterable[str] | None = None,
                 margin: float = TAIL_MARGIN_S) -> tuple[str | None, _Held]:
    """Whether any of ``media`` (default: every medium) of this worker epoch held ``key``
    at t: (medium, held) for a proof of holding, (None, not-held) for a proof of absence,
    (None, unresolved) otherwise."""
    if not view.epoch_certain:
        return None, _Held(unresolved=History.EPOCH_UNKNOWN)
    if view.horizon_ts is not None and t < view.horizon_ts:
        return None, _Held(unresolved=History.AGED_OUT)
    step_seq = view.lookup_step(t, margin)
    if step_seq is None:
        return None, _Held(unresolved=History.LAGGING)  # a store may be on its way
    if view.clock_steps and view.clock_step_at(t, margin) is not None:
        return None, _STEPPED
    run = view.run_at_step(step_seq)
    if run is None or _quarantined(view, run, step_seq):
        return None, _Held(unresolved=History.QUARANTINED)
    unresolved = None
    for medium in (view.media if media is None else media):
        if key not in view.media.get(medium, ()) and not (
                view.unproven and view.unproven_before(view.primary_group, key, step_seq, medium)):
            continue
        held = _held_on(view, key, medium, step_seq, run)
        if held.node is not None:
            return medium, held
        unresolved = unresolved or held.unresolved
    if unresolved is not None:
        return None, _Held(unresolved=unresolved)
    # No record either way: absence needs history from a known-empty point. A record that
    # retention dropped (`view.pruned`) closed before the horizon, and t is not before it
    # (checked above): it cannot have held the block at t, so it is not needed here.
    known_empty = run.start is RunStart.EPOCH_START or view.last_clear_between(run.start_seq, step_seq + 1)
    return None, (_NOT_HELD if known_empty else _Held(unresolved=History.GAP))


def _clean_without(view: EpochResidency, key: int, t: float, margin: float = TAIL_MARGIN_S) -> bool:
    """Fast proof of absence: no record of ``key`` at all, and the current run is continuous
    from a known-empty point before t through a batch after t (or a confirmed idle tail)."""
    since = view.known_empty_since
    if since is None or not since <= t or not view.epoch_certain:
        return False
    last = view.last_ts  # (reached by a batch after t: the common case, without a call)
    if (last is None or last < t) and not view.reaches(t, margin):
        return False
    if t < view.runs[-1].start_ts:
        return False
    if view.clock_steps and view.clock_step_at(t, margin) is not None:
        return False  # which known-empty point came before t is not established either
    for table in view.media.values():
        if key in table:
            return False
    if view.unproven:
        return False  # judged by `_worker_held`, which weighs stores not counted as copies
    # A dropped record closed before the horizon: it cannot have held the block at t >= it.
    if view.horizon_ts is None or t >= view.horizon_ts:
        return True
    forgotten = view.pruned.forgotten_through  # what the filter forgot closed before it
    return (forgotten is None or t >= forgotten) and key not in view.pruned


Clocks = Callable[[str], ClockOffset | None]  # worker id -> its measured clock, None: unmeasured


def _absence_window(view: EpochResidency | None, margin: float) -> tuple[float, float] | None:
    """The lookup times t at which this current view rules a block out by having no record
    of it (`_clean_without`'s key-independent conditions): from the latest of its known-empty
    point, its current run's start, its first batch and its retention horizon, through where
    its history is proven. None when no t qualifies."""
    if view is None or not view.epoch_certain or not view.runs or view.unproven or view.clock_steps:
        return None  # (stores not counted as copies, a clock that went back: judged one by one)
    since, through = view.known_empty_since, view.reached_through(margin)
    if since is None or through is None:
        return None
    # (first_ts is set once a run exists: a batch was applied)
    lo = max(since, view.runs[-1].start_ts, cast(float, view.first_ts))
    if view.horizon_ts is not None:
        lo = max(lo, view.horizon_ts)
    return (lo, through) if lo <= through else None  # (NaN compares false: never a window)


class FleetRound:
    """The fleet view's key-independent part for one state of the index and the clocks, so
    that a request pays for the workers that may matter to its block, not for the fleet.

    Built once per judging round (`Attributor` keeps it while ``index.generation`` and the
    clocks stay the same): each tracked worker is either skewed (its clock out of bound:
    consulted for nothing), judged one by one for every block (no absence window: a gap, an
    unsettled epoch, nothing applied yet), or has an absence window [lo, hi] of lookup times
    at which having no record of a block proves it absent. For one request `others` then
    returns, in fleet order, the workers to judge one by one: those without a window, those
    whose window misses t (two bisects), and those with a record of the block (one compiled
    sweep over their tables, `residency_table.holding`). Every other worker is ruled out by
    exactly the check `_clean_without` makes, so `_fleet` gives the answer the per-worker loop
    gives (tests/enricher/core/test_fleet_round.py holds them together)."""

    __slots__ = ("generation", "workers", "position", "skewed", "slow", "tables", "table_pos",
                 "_los", "_lo_pos", "_his", "_hi_pos", "_gone_until", "_gone_pos", "_gone_window",
                 "_gone_tables", "_gone_table_of", "_gone_first_table")

    def __init__(self, index: ResidencyIndex, clocks: Clocks | None = None):
        self.generation = index.generation
        margin = index.tail_margin_s
        self.workers: list[str] = sorted(index.tracked)  # sorted: no verdict may depend on set order
        self.position = {worker: pos for pos, worker in enumerate(self.workers)}
        # (worker, its clock, the last t it counts at: inf, or its departure plus the band)
        self.skewed: list[tuple[str, ClockOffset, float]] = []
        self.slow: list[int] = []
        tables: list[BlockTable] = []
        self.table_pos: list[int] = []
        windows: list[tuple[float, float, int]] = []
        # Workers departed now count only for lookups up to their departure plus the band,
        # ruled out then by their absence window as any other (or judged one by one, where
        # `_other_worker` applies the membership rules), consulted for nothing after -- so a
        # fleet that churns pays for the few that left lately.
        gone: list[tuple[float, int, tuple[float, float] | None, tuple[BlockTable, ...]]] = []
        current, membership = index.current, index.membership
        for pos, worker in enumerate(self.workers):
            clock = clocks(worker) if clocks is not None else None
            until = membership.departed_until(worker) if membership.departed or membership.released else None
            if until == -INF:
                continue  # released: counts for no lookup
            if clock is not None and not clock.within_bound:
                self.skewed.append((worker, clock, INF if until is None else until))
                continue
            view = current.get(worker)
            window = _absence_window(view, margin)
            if until is not None:
                held = () if window is None else tuple(view.media.values())  # type: ignore[union-attr]
                gone.append((until, pos, window, held))
                continue
            if window is None:
                self.slow.append(pos)
                continue
            windows.append((*window, pos))
            for table in view.media.values():  # type: ignore[union-attr]
                tables.append(table)
                self.table_pos.append(pos)
        self.tables = tuple(tables)
        windows.sort()
        self._los = [lo for lo, _, _ in windows]
        self._lo_pos = [pos for _, _, pos in windows]
        windows.sort(key=lambda w: w[1])
        self._his = [hi for _, hi, _ in windows]
        self._hi_pos = [pos for _, _, pos in windows]
        gone.sort(key=lambda g: g[0])
        self._gone_until = [g[0] for g in gone]
        self._gone_pos = [g[1] for g in gone]
        self._gone_window = [g[2] for g in gone]
        # Their tables, in that order, for one compiled sweep over those that count at t.
        self._gone_first_table: list[int] = []
        gone_tables: list[BlockTable] = []
        self._gone_table_of: list[int] = []
        for i, g in enumerate(gone):
            self._gone_first_table.append(len(gone_tables))
            gone_tables.extend(g[3])
            self._gone_table_of.extend([i] * len(g[3]))
        self._gone_tables = tuple(gone_tables)

    def others(self, chosen: str, key: int, t: float) -> list[str]:
        """The workers besides ``chosen`` that have to be judged one by one for ``key`` at
        ``t``, in fleet order (the rest provably never held it)."""
        if t != t:  # NaN: no window holds it, every worker not skewed is judged
            picked = {*self.slow, *self._lo_pos, *self._gone_pos}
        else:
            picked = set(self.slow)
            picked.update(self._lo_pos[bisect_right(self._los, t):])  # window starts after t
            picked.update(self._hi_pos[:bisect_left(self._his, t)])  # history not proven to t
            table_pos = self.table_pos
            picked.update(table_pos[i] for i in holding(key, self.tables))
            gone_pos = self._gone_pos
            start = bisect_left(self._gone_until, t) if gone_pos else 0
            if start < len(gone_pos):  # those that left at most a band before t, unless ruled out as above
                windows = self._gone_window
                for i in range(start, len(gone_pos)):
                    window = windows[i]
                    if window is None or not window[0] <= t <= window[1]:
                        picked.add(gone_pos[i])
                first = self._gone_first_table[start]
                table_of = self._gone_table_of
                picked.update(gone_pos[table_of[first + j]] for j in holding(key, self._gone_tables[first:]))
        picked.discard(self.position.get(chosen))
        workers = self.workers
        return [workers[pos] for pos in sorted(picked)]

    def skewed_at(self, chosen: str, t: float) -> tuple[ClockOffset, ...]:
        """The clocks out of bound of the workers besides ``chosen`` that count at ``t``."""
        if not self.skewed:
            return ()
        return tuple(clock for worker, clock, until in self.skewed if worker != chosen and not until < t)


class _Unsettled(str):
    """A worker whose membership at t decides, and is not settled (`Standing`)."""


class _Stepped(str):
    """A worker with a record of the block whose engine clock went back around t."""


def _other_worker(index: ResidencyIndex, worker: str, key: int, t: float,
                  margin: float) -> Holder | History | _Unsettled | _Stepped | None:
    """One other worker (its clock in bound): a holder of H at t, why it cannot be ruled
    out, or None when it provably did not hold H or was not a fleet member at t.

    Membership (enricher/core/membership.py): clearly after its departure it is nothing.
    Within a change's band, and before it (re)joined, its membership at t is not
    established: holding or maybe holding H leaves it unsettled (it can neither prove
    routing_miss nor be ruled out); only a proof that it did not hold H rules it out."""
    standing = index.membership.standing(worker, t)
    if standing is Standing.MEMBER:
        return _member_worker(index, worker, key, t, margin)
    if standing is Standing.DEPARTED:
        return None
    found = _member_worker(index, worker, key, t, margin)
    return None if found is None else _Unsettled(worker)


def _member_worker(index: ResidencyIndex, worker: str, key: int, t: float,
                   margin: float) -> Holder | History | _Stepped | None:
    """`_other_worker` for a fleet member at t."""
    view = index.current.get(worker)
    first_ts = view.first_ts if view is not None else None
    if first_ts is None or t < first_ts:  # (else the current lifetime served t: `_choose_view`)
        views = index.views(worker)
        view = _choose_view(views, None, t, margin) if views else None
        if view is None:
            return History.EPOCH_UNKNOWN if views else History.LAGGING
        if view.first_ts is not None and t < view.first_ts:
            return None  # a fresh epoch before its first batch: its cache was still empty
    # (view: not None here, the current one whenever first_ts was; no runtime check on this path)
    if _clean_without(view, key, t, margin):  # type: ignore[arg-type]
        return None  # provably never had it
    medium, held = _worker_held(view, key, t, margin=margin)  # type: ignore[arg-type]
    if held.node is not None:
        return Holder(worker, medium, held.node.stored_ts)  # type: ignore[arg-type]
    if held is _STEPPED:
        return _Stepped(worker)
    return held.unresolved


def _fleet(index: ResidencyIndex, chosen: str, key: int, t: float, clocks: Clocks | None = None,
           unsubscribed: Collection[str] = (), fleet: FleetRound | None = None,
           ) -> tuple[tuple[Holder, ...], tuple[History, ...], tuple[ClockOffset, ...], tuple[str, ...],
                      tuple[str, ...]]:
    """Every other tracked worker that counts at t: who provably held H at t, why the rest
    that may have cannot be ruled out, which were not consulted because their clock is out of
    bound, which held or may have held H while their membership at t is unsettled, and which
    have a record of H while their engine clock went back around t. All five decide whether a
    label below routing_miss is provable. Workers of the fleet that are
    not subscribed to (``unsubscribed``: named by spans, absent from the index) may have held
    H: each is unresolved, never absent. ``fleet``: the round's `FleetRound` (built here when
    not given: O(workers))."""
    if fleet is None:
        fleet = FleetRound(index, clocks)
    holders: list[Holder] = []
    unresolved: list[History] = [History.UNTRACKED for worker in unsubscribed if worker != chosen]
    unsettled: list[str] = []
    stepped: list[str] = []
    margin, membership = index.tail_margin_s, index.membership
    changed = membership.spans or membership.released  # else every worker is a member at every t
    unseen = t + membership.band_s > membership.known_through  # a change near t may not be seen yet
    for worker in fleet.others(chosen, key, t):
        if unseen or (changed and (worker in membership.spans or worker in membership.released)):
            found = _other_worker(index, worker, key, t, margin)
        else:
            found = _member_worker(index, worker, key, t, margin)
        cls = found.__class__
        if cls is Holder:
            holders.append(found)  # type: ignore[arg-type]
        elif cls is _Unsettled:
            unsettled.append(str(found))
        elif cls is _Stepped:
            stepped.append(str(found))
        elif found is not None:
            unresolved.append(found)  # type: ignore[arg-type]
    return (tuple(holders), tuple(unresolved), fleet.skewed_at(chosen, t) if fleet.skewed else (),
            tuple(unsettled), tuple(stepped))


def read_the_cache(facts: RequestFacts) -> bool:
    """Whether the request provably read the prefix cache: it hit a block, or its spans say it
    did not skip reading it (vLLM's `skip_reading_prefix_cache` false). Only then does the
    engine's hit rule speak for it: one that skips the cache misses blocks it holds."""
    b = facts.block_size
    return b > 0 and (facts.cached_tokens >= b or facts.skip_reading_prefix_cache is False)


def _no_copy_preceded(view: EpochResidency, facts: RequestFacts, step_seq: int) -> bool:
    """Two copies of the first missed block were stored in the lookup's step; had one been
    stored before the lookup (a request that skips the cache, scheduled first), the block
    would have been held when the request looked. For a request that read the cache
    (`read_the_cache`), the engine's hit rule over what its groups held, with that block held
    besides, would then have given a longer hit than it reported -- so no copy preceded the
    lookup, and the step's stores came after it. On a hybrid the block alone does not make a
    hit (a window group may not have kept the window there): what the step stored up to that
    first copy, in every group, is held besides (`EpochResidency.stored_in_step_through`). Otherwise
    (a request that may have skipped the cache, a group the rule does not model, a step whose
    order was not kept) the doubt stays."""
    chain, b = facts.block_hashes, facts.block_size
    if chain is None or not read_the_cache(facts):
        return False
    k = first_miss_index(facts.cached_tokens, b)
    also = view.stored_in_step_through(step_seq, chain[k]) if view.hybrid and k < len(chain) else None
    return view.engine_would_hit(chain, k + 1, lookup_limit_blocks(facts.prompt_tokens, b), b, step_seq, assume_held=k,
                                 also_held=also)


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
    ``clocks``: each tracked worker's measured clock offset (see the module docstring);
    None when the deployment does not measure it (offline, in-process: one host's clock).
    ``unsubscribed``: workers of the fleet the index does not follow (see `_fleet`).
    ``fleet``: a `FleetRound` of this index in its current state and these clocks, when the
    caller judges many requests between changes (built per call otherwise).
    """
    worker, t = facts.worker, facts.lookup_time
    if worker is None or worker not in index.tracked:
        return Evidence(history=History.UNTRACKED)
    clock = clocks(worker) if clocks is not None else None
    views = index.views(worker)
    if not views:
        return Evidence(history=History.LAGGING, clock=clock)  # tracked, nothing applied yet
    if t is None:
        return Evidence(history=History.LAGGING, epoch=views[0].epoch, clock=clock)
    margin = index.tail_margin_s
    view = _choose_view(views, facts.instance_hint, t, margin)
    if view is None or not view.epoch_certain:
        return Evidence(history=History.EPOCH_UNKNOWN, clock=clock)
    base: dict[str, Any] = dict(epoch=view.epoch, applied_through_ts=view.applied_through_ts, clock=clock)
    point = view.lookup_point(t, margin)
    if point.doubt is History.AGED_OUT:
        return Evidence(history=History.AGED_OUT, window_start_ts=point.horizon_ts, **base)
    if point.doubt is not None:
        return Evidence(history=point.doubt, **base)
    if point.clock_step_s is not None:  # t cannot be placed among this worker's batches
        return Evidence(history=History.CONTINUOUS, clock_step_s=point.clock_step_s, **base)
    step_seq, run = point.step_seq, point.run
    assert run is not None
    base["lookup_step_seq"] = step_seq
    key = first_miss_hash(facts)
    holders, unresolved, skewed, unsettled, stepped = (
        _fleet(index, worker, key, t, clocks, unsubscribed, fleet) if key is not None else ((), (), (), (), ()))
    tiers: list[TierHolding] = []
    for medium in view.media:
        if medium != GPU and key is not None:
            _, held = _worker_held(view, key, t, (medium,), margin)
            if held.node is not None:
                tiers.append(TierHolding(medium, held.node.stored_ts))
            elif held.unresolved is not None:
                unresolved += (held.unresolved,)
    base.update(holders=holders, tiers=tuple(tiers), unresolved_holders=unresolved,
                skewed_workers=skewed, unsettled_members=unsettled, stepped_workers=stepped)
    if point.hole is not None:
        return Evidence(history=History.QUARANTINED, gap_from_seq=point.hole[0], gap_to_seq=point.hole[1], **base)
    gap = point.gap
    if key is None:
        return Evidence(history=History.CONTINUOUS, **base)
    if view.hybrid:  # several KV-cache groups: the one that limited the hit decides
        found = limiting_group_evidence(view, facts, step_seq, run, base, gap)
        if found is not None:
            return found
        base["group"] = view.primary_group
    node = view.interval_as_of(key, GPU, step_seq)
    if node is not None:
        if node.stored_seq is None or node.stored_seq < run.start_seq:
            return Evidence(history=History.GAP, **gap, **base)  # store predates the run
        removed = node.removed_seq is not None and node.removed_seq <= step_seq
        if removed and view.unproven and view.unproven_before(view.primary_group, key, step_seq):
            # a store not counted as a copy (rule 7) may have outlived this removal
            return Evidence(history=History.CONTINUOUS, re_announced=True, **base)
        if removed and view.copied_in_step(key, step_seq) and not _no_copy_preceded(view, facts, step_seq):
            return Evidence(history=History.CONTINUOUS, same_step_copies=True, **base)
        return Evidence(
            history=History.CONTINUOUS,
            presence=Presence.EVICTED if removed else Presence.RESIDENT,
            stored_seq=node.stored_seq, stored_ts=node.stored_ts,
            removed_seq=node.removed_seq if removed else None,
            removed_ts=node.removed_ts if removed else None,
            removed_by_clear=removed and node.removed_by_clear,
            **base,
        )
    if view.copied_in_step(key, step_seq) and not _no_copy_preceded(view, facts, step_seq):
        return Evidence(history=History.CONTINUOUS, same_step_copies=True, **base)
    if view.unproven and view.unproven_before(view.primary_group, key, step_seq):
        return Evidence(history=History.CONTINUOUS, re_announced=True, **base)
    if key in view.pruned:
        if not aged_out_as_recent_match:
            return Evidence(history=History.AGED_OUT, window_start_ts=view.horizon_ts, **base)
        return Evidence(history=History.CONTINUOUS, presence=Presence.ABSENT,
                        window_start=WindowStart.HORIZON, window_start_ts=view.horizon_ts, **base)
    clear = view.last_clear_between(run.start_seq, step_seq + 1)
    since = clear[1] if clear is not None else run.start_ts if run.start is RunStart.EPOCH_START else None
    forgotten = view.pruned.forgotten_through
    if since is not None and forgotten is not None and since < forgotten:
        # Records dropped past `aged_out_horizon_s` were forgotten; each closed before
        # `forgotten`, so absence is proven from there only: "no recent match".
        return Evidence(history=History.CONTINUOUS, presence=Presence.ABSENT,
                        window_start=WindowStart.HORIZON, window_start_ts=forgotten, **base)
    if clear is not None:
        return Evidence(history=History.CONTINUOUS, presence=Presence.ABSENT,
                        window_start=WindowStart.CLEAR, window_start_ts=clear[1], **base)
    if run.start is RunStart.EPOCH_START:
        return Evidence(history=History.CONTINUOUS, presence=Presence.ABSENT,
                        window_start=WindowStart.EPOCH_START, window_start_ts=run.start_ts, **base)
    return Evidence(history=History.GAP, **gap, **base)


