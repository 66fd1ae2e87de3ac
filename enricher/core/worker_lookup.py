"""The narrow query between evidence and the residency index: one worker at a lookup time.

`ResidencyIndex.lookup(worker, t)` answers with a `WorkerLookup`: which process lifetime served
the lookup and where t falls in its history (the doubts: lagging, aged out, a clock step, a
quarantine hole), and then, one question at a time, each block's fate there (`fate`),
what the worker's offload tiers held (`tiers`) and what the engine's hit rule would have made of
a copy stored before the lookup (`copy_would_have_hit`). Other workers are asked `worker_held`
(enricher/core/fleet_view.py). The fast-path guards (stores not yet counted as copies, same-step
copies) live here, behind the query.

Timing rule (shared/reference/WIRE.md, "Timing inside one engine step"): every event of an
engine step is stamped with the step's publish time, after the lookups made during it. The
step containing a lookup at t is the first applied batch stamped at or after t. For the
chosen worker's block: a store in that step happened *after* the lookup, a removal in it
*before*. For claims that a block was *held* somewhere (another worker, an offload tier),
the removal must come in a later step than the one containing t.

Continuity: a claim stands only if the batches from its starting point (the store, or a
known-empty point for "never stored") through the lookup step are one run. An idle worker's
history reaches t through a tail confirmation (`EpochLog.reached_through`); the lookup step is
then the virtual step after the last applied batch.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple, cast

from kvmiss.enricher.core.epoch_log import TAIL_MARGIN_S, LookupPoint
from kvmiss.enricher.core.epoch_residency import EpochResidency
from kvmiss.enricher.core.hit_rule import kind_name
from kvmiss.enricher.core.residency_types import GPU, HistoryRun, Interval
from kvmiss.schemas.attribution import History, KVCacheGroup, TierHolding, WindowStart
from kvmiss.schemas.stream import RunStart


def choose_view(views: list[EpochResidency], instance_hint: str | None, t: float,
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



class Held(NamedTuple):
    """Whether a worker held a block at t: a proof either way, or why neither is possible."""

    node: Interval | None = None  # held: the interval proving it
    unresolved: History | None = None  # neither provable: why


NOT_HELD = Held()
# The worker's engine clock went back around t (`EpochResidency.clock_steps`): which of its
# batches came before t is not established, so its records prove nothing either way.
STEPPED = Held(unresolved=History.GAP)


def _held_on(view: EpochResidency, key: int, medium: str, step_seq: int, run: HistoryRun) -> Held:
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
            return Held(unresolved=History.GAP)
    if node is None:
        return NOT_HELD
    removed = node.removed_seq
    if removed is not None and removed == step_seq:
        return Held(unresolved=History.GAP)
    if removed is not None and removed < step_seq:
        return NOT_HELD if removed >= run.start_seq else Held(unresolved=History.GAP)
    if node.stored_seq is None or node.stored_seq < run.start_seq:
        return Held(unresolved=History.GAP)
    return Held(node)


def worker_held(view: EpochResidency, key: int, t: float, media: Iterable[str] | None = None,
                 margin: float = TAIL_MARGIN_S) -> tuple[str | None, Held]:
    """Whether any of ``media`` (default: every medium) of this worker epoch held ``key``
    at t: (medium, held) for a proof of holding, (None, not-held) for a proof of absence,
    (None, unresolved) otherwise."""
    if not view.epoch_certain:
        return None, Held(unresolved=History.EPOCH_UNKNOWN)
    if view.horizon_ts is not None and t < view.horizon_ts:
        return None, Held(unresolved=History.AGED_OUT)
    step_seq = view.lookup_step(t, margin)
    if step_seq is None:
        return None, Held(unresolved=History.LAGGING)  # a store may be on its way
    if view.clock_steps and view.clock_step_at(t, margin) is not None:
        return None, STEPPED
    run = view.run_at_step(step_seq)
    if run is None or view.quarantine_hole(run, step_seq) is not None:
        return None, Held(unresolved=History.QUARANTINED)
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
        return None, Held(unresolved=unresolved)
    # No record either way: absence needs history from a known-empty point. A record that
    # retention dropped (`view.pruned`) closed before the horizon, and t is not before it
    # (checked above): it cannot have held the block at t, so it is not needed here.
    known_empty = run.start is RunStart.EPOCH_START or view.last_clear_between(run.start_seq, step_seq + 1)
    return None, (NOT_HELD if known_empty else Held(unresolved=History.GAP))


def clean_without(view: EpochResidency, key: int, t: float, margin: float = TAIL_MARGIN_S) -> bool:
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



def absence_window(view: EpochResidency | None, margin: float) -> tuple[float, float] | None:
    """The lookup times t at which this current view rules a block out by having no record
    of it (`clean_without`'s key-independent conditions): from the latest of its known-empty
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


class Fate(enum.Enum):
    """A block of one KV-cache group at the lookup time, on the chosen worker."""

    HELD = "held"
    REMOVED = "removed"  # stored in this run, removed before t
    NEVER = "never"  # no record since a known-empty point
    UNPROVEN = "unproven"  # a store not counted as a copy (rule 7) leaves it open
    UNPLACED = "unplaced"  # history cannot say (``history``: why)


class BlockAt(NamedTuple):
    """One block's fate; ``interval`` its latest record before the lookup step, ``copied``: two
    copies of it were stored in the lookup's step (primary group only), ``since``: for NEVER,
    where its absence is proven from (`WorkerLookup.absence_since`)."""

    fate: Fate
    interval: Interval | None = None
    history: History | None = None
    copied: bool = False
    since: tuple[WindowStart, float] | None = None


class GroupsAt(NamedTuple):
    """The lifetime's KV-cache groups: the primary (full-attention) one, the other groups with a
    GPU table in ascending order, and every kind named (for messages)."""

    primary: KVCacheGroup | None
    others: list[tuple[int, KVCacheGroup | None]]
    kinds: list[str]


class WorkerLookup:
    """One worker at a lookup time t (`ResidencyIndex.lookup`); see the module docstring.

    ``doubt`` is None when the lookup is placed in a lifetime's history; then ``step_seq``
    is its engine step and every block question may be asked. Otherwise it names what is
    missing (UNTRACKED, LAGGING, EPOCH_UNKNOWN before a lifetime is chosen, AGED_OUT or
    LAGGING within it) and ``placed`` says whether a lifetime was chosen. ``plain``: with
    EPOCH_UNKNOWN, every lifetime that may have served t had one full-attention group and no
    offload tier."""

    __slots__ = ("doubt", "placed", "epoch", "applied_through_ts", "horizon_ts", "step_seq", "gap",
                 "clock_step_s", "hole", "hybrid", "tiered", "plain", "_view", "_run", "_t", "_margin")

    # (set only when ``placed``: the block questions are asked only then, unchecked on this path)
    _view: EpochResidency
    _run: HistoryRun

    def __init__(self, doubt: History | None, view: EpochResidency | None = None, point: LookupPoint | None = None,
                 t: float = 0.0, margin: float = TAIL_MARGIN_S, epoch: int | None = None, plain: bool = False):
        self._view, self._t, self._margin, self.plain = view, t, margin, plain  # type: ignore[assignment]
        self.placed = view is not None
        self.epoch = view.epoch if view is not None else epoch
        self.applied_through_ts = view.applied_through_ts if view is not None else None
        self.hybrid = view.hybrid if view is not None else False
        # offload tiers besides the GPU (`tiers` is asked only then)
        self.tiered = view is not None and (len(view.media) > 1 or GPU not in view.media)
        if point is None:
            self.doubt, self.horizon_ts, self.step_seq, self._run = doubt, None, -1, None  # type: ignore[assignment]
            self.gap: dict[str, Any] = {}
            self.clock_step_s: float | None = None
            self.hole: tuple[int | None, int | None] | None = None
        else:
            (self.doubt, self.horizon_ts, self.step_seq, self._run,
             self.gap, self.clock_step_s, self.hole) = point  # type: ignore[assignment]

    # --- one block on the chosen worker ------------------------------------------------------

    def fate(self, key: int, group: int | None = None) -> BlockAt:
        """``key``'s fate in ``group`` (default: the primary, full-attention group) on the GPU
        at the lookup step: the chosen worker's timing rule (a removal in the step counts)."""
        view, step = self._view, self.step_seq
        primary = view.primary_group
        if group is None or group == primary:
            node = view.interval_as_of(key, GPU, step)
            group = primary
        else:
            node = view.residency(group, (key,), step)[0]
        unproven = bool(view.unproven) and view.unproven_before(group, key, step)
        if node is None or (node.removed_seq is not None and node.removed_seq <= step):
            copied = group == primary and view.copied_in_step(key, step)
        if node is None:
            if unproven:
                return BlockAt(Fate.UNPROVEN, copied=copied)
            if key in view.pruned:
                return BlockAt(Fate.UNPLACED, history=History.AGED_OUT, copied=copied)
            since = self.absence_since()
            if since is None:
                return BlockAt(Fate.UNPLACED, history=History.GAP, copied=copied)
            return BlockAt(Fate.NEVER, copied=copied, since=since)
        run = self._run
        if node.stored_seq is None or node.stored_seq < run.start_seq:
            return BlockAt(Fate.UNPLACED, node, History.GAP)  # the store predates the run
        if node.removed_seq is not None and node.removed_seq <= step:
            return BlockAt(Fate.UNPROVEN, node) if unproven else BlockAt(Fate.REMOVED, node, copied=copied)
        return BlockAt(Fate.HELD, node)

    def absence_since(self) -> tuple[WindowStart, float] | None:
        """Where a block with no record counts as never stored from: the last clear in the
        run, the epoch's start, or (records forgotten past the aged-out horizon) the point
        through which they were forgotten; None when the run has no known-empty point."""
        view, run = self._view, self._run
        clear = view.last_clear_between(run.start_seq, self.step_seq + 1)
        if clear is not None:
            start = (WindowStart.CLEAR, clear[1])
        elif run.start is RunStart.EPOCH_START:
            start = (WindowStart.EPOCH_START, run.start_ts)
        else:
            return None
        forgotten = view.pruned.forgotten_through  # each forgotten record closed before it
        if forgotten is not None and start[1] < forgotten:
            return (WindowStart.HORIZON, forgotten)  # "no recent match"
        return start

    def tiers(self, key: int) -> tuple[tuple[TierHolding, ...], tuple[History, ...]]:
        """The chosen worker's offload tiers that held ``key`` at t, and why others may have."""
        view = self._view
        held_on: list[TierHolding] = []
        unresolved: list[History] = []
        for medium in view.media:
            if medium != GPU:
                _, held = worker_held(view, key, self._t, (medium,), self._margin)
                if held.node is not None:
                    held_on.append(TierHolding(medium, held.node.stored_ts))
                elif held.unresolved is not None:
                    unresolved.append(held.unresolved)
        return tuple(held_on), tuple(unresolved)

    def copy_would_have_hit(self, chain: Sequence[int], k: int, limit: int, block_size: int) -> bool:
        """Had a copy of ``chain[k]`` stored in the lookup's step been there before the lookup
        (with what the step stored up to it, in every group), whether the engine's hit rule
        would have given more than ``k`` blocks (`EpochResidency.engine_would_hit`)."""
        view, step = self._view, self.step_seq
        also = view.stored_in_step_through(step, chain[k]) if view.hybrid and k < len(chain) else None
        return view.engine_would_hit(chain, k + 1, limit, block_size, step, assume_held=k, also_held=also)

    @property
    def primary_group(self) -> int:
        return self._view.primary_group

    def groups(self) -> GroupsAt:
        """The lifetime's KV-cache groups (`GroupsAt`)."""
        view = self._view
        primary = view.primary_group
        others = sorted({tier.group for tier in view.tiers if tier.medium == GPU and tier.group != primary})
        return GroupsAt(view.groups.get(primary), [(idx, view.groups.get(idx)) for idx in others],
                        sorted({kind_name(g) for g in view.groups.values()}))
