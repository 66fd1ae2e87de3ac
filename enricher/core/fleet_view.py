"""The fleet at a lookup time: which other workers held a block, and why the rest cannot be
ruled out -- the question `routing_miss` and every label below it ask of the whole fleet.

`FleetRound` is its key-independent part, built once per state of the index and the clocks;
`others_at` answers for one block. Membership rules: enricher/core/membership.py; one
worker's answer: `worker_held` (enricher/core/worker_lookup.py).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable, Collection
from typing import NamedTuple

from kvmiss.enricher.core.index import ResidencyIndex
from kvmiss.enricher.core.membership import INF, Standing
from kvmiss.enricher.core.residency_table import BlockTable, holding
from kvmiss.enricher.core.worker_lookup import STEPPED, absence_window, choose_view, clean_without, worker_held
from kvmiss.schemas.attribution import ClockOffset, History, Holder

Clocks = Callable[[str], ClockOffset | None]  # worker id -> its measured clock, None: unmeasured


class FleetAt(NamedTuple):
    """The other workers at t for one block: who provably held it, why those that may have
    cannot be ruled out, whose clocks are out of bound, whose membership is unsettled, and
    whose engine clock went back around t (evidence fields of the same names)."""

    holders: tuple[Holder, ...] = ()
    unresolved: tuple[History, ...] = ()
    skewed: tuple[ClockOffset, ...] = ()
    unsettled: tuple[str, ...] = ()
    stepped: tuple[str, ...] = ()


NOBODY = FleetAt()  # no other worker held the block or may have: the common answer, made once


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
    exactly the check `clean_without` makes, so `_fleet` gives the answer the per-worker loop
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
            window = absence_window(view, margin)
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
            picked.update(map(self.table_pos.__getitem__, holding(key, self.tables)))  # (no generator frame)
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
        return list(map(self.workers.__getitem__, sorted(picked))) if picked else []

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
        view = choose_view(views, None, t, margin) if views else None
        if view is None:
            return History.EPOCH_UNKNOWN if views else History.LAGGING
        if view.first_ts is not None and t < view.first_ts:
            return None  # a fresh epoch before its first batch: its cache was still empty
    # (view: not None here, the current one whenever first_ts was; no runtime check on this path)
    if clean_without(view, key, t, margin):  # type: ignore[arg-type]
        return None  # provably never had it
    medium, held = worker_held(view, key, t, margin=margin)  # type: ignore[arg-type]
    if held.node is not None:
        return Holder(worker, medium, held.node.stored_ts)  # type: ignore[arg-type]
    if held is STEPPED:
        return _Stepped(worker)
    return held.unresolved


class _Answers:
    """The other workers' answers, sorted as they come (`others_at`, `candidates_at`)."""

    __slots__ = ("holders", "unresolved", "unsettled", "stepped")

    def __init__(self, unresolved: list[History]):
        self.holders: list[Holder] = []
        self.unresolved = unresolved
        self.unsettled: list[str] = []
        self.stepped: list[str] = []

    def add(self, found: Holder | History | _Unsettled | _Stepped | None) -> None:
        cls = found.__class__
        if cls is Holder:
            self.holders.append(found)  # type: ignore[arg-type]
        elif cls is _Unsettled:
            self.unsettled.append(str(found))
        elif cls is _Stepped:
            self.stepped.append(str(found))
        elif found is not None:
            self.unresolved.append(found)  # type: ignore[arg-type]

    def answer(self, skewed: tuple[ClockOffset, ...]) -> FleetAt:
        if not (self.holders or self.unresolved or self.unsettled or self.stepped or skewed):
            return NOBODY
        return FleetAt(tuple(self.holders), tuple(self.unresolved), skewed, tuple(self.unsettled),
                       tuple(self.stepped))


def candidates_at(index: ResidencyIndex, chosen: str, key: int, t: float, candidates: Collection[str],
                  clocks: Clocks | None = None) -> FleetAt:
    """`others_at` when the router said whom it could choose (``kvmiss.route.candidates``): the
    fleet at t is exactly those, so no membership is unsettled and no other worker counts. A
    candidate the index does not follow may have held H: unresolved, never absent."""
    answers = _Answers([])
    skewed: list[ClockOffset] = []
    margin = index.tail_margin_s
    for worker in sorted(candidates):
        if worker == chosen:
            continue
        if worker not in index.tracked:
            answers.add(History.UNTRACKED)
            continue
        clock = clocks(worker) if clocks is not None else None
        if clock is not None and not clock.within_bound:
            skewed.append(clock)
            continue
        answers.add(_member_worker(index, worker, key, t, margin))
    return answers.answer(tuple(skewed))


def others_at(index: ResidencyIndex, chosen: str, key: int, t: float, clocks: Clocks | None = None,
              unsubscribed: Collection[str] = (), fleet: FleetRound | None = None,
              candidates: Collection[str] | None = None) -> FleetAt:
    """Every other tracked worker that counts at t: who provably held H at t, why the rest
    that may have cannot be ruled out, which were not consulted because their clock is out of
    bound, which held or may have held H while their membership at t is unsettled, and which
    have a record of H while their engine clock went back around t. All five decide whether a
    label below routing_miss is provable. Workers of the fleet that are
    not subscribed to (``unsubscribed``: named by spans, absent from the index) may have held
    H: each is unresolved, never absent. ``fleet``: the round's `FleetRound` (built here when
    not given: O(workers)). ``candidates``: the router's candidate set (`candidates_at`)."""
    if candidates is not None:  # the router said whom it could choose
        return candidates_at(index, chosen, key, t, candidates, clocks)
    if fleet is None:
        fleet = FleetRound(index, clocks)
    answers = _Answers([History.UNTRACKED for worker in unsubscribed if worker != chosen])
    margin, membership = index.tail_margin_s, index.membership
    changed = membership.spans or membership.released  # else every worker is a member at every t
    unseen = t + membership.band_s > membership.known_through  # a change near t may not be seen yet
    for worker in fleet.others(chosen, key, t):
        if unseen or (changed and (worker in membership.spans or worker in membership.released)):
            answers.add(_other_worker(index, worker, key, t, margin))
        else:
            answers.add(_member_worker(index, worker, key, t, margin))
    return answers.answer(fleet.skewed_at(chosen, t) if fleet.skewed else ())
