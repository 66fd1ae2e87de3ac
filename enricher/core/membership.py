"""Fleet membership over time: which workers a router could choose at a lookup time.

A worker's membership is a list of spans [joined, departed) on kvmiss's clock, as the
membership sources observed them. Each end is an interval: a change was made after the
source's previous answer and by the one that showed it (`schemas.fleet.FleetChange.since`
and ``at``); a file that says when it changed makes the interval a point. A worker of the static
``[[workers]]`` list, or one the index met only through its batches, has no span: it is a
member from the start, forever, unless a change departs it.

A source says when *its answer* changed, not when the router stopped (or started) choosing
the worker, and lookup times are on the engines' clocks. So every change has an uncertainty
band of ``band_s`` either side of its interval (``[fleet] membership_uncertainty_s``: it must
cover the router's lag behind the source and the engines' clock skew). At a lookup time t a
worker is:

  * ``MEMBER``: inside a span, clear of both its bands -- it counts as it always did;
  * ``UNSETTLED``: within the band of a join or a departure -- neither a candidate holder
    that proves ``routing_miss`` nor one that can be ruled out without proof of absence;
  * ``DEPARTED``: clearly after its last departure, with no later join -- not a candidate
    holder at all (it cannot be chosen, and it never needs ruling out);
  * ``NOT_YET``: clearly outside every span, with a join after t. A source says when kvmiss
    learned of a member, not since when it was one (a file read at start-up names workers
    that were members long before), so its membership at t is not established: like
    ``UNSETTLED``, it neither proves ``routing_miss`` nor is ruled out without proof of
    absence (a block it held then would mean the router was choosing it already).

A source may also have said nothing yet about a lookup time: a change the router made at t
is seen by kvmiss up to a band later, so until the sources have been asked a band after t
(``known_through``, set by whoever polls them), every worker not clearly outside its spans is
``UNSETTLED`` at t -- it may have departed, or come back, unseen. The service waits for that
before judging; the rule keeps a verdict given anyway (its wait ran out while a source was
failing) honest.

docs/HISTORY.md, "Fleets that change", states the rules and their tests. Pure: no clocks,
times are arguments.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Iterable

from kvmiss.schemas.config import WorkerSpec

INF = float("inf")
RELEASED_KEPT = 4096  # ids of released workers remembered (spans naming them are not the fleet's)
BAND_MAX_S = 60.0  # the most a router's own choices may widen the band to
BAND_HEADROOM = 1.5  # a widened band covers the lag seen times this


class Standing(enum.Enum):
    MEMBER = "member"
    UNSETTLED = "unsettled"
    DEPARTED = "departed"
    NOT_YET = "not_yet"


class Joined(enum.Enum):
    """What a join did to a worker (`Membership.join`)."""

    SAME = "same"  # already a member with this spec (or adopted a spec for a static member)
    NEW = "new"  # not a member before
    REJOINED = "rejoined"  # had departed: a new membership span, nothing carried over
    REPLACED = "replaced"  # a member with another spec: departed and joined at once


class Membership:
    """Per-worker membership spans; see the module docstring. Not thread-safe."""

    def __init__(self, static: Iterable[str] = (), *, band_s: float = 0.5, dynamic: bool = False):
        if not band_s >= 0:
            raise ValueError("membership band must be >= 0")
        self.band_s = band_s
        self.static = set(static)  # members from the start, without a span until a change
        # True when a source other than the static list may change the fleet: then a worker
        # spans name before any source announced it may be a joiner (the pipeline waits).
        self.dynamic = dynamic
        # worker -> [[joined_since, joined_at, departed_since, departed_at], ...], oldest first;
        # none for a member from the start (a change was made in (since, at]; INF: not yet)
        self.spans: dict[str, list[list[float]]] = {}
        self._rejoined: set[str] = set()  # members with an ended span before their current one
        self.specs: dict[str, WorkerSpec] = {}  # members' specs, as the sources gave them
        self.departed: dict[str, float] = {}  # not a member now -> when it left (kvmiss clock)
        self.released: collections.OrderedDict[str, float] = collections.OrderedDict()
        # Every source's changes made before this time (kvmiss clock) have been seen: +inf for
        # a fleet no source watches; a service polling sources starts it at -inf (`watched`).
        self.known_through = INF
        self.joins = 0
        self.departures = 0
        self.band_widened = 0  # times the router's own choices showed the band too short

    # --- changes ---------------------------------------------------------------------------

    def watched(self) -> None:
        """Sources will tell changes from now on: nothing is known about them yet."""
        self.dynamic = True
        self.known_through = -INF

    def seen_through(self, at: float) -> None:
        """Every source has been asked since ``at``: changes made before it are known."""
        if at > self.known_through:
            self.known_through = at

    def has_span(self, worker: str) -> bool:
        """Whether a change has given ``worker`` a membership span."""
        return worker in self.spans

    def is_member(self, worker: str) -> bool:
        spans = self.spans.get(worker)
        return spans[-1][3] == INF if spans is not None else worker not in self.released

    def join(self, spec: WorkerSpec, at: float, since: float | None = None) -> Joined:
        """``spec`` joined by ``at`` (and after ``since``, when the source's previous answer
        tells that; else at ``at``)."""
        since = at if since is None or since > at else since
        worker, spans = spec.id, self.spans.get(spec.id)
        self.released.pop(worker, None)
        if self.is_member(worker) and (spans is not None or worker in self.static):
            known = self.specs.get(worker)
            if known is None or known == spec:
                self.specs[worker] = spec
                return Joined.SAME
            self._close(worker, at, since)  # another engine under the same id: a new span
            self.spans[worker].append([since, at, INF, INF])
            self._rejoined.add(worker)
            self.specs[worker] = spec
            self.joins += 1
            self.departures += 1
            return Joined.REPLACED
        self.specs[worker] = spec
        self.joins += 1
        if spans is None:
            self.spans[worker] = [[since, at, INF, INF]]
            return Joined.NEW
        self.departed.pop(worker, None)
        spans.append([max(since, spans[-1][2]), max(at, spans[-1][3]), INF, INF])
        self._rejoined.add(worker)
        return Joined.REJOINED

    def depart(self, worker: str, at: float, since: float | None = None) -> bool:
        """``worker`` departed by ``at`` (and after ``since``, as for `join`). False when it
        was not a member (nothing to do)."""
        if not self.is_member(worker) or (worker not in self.spans and worker not in self.static):
            return False
        self._close(worker, at, at if since is None or since > at else since)
        self.specs.pop(worker, None)
        self.departed[worker] = self.spans[worker][-1][3]  # (never before its join: see `_close`)
        self.departures += 1
        return True

    def _close(self, worker: str, at: float, since: float) -> None:
        span = self.spans.setdefault(worker, [[-INF, -INF, INF, INF]])[-1]
        span[2], span[3] = max(since, span[0]), max(at, span[1])

    def release(self, before: float) -> list[str]:
        """Forget departed workers that left before ``before`` (kvmiss clock, band included by
        the caller), and spans of members that ended before it; returns the workers forgotten."""
        gone = [w for w, at in self.departed.items() if at < before]
        for worker in gone:
            del self.departed[worker]
            del self.spans[worker]
            self.released[worker] = before
            if len(self.released) > RELEASED_KEPT:
                self.released.popitem(last=False)
        for worker in list(self._rejoined):
            spans = self.spans.get(worker)
            if spans is None or spans[-1][3] != INF:
                self._rejoined.discard(worker)  # departed again, or released: handled above
            elif spans[0][3] < before:
                spans[:] = [s for s in spans[:-1] if s[3] >= before] + spans[-1:]
                if len(spans) == 1:
                    self._rejoined.discard(worker)
        return gone

    def chosen(self, worker: str, t: float) -> float | None:
        """The router chose ``worker`` for a lookup at ``t``: its own view of the fleet then. A
        choice clearly after the worker's departure (its interval plus the band) shows this
        router lags its source by more than the band: the band is widened to cover that lag
        with headroom (at most `BAND_MAX_S`), and the lag seen is returned; else None. Pure:
        the caller says when, and logs."""
        spans = self.spans.get(worker)
        if spans is None or t != t:
            return None
        departed = None
        for joined_since, _, _, departed_at in spans:
            if joined_since <= t:
                departed = departed_at
        if departed is None or departed == INF or not t > departed + self.band_s:
            return None
        lag = t - departed
        widened = min(BAND_MAX_S, lag * BAND_HEADROOM)
        if widened > self.band_s:
            self.band_s = widened
            self.band_widened += 1
        return lag

    # --- queries ---------------------------------------------------------------------------

    def standing(self, worker: str, t: float) -> Standing:
        """The worker's place in the fleet at lookup time ``t`` (see the module docstring)."""
        spans = self.spans.get(worker)
        if spans is None:
            if t + self.band_s > self.known_through:  # (False for NaN: placed as before)
                return Standing.UNSETTLED
            return Standing.DEPARTED if worker in self.released else Standing.MEMBER
        if t != t:  # NaN: nothing can be placed
            return Standing.UNSETTLED
        band, later_join = self.band_s, False
        for joined_since, joined, departed_since, departed in spans:
            if joined + band < t < departed_since - band:
                return Standing.MEMBER if t + band <= self.known_through else Standing.UNSETTLED
            if joined_since - band <= t <= joined + band or departed_since - band <= t <= departed + band:
                return Standing.UNSETTLED
            later_join = later_join or joined_since > t
        if later_join:
            return Standing.NOT_YET
        return Standing.DEPARTED if t + band <= self.known_through else Standing.UNSETTLED

    def departed_until(self, worker: str) -> float | None:
        """For a worker departed now: the last lookup time at which it may still count (its
        departure plus the band; -inf once released); None for a member."""
        at = self.departed.get(worker)
        if at is None:
            return -INF if worker in self.released and worker not in self.spans else None
        return at + self.band_s

    def joined_at(self, worker: str) -> float | None:
        """When a source announced the worker's current membership (None: a member from the
        start, or not a member now)."""
        spans = self.spans.get(worker)
        return spans[-1][1] if spans is not None and spans[-1][3] == INF and spans[-1][1] != -INF else None

    def members(self) -> list[str]:
        """Members now that a source announced or the static list named (sorted)."""
        named = self.static | self.spans.keys() | self.specs.keys()
        return sorted(w for w in named if self.is_member(w))

    def known_departed(self, worker: str) -> bool:
        """Whether ``worker`` left the fleet (departed now, or released since)."""
        return worker in self.departed or worker in self.released

    @property
    def due(self) -> bool:
        """Whether `release` may have something to forget."""
        return bool(self.departed or self._rejoined)

    @property
    def span_count(self) -> int:
        return sum(len(spans) for spans in self.spans.values())
